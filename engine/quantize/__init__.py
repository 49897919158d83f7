"""Producing quantized checkpoints offline (AutoAWQ), as opposed to engine/runner/quant, which
loads and runs them. CLI: `python -m engine.quantize --method awq --group-size 64 --out DIR`.

embedded_awq_dir(group_size) is the cached AWQ checkpoint of the embedded model, produced on
first use (quantization="awq" with model="smollm2-135m"), like the converted model is cached.
"""

from __future__ import annotations

import fcntl
import shutil
import sys
import tempfile
from pathlib import Path

from engine.tokenizer import EMBEDDED_MODEL, cache_dir


def embedded_awq_name(group_size: int) -> str:
    return f"{EMBEDDED_MODEL}-awq-g{group_size}"


def embedded_awq_dir(group_size: int) -> Path:
    """The embedded model's AWQ checkpoint at this group size, produced once (minutes on a
    CPU, with progress on stderr) and published by an atomic rename; a file lock makes a second
    process wait for the first instead of quantizing twice."""
    target = cache_dir() / "models" / embedded_awq_name(group_size)
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "model.safetensors").is_file():  # another process finished meanwhile
            return target
        produce_embedded_awq(target, group_size)
    return target


def produce_embedded_awq(target: Path, group_size: int) -> dict:
    """Quantize the converted embedded model into `target` (via a temp folder + rename)."""
    from engine.quantize.awq_produce import AwqSettings, quantize_awq
    from engine.runner.model_loader import resolve_model

    src = resolve_model(EMBEDDED_MODEL).weights_dir
    assert src is not None  # the embedded model always has a converted folder
    print(
        f"AWQ: no checkpoint of {EMBEDDED_MODEL} at group size {group_size} yet; calibrating "
        f"with autoawq on local text (once; measured 3-33 minutes on 2 CPU cores) into {target}",
        file=sys.stderr,
        flush=True,
    )
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        report = quantize_awq(src, tmp / "out", AwqSettings(group_size=group_size))
        (tmp / "out").rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"AWQ: done in {report['seconds']} s: {target}", file=sys.stderr, flush=True)
    return report


__all__ = ["embedded_awq_dir", "embedded_awq_name", "produce_embedded_awq"]
