"""Produce an AutoAWQ (GEMM, 4-bit, zero point) checkpoint from a float Hugging Face Llama
folder with the `autoawq` package: calibrated on local text, in float32, on CPU or GPU.

AutoAWQ does the work (activation-aware scale search, folding the scales into the preceding
norms and linears, packing with WQLinear_GEMM.from_linear); we pick the text, guard its CPU
corruption (cpu_guard.py) and write the folder: config.json with quantization_config,
model.safetensors with qweight / qzeros / scales per linear, the source's tokenizer files.
The model is built from the folder's config with transformers and AutoAWQ's Llama wrapper
is constructed around it directly (its from_pretrained would reach for the hub for a name).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.quantize.calib import calibration_blocks, install_local_calib_data

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "tokenizer.model", "generation_config.json")  # fmt: skip


@dataclass(frozen=True)
class AwqSettings:
    group_size: int = 64  # inputs per scale/zero pair (must divide every in_features)
    calib_samples: int = 8  # blocks of calibration text (4,096 tokens)
    calib_seq_len_tokens: int = 512  # tokens per block
    apply_clip: bool = False  # AutoAWQ's weight-clipping search: ~2x the time on CPU
    cpu_guard: bool = True  # False only to show the corruption (tests)


def quantize_awq(src: Path, out: Path, settings: AwqSettings, tokenizer: Any = None) -> dict:
    """Quantize the float folder `src` into `out` (created; must not exist). Returns a report
    (seconds, blocks, settings). `tokenizer` defaults to the folder's own."""
    from transformers import LlamaForCausalLM

    from engine.tokenizer import load_tokenizer_files

    if out.exists():
        raise ValueError(f"out: {out} already exists")
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer_files(src)
    if tokenizer is None:
        raise ValueError(f"model: {src} has no tokenizer to cut the calibration text with")
    blocks = calibration_blocks(tokenizer, settings.calib_samples, settings.calib_seq_len_tokens)
    # float32: fp16 matmuls on CPU are unusably slow (and AutoAWQ casts to fp16 only to pack).
    model = LlamaForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    start_s = time.perf_counter()
    quantize_loaded(model, blocks, settings)
    seconds = time.perf_counter() - start_s
    write_checkpoint(model, src, out, settings.group_size)
    return {"seconds": round(seconds, 1), "calib_tokens": sum(map(len, blocks)),
            "settings": settings.__dict__}  # fmt: skip


def quant_config_dict(group_size: int) -> dict:
    """AutoAWQ's quantization_config (AwqConfig.to_transformers_dict) for our settings."""
    return {"quant_method": "awq", "zero_point": True, "group_size": group_size, "bits": 4,
            "version": "gemm", "modules_to_not_convert": None}  # fmt: skip


def quantize_loaded(model: Any, blocks: list[list[int]], settings: AwqSettings) -> None:
    """Run AutoAWQ on a loaded transformers Llama in place: its decoder linears become
    WQLinear_GEMM modules. Progress: AutoAWQ's tqdm bar, one step per layer."""
    install_local_calib_data()
    from awq.models._config import AwqConfig
    from awq.models.llama import LlamaAWQForCausalLM
    from awq.quantize.quantizer import AwqQuantizer

    from engine.quantize.cpu_guard import cpu_safe_quantizer_cls

    wrapper = LlamaAWQForCausalLM(
        model, "llama", is_quantized=False, config=model.config,
        quant_config=AwqConfig(), processor=None,
    )  # fmt: skip
    quantizer_cls = cpu_safe_quantizer_cls() if settings.cpu_guard else AwqQuantizer
    awq_config = {"zero_point": True, "q_group_size": settings.group_size, "w_bit": 4,
                  "version": "GEMM"}  # fmt: skip
    wrapper.quantize(
        tokenizer=None,
        quant_config=awq_config,
        calib_data=blocks,
        apply_clip=settings.apply_clip,
        max_calib_samples=len(blocks),
        max_calib_seq_len=settings.calib_seq_len_tokens,
        quantizer_cls=quantizer_cls,
    )


def write_checkpoint(model: Any, src: Path, out: Path, group_size: int) -> None:
    """config.json (+ quantization_config), model.safetensors, the source's tokenizer files.
    The state dict is copied tensor by tensor (contiguous, a tied LM head dropped) rather than
    through save_pretrained, which transformers refuses for some models (GGUF-loaded ones)."""
    from safetensors.torch import save_file

    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    cfg = model.config.to_dict()
    cfg["quantization_config"] = quant_config_dict(group_size)
    cfg["architectures"] = ["LlamaForCausalLM"]
    out.mkdir(parents=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
