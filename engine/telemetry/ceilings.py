"""Device ceilings for the roofline: peak FLOP/s per dtype and memory bandwidth.

Measured once per device (a big copy and a big matmul, a few seconds) and cached in-process and
on disk, or taken from datasheet PRESETS. The roofline says what a step could attain at its
arithmetic intensity I (FLOP/byte): min(peak, I x bandwidth); the ridge point peak / bandwidth
is where a step turns from memory-bound to compute-bound.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

# "int8": int8 x int8 -> int32 products (torch._int_mm), the roof of EngineConfig.int8_activations
# (its ops counted as FLOPs: 2 per multiply-add, as for the float types).
DTYPES = ("float32", "bfloat16", "float16", "int8")
CACHE_FILE_NAME = "device_ceilings.json"
# What a cached roof means: bump when measure_ceilings changes what it measures, so a roof
# cached by an older version is measured again instead of shown (2: int8 peaks; 3: a CPU's
# bfloat16 roof is at least its float32 one).
MEASUREMENT_VERSION = 3
# The CPU features that decide which kernels (torch's and ours) can run, hence the roofs: cloud
# guests of different generations often share one model name ("Intel(R) Xeon(R) Processor").
CPU_FEATURE_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


@dataclass(frozen=True)
class DeviceCeilings:
    name: str  # device name, e.g. "NVIDIA H200" or "AMD EPYC 7B13 (2 threads)"
    peak_flops_per_s: dict[str, float]  # dtype name ("float32", "bfloat16", ...) -> FLOP/s
    bandwidth_bytes_per_s: float  # device-memory bytes per second (read + write)
    measured: bool  # True = measured here, False = datasheet
    source: str  # how the numbers were obtained

    def peak(self, dtype: object) -> float:
        key = dtype_name(dtype)
        if key not in self.peak_flops_per_s:
            known = ", ".join(sorted(self.peak_flops_per_s))
            raise KeyError(f"{self.name}: no peak FLOP/s for {key} (known: {known})")
        return self.peak_flops_per_s[key]

    def ridge_point(self, dtype: object) -> float:
        """Arithmetic intensity (FLOP/byte) where the bandwidth roof meets the compute roof."""
        return self.peak(dtype) / self.bandwidth_bytes_per_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DeviceCeilings:
        return cls(
            name=str(d["name"]),
            peak_flops_per_s={str(k): float(v) for k, v in d["peak_flops_per_s"].items()},
            bandwidth_bytes_per_s=float(d["bandwidth_bytes_per_s"]),
            measured=bool(d["measured"]),
            source=str(d["source"]),
        )


def dtype_name(dtype: object) -> str:
    """ "bfloat16" from "bfloat16" or torch.bfloat16 (without importing torch)."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class GPUSpec:
    """One GPU's datasheet numbers: its roofline ceilings and, for the KV calculator, its
    memory. Dense (no sparsity) tensor-core bf16/fp16 and non-tensor-core fp32 peaks."""

    name: str  # as NVIDIA spells it
    memory_gb: float  # device memory in decimal GB (1e9 bytes), as datasheets count
    bf16_flops_per_s: float  # bf16 and fp16
    fp32_flops_per_s: float
    bandwidth_bytes_per_s: float
    note: str  # memory type, rounding

    def ceilings(self) -> DeviceCeilings:
        return DeviceCeilings(
            name=self.name,
            peak_flops_per_s={
                "float32": self.fp32_flops_per_s,
                "bfloat16": self.bf16_flops_per_s,
                "float16": self.bf16_flops_per_s,
            },
            bandwidth_bytes_per_s=self.bandwidth_bytes_per_s,
            measured=False,
            source=f"datasheet, dense (no sparsity); {self.note}",
        )


# The one GPU table: the roofline's presets and the KV calculator's devices.
GPUS: dict[str, GPUSpec] = {
    # HBM2e is 2.039e12 B/s; rounded to 2.0e12 so the ridge is the classic teaching value
    # 312 TFLOPS / 2 TB/s = 156 FLOP/byte (153 with the exact bandwidth).
    "A100 80GB": GPUSpec("NVIDIA A100 80GB", 80, 312e12, 19.5e12, 2.0e12, "bandwidth rounded"),
    "H100 SXM": GPUSpec("NVIDIA H100 SXM", 80, 989e12, 67e12, 3.35e12, "HBM3"),
    "H200": GPUSpec("NVIDIA H200", 141, 989e12, 67e12, 4.8e12, "HBM3e"),
    "L4": GPUSpec("NVIDIA L4", 24, 121e12, 30.3e12, 300e9, "GDDR6"),
    # 165.2 TFLOPS is bf16/fp16 with fp32 accumulate (330 with fp16 accumulate).
    "RTX 4090": GPUSpec("NVIDIA GeForce RTX 4090", 24, 165.2e12, 82.6e12, 1.008e12, "GDDR6X"),
}
PRESETS: dict[str, DeviceCeilings] = {key: gpu.ceilings() for key, gpu in GPUS.items()}


# --------------------------------------------------------------------------------------------
# Roofline
# --------------------------------------------------------------------------------------------


def roofline(
    ceilings: DeviceCeilings, dtype: object, intensity: float | Sequence[float]
) -> float | list[float]:
    """Attainable FLOP/s at arithmetic intensity I (FLOP/byte): min(peak, I x bandwidth).
    A sequence of intensities gives a list."""
    peak = ceilings.peak(dtype)
    bw = ceilings.bandwidth_bytes_per_s
    if isinstance(intensity, int | float):
        return min(peak, intensity * bw)
    return [min(peak, i * bw) for i in intensity]


def roof_fraction(
    ceilings: DeviceCeilings, dtype: object, flops: float, bytes_moved: float, duration_s: float
) -> float:
    """Achieved FLOP/s over what the roofline allows at this step's intensity (0..1, or above 1
    when the FLOP/byte estimate or the ceilings are off). 0 for an empty step."""
    if flops <= 0 or bytes_moved <= 0 or duration_s <= 0:
        return 0.0
    attainable = roofline(ceilings, dtype, flops / bytes_moved)
    return (flops / duration_s) / attainable


def roofline_bound_s(
    ceilings: DeviceCeilings, dtype: object, steps: Iterable[tuple[float, float]]
) -> float:
    """The least time `steps` ((flops, bytes_moved) each, from StepStats) could take on this
    device: each step at its own roof (its FLOPs at peak or its bytes at bandwidth, whichever
    takes longer), summed, since the steps run one after another."""
    peak, bandwidth = ceilings.peak(dtype), ceilings.bandwidth_bytes_per_s
    return sum(max(flops / peak, bytes_moved / bandwidth) for flops, bytes_moved in steps)


def roofline_curve(
    ceilings: DeviceCeilings,
    dtype: object,
    intensity_min: float = 0.1,
    intensity_max: float = 1e4,
    num_points: int = 200,
) -> tuple[list[float], list[float]]:
    """Log-spaced intensities and their attainable FLOP/s, for plotting; the ridge point is
    inserted when in range so the kink is drawn sharp."""
    if not 0 < intensity_min < intensity_max:
        raise ValueError("need 0 < intensity_min < intensity_max")
    if num_points < 2:
        raise ValueError("num_points: need at least 2")
    lo, hi = math.log10(intensity_min), math.log10(intensity_max)
    xs = [10 ** (lo + (hi - lo) * k / (num_points - 1)) for k in range(num_points)]
    ridge = ceilings.ridge_point(dtype)
    if intensity_min < ridge < intensity_max:
        xs = sorted({*xs, ridge})
    ys = roofline(ceilings, dtype, xs)
    assert isinstance(ys, list)
    return xs, ys


# --------------------------------------------------------------------------------------------
# Measurement
# --------------------------------------------------------------------------------------------


def device_name(device: str = "cpu") -> str:
    """A cache key naming the hardware: the CPU model plus torch's thread count, or the GPU."""
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    model = "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model} ({torch.get_num_threads()} threads)"


def cpu_features() -> list[str]:
    """Which of CPU_FEATURE_FLAGS /proc/cpuinfo lists ([] where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return [flag for flag in CPU_FEATURE_FLAGS if flag in have]
    except OSError:
        pass
    return []


def cache_key(device: str = "cpu") -> str:
    """The disk cache's key for this device's roof: its name, and what else decides what the
    roof measures (the CPU's features, torch's version, the measurement's version), so a roof
    is never taken from another kind of machine or an older way of measuring."""
    import torch

    features = "" if device.startswith("cuda") else f"; {' '.join(cpu_features()) or 'no flags'}"
    version = torch.__version__.split("+")[0]
    return f"{device_name(device)}{features}; torch {version}; v{MEASUREMENT_VERSION}"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def _best_time_s(fn, device: str, repeats: int, iters: int = 1) -> float:
    """Best wall time of `iters` calls of fn over `repeats` tries (after one warm-up)."""
    fn()
    _sync(device)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        _sync(device)
        best = min(best, (time.perf_counter() - t0) / iters)
    return best


def measure_bandwidth(device: str = "cpu", num_bytes: int | None = None, repeats: int = 5) -> float:
    """Bytes/s of a large tensor copy, counting the bytes read plus the bytes written."""
    import torch

    cuda = device.startswith("cuda")
    num_bytes = num_bytes or ((1 << 30) if cuda else (256 << 20))
    src = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    best = _best_time_s(lambda: dst.copy_(src), device, repeats, iters=10 if cuda else 1)
    return 2 * src.numel() * src.element_size() / best


def measure_matmul_flops(device: str, dtype: str, time_budget_s: float = 0.4) -> float:
    """FLOP/s of a square matmul (2 n^3 FLOP). On CPU n grows from 256 (to 2048 at most) until
    one matmul takes ~20 ms, so slow dtypes (fp16 on many CPUs) still finish quickly; best of
    the repeats that fit in time_budget_s."""
    import torch

    torch_dtype = getattr(torch, dtype)
    cuda = device.startswith("cuda")
    n, max_n = (8192, 8192) if cuda else (256, 2048)

    def operands(n: int):
        if torch_dtype == torch.int8:  # small integers: int8 x int8 products sum in int32
            return tuple(
                torch.randint(-127, 128, (n, n), dtype=torch.int8, device=device) for _ in "ab"
            )
        return tuple(torch.randn(n, n, device=device).to(torch_dtype) for _ in "ab")

    mm = torch._int_mm if torch_dtype == torch.int8 else torch.matmul
    while True:
        a, b = operands(n)
        t = _best_time_s(lambda a=a, b=b: mm(a, b), device, repeats=1, iters=10 if cuda else 1)
        if t >= 0.02 or n >= max_n:
            break
        n *= 2
    repeats = max(1, min(20, int(time_budget_s / max(t, 1e-6))))
    t = min(t, _best_time_s(lambda: mm(a, b), device, repeats, iters=10 if cuda else 1))
    return 2.0 * n**3 / t


def measure_ceilings(device: str = "cpu", dtypes: Sequence[str] = DTYPES) -> DeviceCeilings:
    """Measure bandwidth and per-dtype matmul FLOP/s on `device` (a few seconds on CPU)."""
    t0 = time.perf_counter()
    bandwidth = measure_bandwidth(device)
    peaks = {}
    for d in map(dtype_name, dtypes):
        try:
            peaks[d] = measure_matmul_flops(device, d)
        except (RuntimeError, NotImplementedError):
            if d != "int8":  # torch._int_mm is missing on some builds and devices: no int8 roof
                raise
    if not device.startswith("cuda") and "float32" in peaks and "bfloat16" in peaks:
        # A bfloat16 product never needs to run slower than float32's: both factors widen
        # exactly (a shift), and the C++ kernels do just that on CPUs without AVX512-BF16,
        # where torch's bfloat16 matmul is oneDNN's emulation (55 GFLOP/s against ~300 for
        # float32 on a 2-core cloud Xeon, 2026-12-07; the engine's steps then ran above that
        # "roof"). The roof is what the hardware allows, so bfloat16 gets at least float32's.
        peaks["bfloat16"] = max(peaks["bfloat16"], peaks["float32"])
    return DeviceCeilings(
        name=device_name(device),
        peak_flops_per_s=peaks,
        bandwidth_bytes_per_s=bandwidth,
        measured=True,
        source=(
            f"measured on {device} {datetime.now(UTC):%Y-%m-%d %H:%M} UTC: tensor copy (read + "
            f"write) and square matmuls, best of repeats, {time.perf_counter() - t0:.1f} s"
        ),
    )


def best_of_runs(runs: Sequence[DeviceCeilings], measured_at: str) -> DeviceCeilings:
    """Each ceiling's best over the runs (anything else on the machine only lowers one), with
    the date and the spread ((best - worst) / best) written into its source."""
    keys = {k for r in runs for k in r.peak_flops_per_s}
    peaks = {k: max(r.peak_flops_per_s.get(k, 0.0) for r in runs) for k in sorted(keys)}
    bandwidth = max(r.bandwidth_bytes_per_s for r in runs)

    def spread(values: list[float]) -> str:
        return f"±{(max(values) - min(values)) / max(values):.0%}" if max(values) > 0 else "n/a"

    # The bf16 peak's spread where every run has one (a float32-only roof has none).
    bf16 = [r.peak_flops_per_s.get("bfloat16", 0.0) for r in runs]
    bf16_spread = f", bf16 peak {spread(bf16)}" if all(bf16) else ""
    source = (
        f"measured {measured_at}, best of {len(runs)} runs (spread: bandwidth "
        f"{spread([r.bandwidth_bytes_per_s for r in runs])}{bf16_spread}); {runs[-1].source}"
    )
    return replace(runs[-1], peak_flops_per_s=peaks, bandwidth_bytes_per_s=bandwidth, source=source)


# --------------------------------------------------------------------------------------------
# Cache (in-process and on disk)
# --------------------------------------------------------------------------------------------

_memory_cache: dict[str, DeviceCeilings] = {}
_cache_lock = threading.Lock()


def cache_dir() -> Path:
    env = os.environ.get("PLAYGROUND_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "inference-playground"


def _load_disk_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _save_to_disk(key: str, ceilings: DeviceCeilings) -> None:
    path = cache_dir() / CACHE_FILE_NAME
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _load_disk_cache(path)
        data[key] = ceilings.to_dict()
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old or the new file
    except OSError:
        pass  # a read-only home must not stop the engine; we just measure again next time


def get_ceilings(device: str = "cpu", refresh: bool = False) -> DeviceCeilings:
    """Ceilings of `device`, measured at most once per cache_key: from this process's cache,
    else the JSON cache file, else measured now (and saved). refresh=True measures again."""
    key = cache_key(device)
    with _cache_lock:
        if not refresh:
            if key in _memory_cache:
                return _memory_cache[key]
            entry = _load_disk_cache(cache_dir() / CACHE_FILE_NAME).get(key)
            if entry is not None:
                try:
                    _memory_cache[key] = DeviceCeilings.from_dict(entry)
                    return _memory_cache[key]
                except (KeyError, TypeError, ValueError, AttributeError):
                    pass  # a stale or hand-edited entry: measure again
        ceilings = measure_ceilings(device)
        _memory_cache[key] = ceilings
        _save_to_disk(key, ceilings)
        return ceilings


def remember_ceilings(ceilings: DeviceCeilings, device: str = "cpu") -> None:
    """Make `ceilings` the cached roof of `device` (in-process and on disk): for a caller that
    measured itself and decided this one should replace the cached one."""
    key = cache_key(device)
    with _cache_lock:
        _memory_cache[key] = ceilings
        _save_to_disk(key, ceilings)


def clear_memory_cache() -> None:
    """Forget in-process measurements (tests; the disk cache stays)."""
    with _cache_lock:
        _memory_cache.clear()
