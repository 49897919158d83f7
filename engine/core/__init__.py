"""The engine loop: scheduler, block manager, speculative decoding, output processing.

No tensors here: only the model runner (engine.runner) builds them."""
