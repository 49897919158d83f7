"""JIT builds of the C++ CPU kernels (torch.utils.cpp_extension), cached per machine.

Each extension is compiled once (`-O3 -march=native -fopenmp`) and cached beside the converted
model: TORCH_EXTENSIONS_DIR if set, else $PLAYGROUND_CACHE_DIR (or
~/.cache/inference-playground)/torch_extensions. The build name hashes the sources, the flags,
torch's version and this CPU's model and flags, so a cache shared between machines never loads
a build made for another CPU's instruction set.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import torch

CFLAGS = ["-O3", "-march=native", "-fopenmp"]

log = logging.getLogger(__name__)


class CpuKernelUnavailable(RuntimeError):
    """The extension cannot be built here (no C++ compiler, or the build failed)."""


def extensions_dir() -> Path:
    if env := os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(env)
    root = os.environ.get("PLAYGROUND_CACHE_DIR") or Path.home() / ".cache" / "inference-playground"
    return Path(root) / "torch_extensions"


def _cpu_signature() -> str:
    """This CPU's model name and flags (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in lines if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


HEADERS_DIR = Path(__file__).parent  # the kernels' headers (cpu_simd.h & co.) live beside them


def build_name(prefix: str, sources: Sequence[Path], extra_cflags: Sequence[str] = ()) -> str:
    headers = sorted(HEADERS_DIR.glob("*.h"))  # any header a source includes changes the build
    texts = [s.read_text() for s in (*sources, *headers)]
    parts = [*texts, " ".join([*CFLAGS, *extra_cflags]), torch.__version__]
    parts.append(_cpu_signature())
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]
    return f"{prefix}_{digest}"


def _ensure_ninja_on_path() -> None:
    """torch's JIT builds with ninja. The `ninja` wheel (a project dependency) installs its
    script beside this interpreter, which is not on PATH when the venv is not activated."""
    if shutil.which("ninja"):
        return
    scripts = str(Path(sys.executable).parent)
    os.environ["PATH"] = f"{scripts}{os.pathsep}{os.environ.get('PATH', '')}"


def unavailable_reason(load: Callable[[], ModuleType]) -> str | None:
    """None when `load()` gives the extension; else why it cannot (for a log line or the UI)."""
    try:
        load()
    except CpuKernelUnavailable as exc:
        return str(exc)
    return None


def build_extension(
    prefix: str, sources: Sequence[Path], extra_cflags: Sequence[str] = ()
) -> ModuleType:
    """Build (or load from the cache) the extension made of `sources`. Raises
    CpuKernelUnavailable naming the reason when it cannot be built. Callers cache the result.
    `extra_cflags` follow CFLAGS (tests build variants, e.g. without an instruction set)."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise CpuKernelUnavailable(
            f"no C++ compiler ({compiler!r} not on PATH): install g++ (`make setup` does, as root)"
        )
    _ensure_ninja_on_path()
    from torch.utils import cpp_extension

    build_dir = extensions_dir() / build_name(prefix, sources, extra_cflags)
    build_dir.mkdir(parents=True, exist_ok=True)
    if not (build_dir / f"{build_dir.name}.so").exists():  # say why start-up pauses, once
        log.info("compiling %s for this CPU (~30 s, once; cached in %s)", prefix, build_dir)
    try:
        return cpp_extension.load(
            name=build_dir.name, sources=[str(s) for s in sources],
            extra_cflags=[*CFLAGS, *extra_cflags],
            extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False,
        )  # fmt: skip
    except (RuntimeError, OSError, ImportError) as exc:
        names = ", ".join(s.name for s in sources)
        raise CpuKernelUnavailable(f"building {names} failed: {exc}") from exc
