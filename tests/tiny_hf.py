"""A tiny random Llama saved as a local Hugging Face folder (weights + the embedded model's
tokenizer), built in a temp folder: the same weights load in our engine and in transformers,
so tests compare the two on identical numbers. Nothing is downloaded."""

from __future__ import annotations

import shutil
from pathlib import Path

# Larger than HF's default init (0.02) so the random model's distributions are peaked: scores
# that differ by more than float noise (an accuracy comparison must not hinge on ties).
INIT_STD = 0.3


def save_tiny_llama(folder: Path, seed: int = 0) -> Path:
    """Write config.json, model.safetensors and tokenizer files into `folder`; returns it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.tokenizer import embedded_tokenizer_dir

    tokenizer_dir = embedded_tokenizer_dir()
    config = LlamaConfig(
        vocab_size=49152,  # the embedded tokenizer's
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=INIT_STD,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "chat_template.jinja"):  # fmt: skip
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, folder / name)
    return folder


def reference_logprobs(folder: Path, token_ids: list[int]):
    """log_softmax of a plain float32 transformers forward over `token_ids`: [T, V]; row p
    scores the token at p + 1."""
    import torch
    from transformers import LlamaForCausalLM

    model = _hf_model(folder)
    assert isinstance(model, LlamaForCausalLM)
    with torch.inference_mode():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


_MODELS: dict[Path, object] = {}


def _hf_model(folder: Path):
    import torch
    from transformers import LlamaForCausalLM

    if folder not in _MODELS:
        _MODELS[folder] = LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    return _MODELS[folder]
