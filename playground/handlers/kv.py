"""KV-cache calculator: 2 x layers x kv_heads x head_dim x seq_len x batch x bytes, with model
presets, a custom model, MHA / GQA / MQA variants, GPU memory presets, and the loaded engine's
real pool. Every size is in decimal GB (1e9 bytes), as GPU datasheets count memory."""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.runner.models.presets import MODEL_PRESETS as SHAPES
from engine.telemetry.ceilings import GPUS, GPUSpec
from engine.telemetry.cost import ModelShape, kv_cache_bytes, max_concurrency
from playground.engine_info import EngineInfo, weight_format_text

GB = 1e9  # datasheets count memory in decimal gigabytes: one unit on the whole tab


def fmt_gb(num_bytes: float) -> str:
    """Decimal units, the tab's one unit system: 2147483648 -> '2.15 GB', 65536 -> '65.5 kB'."""
    for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.3g} {unit}"
    return f"{num_bytes:g} B"


@dataclass(frozen=True)
class ModelPreset:
    """A model of the calculator: a name for the form and its shape (from the one preset
    table, engine/runner/models/presets.py, or the loaded engine)."""

    name: str
    shape: ModelShape
    max_context: int | None = None  # tokens one request may hold (None: no known limit)
    num_params: int | None = None  # None: counted from the shape (a custom model gives it)
    kv_bytes: float | None = None  # None: the form's KV element; the loaded engine's own
    # None: params x the form's weight element; the loaded engine's weights as stored
    # (quantized ones with their scales and zeros, the 16-bit embedding and norms).
    weight_bytes: int | None = None
    weight_format: str | None = None  # the loaded engine's weight format, for the formula

    @property
    def params(self) -> int:
        return self.shape.num_params if self.num_params is None else self.num_params

    @property
    def attention(self) -> str:
        s = self.shape
        if s.num_kv_heads == s.num_heads:
            return "MHA"
        return "MQA" if s.num_kv_heads == 1 else "GQA"


def _preset(label: str, key: str) -> ModelPreset:
    arch = SHAPES[key]
    shape = ModelShape.from_arch(arch)
    name = f"{label} ({ModelPreset(label, shape).attention})"
    return ModelPreset(name, shape, max_context=arch.max_position_embeddings)


# The calculator's models, by their preset-table keys.
MODEL_PRESETS = {
    p.name: p
    for p in (
        _preset("Llama-2-7B", "llama-2-7b"),
        _preset("Llama-3-8B", "llama-3-8b"),
        _preset("Mistral-7B", "mistral-7b"),
        _preset("Llama-3-70B", "llama-3-70b"),
    )
}
LOADED_MODEL = "the loaded model"
CUSTOM_MODEL = "custom (enter its shape)"

# The GPUs of the one GPU table (engine/telemetry/ceilings.py), named with their memory.
GPU_CHOICES: dict[str, GPUSpec] = {
    key if key.endswith("GB") else f"{key} {gpu.memory_gb:g}GB": gpu for key, gpu in GPUS.items()
}
BYTES_PER_ELEMENT = {
    "fp32 (4 B)": 4.0,
    "bf16 / fp16 (2 B)": 2.0,
    "fp8 / int8 (1 B)": 1.0,
    "int4 (0.5 B)": 0.5,
}
VARIANTS = ("as the model", "MHA", "GQA", "MQA")
TABLE_BATCH_SIZES = (1, 8, 16, 32, 64, 128, 256)
TABLE_CONTEXT_LENS = (512, 2048, 4096, 8192, 32768, 131072)
TABLE_CORNER = "batch \\ context"  # the table's first header: rows are batches, columns contexts


def loaded_preset(info: EngineInfo) -> ModelPreset:
    """The engine's own model: its max_model_len and its real KV element size (the form's KV
    element choice does not apply: the formula must match what the engine allocated)."""
    s = info.shape
    return ModelPreset(
        f"{info.model_name} (loaded)",
        s,
        info.max_model_len,
        kv_bytes=s.kv_bytes_per_element,
        weight_bytes=info.weight_bytes,
        weight_format=weight_format_text(info.config, info.dtype),
    )


@dataclass(frozen=True)
class CustomModel:
    """The custom model's form fields: what the KV formula and the weights bar need."""

    num_layers: float | None
    num_heads: float | None  # query heads
    num_kv_heads: float | None
    head_dim: float | None
    params_billions: float | None


DEFAULT_CUSTOM = CustomModel(32, 32, 8, 128, 8.0)  # a Llama-3-8B-like shape


def custom_preset(c: CustomModel) -> ModelPreset:
    """A ModelShape from the custom fields; ValueError names the bad one."""
    whole = {}
    for name, value in (("layers", c.num_layers), ("query heads", c.num_heads),
                        ("KV heads", c.num_kv_heads), ("head_dim", c.head_dim)):  # fmt: skip
        if value is None or value != int(value) or not 1 <= value <= 100_000:
            raise ValueError(f"custom {name}: a whole number from 1 to 100,000, got {value!r}")
        whole[name] = int(value)
    if whole["KV heads"] > whole["query heads"] or whole["query heads"] % whole["KV heads"]:
        raise ValueError("custom KV heads: must divide the query heads (MHA, GQA or MQA)")
    params = c.params_billions
    if params is None or not 0 < params <= 10_000:
        raise ValueError(f"custom parameters: billions, in (0, 10000], got {params!r}")
    hidden = whole["query heads"] * whole["head_dim"]
    shape = ModelShape(whole["layers"], hidden, 4 * hidden, whole["query heads"],
                       whole["KV heads"], whole["head_dim"], 32000, False)  # fmt: skip
    return ModelPreset("custom model", shape, num_params=round(params * 1e9))


def preset_names(with_loaded: bool = True) -> list[str]:
    """The model choices; no "loaded model" without an engine (remote mode)."""
    loaded = [LOADED_MODEL] if with_loaded else []
    return [*MODEL_PRESETS, *loaded, CUSTOM_MODEL]


def remote_pool_markdown(base_url: str) -> str:
    """Remote mode: why the engine's real allocation is not beside the formula."""
    return (
        "**The loaded engine's real KV pool needs our engine.** Beside the formula, local mode "
        "shows the pool our engine allocated (`EngineStats.kv_cache_bytes`); a remote OpenAI "
        f"server (here `{base_url}`) does not report its KV pool over the API. The formula and "
        "the presets above work the same."
    )


def resolve_preset(
    name: str, info: EngineInfo | None, custom: CustomModel | None = None
) -> ModelPreset:
    if name == CUSTOM_MODEL:
        return custom_preset(custom or DEFAULT_CUSTOM)
    if name == LOADED_MODEL:
        if info is None:
            raise ValueError("model: no engine is loaded")
        return loaded_preset(info)
    if name not in MODEL_PRESETS:
        raise ValueError(f"model: unknown preset {name!r}")
    return MODEL_PRESETS[name]


def variant_kv_heads(preset: ModelPreset, variant: str) -> int:
    """KV heads under an attention variant: MHA one per query head, MQA one in all, GQA the
    model's own groups (or heads / 4 for an MHA model)."""
    s = preset.shape
    if variant == "MHA":
        return s.num_heads
    if variant == "MQA":
        return 1
    if variant == "GQA":
        if 1 < s.num_kv_heads < s.num_heads:
            return s.num_kv_heads
        return max(2, s.num_heads // 4)
    if variant == "as the model":
        return s.num_kv_heads
    raise ValueError(f"attention variant: one of {', '.join(VARIANTS)}, got {variant!r}")


@dataclass(frozen=True)
class KVInputs:
    preset: ModelPreset
    num_kv_heads: int
    seq_len: int  # tokens per request
    batch_size: int  # requests
    kv_bytes: float  # per K or V element
    weight_bytes: float  # per parameter
    gpu: str
    memory_fraction: float  # of device memory the server may use (vLLM's 0.9)

    @property
    def weights_bytes(self) -> float:
        if self.preset.weight_bytes is not None:  # the loaded engine: what it really holds
            return self.preset.weight_bytes
        return self.preset.params * self.weight_bytes

    @property
    def memory_gb(self) -> float:
        return GPU_CHOICES[self.gpu].memory_gb

    @property
    def usable_bytes(self) -> float:
        return self.memory_gb * GB * self.memory_fraction

    def kv(self, seq_len: int | None = None, batch_size: int | None = None) -> int:
        p = self.preset.shape
        return kv_cache_bytes(
            p.num_layers,
            self.num_kv_heads,
            p.head_dim,
            self.seq_len if seq_len is None else seq_len,
            self.batch_size if batch_size is None else batch_size,
            self.kv_bytes,
        )

    def max_requests(self, seq_len: int | None = None) -> int:
        """Requests of seq_len tokens whose whole KV fits beside the weights."""
        free = int(self.usable_bytes - self.weights_bytes)
        if free <= 0:
            return 0
        p = self.preset.shape
        return max_concurrency(
            free,
            p.num_layers,
            self.num_kv_heads,
            p.head_dim,
            self.seq_len if seq_len is None else seq_len,
            self.kv_bytes,
        )


def parse_inputs(
    preset_name: str,
    variant: str,
    seq_len: float | None,
    batch_size: float | None,
    kv_dtype: str,
    weight_dtype: str,
    gpu: str,
    memory_fraction: float | None,
    info: EngineInfo | None,
    custom: CustomModel | None = None,
) -> KVInputs:
    """Form values -> KVInputs; raises ValueError naming the field (never anything else)."""
    preset = resolve_preset(preset_name, info, custom)
    for name, value in (("context length", seq_len), ("batch size", batch_size)):
        if not _whole(value):
            raise ValueError(f"{name}: must be a positive whole number, got {value!r}")
    if preset.max_context is not None and seq_len > preset.max_context:
        raise ValueError(
            f"context length: {int(seq_len):,} tokens is more than {preset.name}'s maximum of "
            f"{preset.max_context:,}"
        )
    if kv_dtype not in BYTES_PER_ELEMENT or weight_dtype not in BYTES_PER_ELEMENT:
        raise ValueError("dtype: pick one of the listed element sizes")
    if gpu not in GPU_CHOICES:
        raise ValueError(f"GPU: unknown preset {gpu!r}")
    if not _number(memory_fraction) or not 0 < memory_fraction <= 1:
        raise ValueError(f"memory fraction: must be in (0, 1], got {memory_fraction!r}")
    kv_bytes = BYTES_PER_ELEMENT[kv_dtype] if preset.kv_bytes is None else preset.kv_bytes
    return KVInputs(
        preset,
        variant_kv_heads(preset, variant),
        int(seq_len),
        int(batch_size),
        kv_bytes,
        BYTES_PER_ELEMENT[weight_dtype],
        gpu,
        float(memory_fraction),
    )


def _number(value: object) -> bool:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return ok and math.isfinite(value)


def _whole(value: object) -> bool:
    return _number(value) and value == int(value) and value >= 1


def exceeds(x: KVInputs, batch_size: int, seq_len: int | None = None) -> bool:
    """Weights + KV of this batch are more than the usable memory (the bar is red)."""
    return x.kv(seq_len=seq_len, batch_size=batch_size) + x.weights_bytes > x.usable_bytes


def formula_markdown(x: KVInputs) -> str:
    p = x.preset.shape
    per_token = x.kv(seq_len=1, batch_size=1)
    total = x.kv()
    kind = "MHA" if x.num_kv_heads == p.num_heads else "MQA" if x.num_kv_heads == 1 else "GQA"
    fits = x.max_requests()
    element = (
        f" · KV element: the loaded engine's own, {x.kv_bytes:g} B"
        if x.preset.kv_bytes is not None
        else ""
    )
    if x.preset.weight_format is not None:  # the form's weight element does not apply
        element += (
            f" · weights: the loaded engine's own, {x.weights_bytes / 1e6:,.1f} MB as stored "
            f"({x.preset.weight_format})"
        )
    verdict = (
        f"**{fits}** requests of {x.seq_len:,} tokens fit in {x.gpu} "
        f"({x.memory_fraction:.0%} of {x.memory_gb:g} GB, minus "
        f"{x.weights_bytes / GB:.1f} GB of weights)"
        if fits
        else f"the weights alone ({x.weights_bytes / GB:.1f} GB) do not fit in {x.gpu}"
    )
    return (
        f"**KV bytes = 2 (K and V) x layers x kv_heads x head_dim x seq_len x batch x bytes**\n\n"
        f"= 2 x {p.num_layers} x {x.num_kv_heads} ({kind}, {p.num_heads} query heads) x "
        f"{p.head_dim} x {x.seq_len:,} x {x.batch_size} x {x.kv_bytes:g} B "
        f"= **{total:,} B** ({fmt_gb(total)})\n\n"
        f"Per token: {per_token:,} B ({fmt_gb(per_token)}) · per request of {x.seq_len:,} "
        f"tokens: {fmt_gb(x.kv(batch_size=1))}{element}\n\n"
        f"Max concurrency = floor((memory x fraction - weights) / KV per request): {verdict}."
    )


def table_rows(x: KVInputs) -> tuple[list[str], list[list[str]]]:
    """KV GB for batch sizes (rows) x context lengths (columns); '✗' where KV + weights do
    not fit the usable memory; contexts past the model's maximum in parentheses."""
    limit = x.preset.max_context

    def past(n: int) -> bool:  # a context the model cannot take: shown in parentheses
        return limit is not None and n > limit

    headers = [
        TABLE_CORNER,
        *(f"{n:,} (> model max)" if past(n) else f"{n:,}" for n in TABLE_CONTEXT_LENS),
    ]
    rows = []
    for b in TABLE_BATCH_SIZES:
        row = [str(b)]
        for n in TABLE_CONTEXT_LENS:
            kv = x.kv(seq_len=n, batch_size=b)
            mark = "" if kv + x.weights_bytes <= x.usable_bytes else " ✗"
            row.append(f"({kv / GB:.2f}){mark}" if past(n) else f"{kv / GB:.2f}{mark}")
        rows.append(row)
    return headers, rows


def kv_element_note(info: EngineInfo) -> str:
    """What one K/V element costs in the pool when it is not the model dtype's size."""
    s, kv_dtype = info.shape, info.config.kv_cache_dtype
    if kv_dtype == "int8":
        return (
            f", stored as int8: 1 B per element + a 2 B float16 scale per {s.head_dim} "
            f"elements (one per token and KV head) = {s.kv_bytes_per_element:g} B"
        )
    if kv_dtype == "fp8":
        return ", stored as fp8 (e4m3): 1 B per element"
    return ""


def engine_pool_markdown(info: EngineInfo, seq_len: int) -> str:
    """The loaded engine's real KV allocation beside the formula for the same token count."""
    s = info.shape
    block_size, kv_layout = info.config.block_size, info.config.kv_layout
    pool_tokens = info.num_kv_blocks * block_size
    formula = kv_cache_bytes(
        s.num_layers, s.num_kv_heads, s.head_dim, pool_tokens, 1, s.kv_bytes_per_element
    )
    check = "matches" if formula == info.kv_cache_bytes else "differs from"
    fixed_bytes = info.kv_cache_bytes - formula  # fp8's per-layer scales: not per token
    if info.config.kv_cache_dtype == "fp8" and 0 < fixed_bytes < 1 << 20:
        check = f"(with {fixed_bytes:,} B of per-layer fp8 scales) matches"
    if kv_layout == "contiguous":
        per_request_blocks = -(-info.max_model_len // block_size)
        fits = info.num_kv_blocks // per_request_blocks
        how = f"contiguous: each request reserves max_model_len = {info.max_model_len} tokens"
    elif seq_len > info.max_model_len:  # other presets' contexts reach here too
        fits = 0
        how = f"longer than this engine's max_model_len of {info.max_model_len:,} tokens"
    else:
        fits = pool_tokens // seq_len
        how = f"paged: floor({pool_tokens:,} tokens / {seq_len:,})"
    return (
        f"**The loaded engine ({info.model_name}, {info.dtype})** allocated "
        f"{info.num_kv_blocks:,} blocks x {block_size} tokens = {pool_tokens:,} tokens "
        f"of KV: **{info.kv_cache_bytes:,} B** ({fmt_gb(info.kv_cache_bytes)}, "
        f"EngineStats.kv_cache_bytes){kv_element_note(info)}.\n\n"
        f"The formula for {pool_tokens:,} tokens: 2 x {s.num_layers} x {s.num_kv_heads} x "
        f"{s.head_dim} x {pool_tokens:,} x 1 x {s.kv_bytes_per_element:g} B = {formula:,} B, "
        f"which {check} the allocation.\n\n"
        f"Requests of {seq_len:,} tokens that fit at once: **{fits}** ({how})."
    )
