"""Weight-only quantization (int8, int4, AutoAWQ checkpoints): formats, quantized linear
layers, model conversion and AWQ loading."""

from engine.runner.quant.apply import QuantSummary, load_awq, quantize_model

__all__ = ["QuantSummary", "load_awq", "quantize_model"]
