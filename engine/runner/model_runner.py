"""ModelRunner: owns the weights and the KV tensors, turns a SchedulerOutput into tensors.

Only this module (and the model it runs) creates tensors. Per-step host work is O(batch +
new tokens + context blocks); nothing is rebuilt per layer.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.core.block_manager import cdiv
from engine.core.detokenizer import token_slice
from engine.core.scheduler import ScheduledRequest, SchedulerOutput
from engine.core.spec_decode import verify
from engine.request import Request, SamplingParams
from engine.runner.attention.base import AttentionMetadata, DecodeGroup, kv_cache_shape
from engine.runner.attention.torch_backend import gather_rows, split_by_length, store_rows
from engine.runner.cuda_graphs import CudaGraphRunner
from engine.runner.model_loader import ModelSource, iter_safetensors
from engine.runner.models.llama import LlamaForCausalLM
from engine.runner.sampler import sample

logger = logging.getLogger(__name__)

_PROFILE_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was asked for but no CUDA device is available")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16  # fast on GPUs and on CPUs with AMX/AVX512-BF16
    return _DTYPES[dtype]


@dataclass(frozen=True)
class KVCacheSpec:
    num_blocks: int
    block_size: int  # tokens per block
    bytes_per_block: int  # K and V, all layers

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource, max_model_len: int) -> None:
        self.config = config
        self.arch = source.arch
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.max_model_len = max_model_len
        self.block_size = config.block_size
        self.backend = self._resolve_backend(config.attention_backend)
        if self.device.type == "cpu":
            torch.set_num_threads(config.num_threads or os.cpu_count() or 1)
        self._generators: dict[str, torch.Generator] = {}
        self._seed_rng = random.Random(config.seed)
        self._gather_workspace: torch.Tensor | None = None
        self.graph_runner: CudaGraphRunner | None = None
        self.model = self._load_model(source)
        self.kv_spec = self._plan_kv_cache()
        arch = self.arch
        # One tensor for all layers: [layers, 2 (K, V), *per-layer layout of the backend].
        self.kv_cache = torch.zeros(
            arch.num_layers, 2, *self._layer_kv_shape(self.kv_spec.num_blocks),
            dtype=self.dtype, device=self.device,
        )  # fmt: skip
        self.kv_caches = [
            (self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(arch.num_layers)
        ]
        if self.device.type == "cuda" and self.backend == "triton" and not config.enforce_eager:
            self.graph_runner = CudaGraphRunner(
                self.model, self.kv_caches, config.max_num_seqs, max_model_len, self.block_size
            )
            self.graph_runner.capture()

    # --- set-up ---
    def _resolve_backend(self, backend: str) -> str:
        if backend == "auto":
            return "triton" if self.device.type == "cuda" else "torch"
        return backend

    def _layer_kv_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        arch = self.arch
        return kv_cache_shape(
            self.backend, num_blocks, self.block_size, arch.num_kv_heads, arch.head_dim
        )

    def _load_model(self, source: ModelSource) -> LlamaForCausalLM:
        # Built on the meta device, then materialized: no time spent on throw-away init.
        with torch.device("meta"):
            model = LlamaForCausalLM(self.arch, max_positions=self.max_model_len)
        model = model.to_empty(device=self.device).to(self.dtype)
        if source.weights_dir is None:
            _init_random_weights(model, seed=self.config.seed)
        else:
            model.load_hf_weights(iter_safetensors(source.weights_dir))
        model.init_rope()
        return model.eval().requires_grad_(False)

    def _plan_kv_cache(self) -> KVCacheSpec:
        arch = self.arch
        bytes_per_block = (
            2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * self.block_size
            * self.dtype.itemsize
        )  # fmt: skip
        if self.config.num_kv_blocks is not None:
            num_blocks = self.config.num_kv_blocks
        elif self.device.type == "cuda":
            num_blocks = self._profile_cuda_blocks(bytes_per_block)
        else:
            num_blocks = self.config.kv_cache_memory_bytes // bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"num_kv_blocks: the KV budget holds no block of {bytes_per_block} bytes; "
                "raise kv_cache_memory_bytes / gpu_memory_utilization or set num_kv_blocks"
            )
        return KVCacheSpec(num_blocks, self.block_size, bytes_per_block)

    def _profile_cuda_blocks(self, bytes_per_block: int) -> int:
        """Blocks that fit in gpu_memory_utilization x device memory after weights and a
        worst-case forward pass (max_num_batched_tokens tokens) have taken their share."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self.profile_forward(min(self.config.max_num_batched_tokens, self.max_model_len))
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        budget = int(total * self.config.gpu_memory_utilization) - peak
        return max(0, budget // bytes_per_block)

    def profile_forward(self, num_tokens: int) -> None:
        """One prefill of `num_tokens` tokens on scratch KV blocks (activation peak probe).

        Runs before the real cache exists; leaves `kv_caches` as it found them.
        """
        num_blocks = cdiv(num_tokens, self.block_size)
        dummy = ScheduledRequest(
            Request("profile", [0] * num_tokens, _PROFILE_PARAMS, arrival_time=0.0),
            num_tokens, list(range(num_blocks)),
        )  # fmt: skip
        shape = self._layer_kv_shape(num_blocks)
        saved = getattr(self, "kv_caches", None)
        self.kv_caches = [
            tuple(torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(2))
            for _ in range(self.arch.num_layers)
        ]
        try:
            self.execute(SchedulerOutput(scheduled=[dummy], num_prefill_tokens=num_tokens))
        finally:
            if saved is None:
                del self.kv_caches
            else:
                self.kv_caches = saved
            self.release("profile")

    # --- per step ---
    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        """Run one step; returns the new tokens of every request that reached its end: one,
        or with speculative drafts the accepted ones plus one (engine/core/spec_decode.py)."""
        decodes = [s for s in out.scheduled if s.num_new_tokens == 1]
        if self.backend == "torch":  # by context length, for split_by_length's groups
            decodes.sort(key=lambda s: s.request.num_computed_tokens)
        prefills = [s for s in out.scheduled if s.num_new_tokens > 1]
        ordered = decodes + prefills
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        bs = self.block_size
        for s in ordered:
            start = s.request.num_computed_tokens
            end = start + s.num_new_tokens
            input_ids.extend(token_slice(s.request, start, end))
            input_ids.extend(s.request.draft_token_ids[: s.num_draft_tokens])
            positions.extend(range(start, end))
            table = s.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        dev = self.device
        with torch.inference_mode():
            if not prefills and self.graph_runner and self.graph_runner.can_run(len(decodes)):
                hidden = self.graph_runner.run(
                    input_ids, positions, slots, [s.block_table for s in decodes],
                    [s.request.num_computed_tokens + 1 for s in decodes],
                )  # fmt: skip
            else:
                meta = self._build_metadata(decodes, prefills, torch.tensor(slots, device=dev))
                hidden = self.model(
                    torch.tensor(input_ids, device=dev),
                    torch.tensor(positions, device=dev),
                    self.kv_caches,
                    meta,
                )
            # Only the last token of each request that reached its end is turned into logits,
            # plus, for a request verifying drafts, the rows of its drafts.
            rows, samplers, verifiers = [], [], []
            offset = 0
            for s in ordered:
                offset += s.num_new_tokens
                if s.num_draft_tokens:
                    verifiers.append((s, len(rows)))
                    rows.extend(range(offset - s.num_draft_tokens - 1, offset))
                elif s.samples:
                    samplers.append((s.request, len(rows)))
                    rows.append(offset - 1)
            if not rows:
                return {}
            logits = self.model.compute_logits(hidden[torch.tensor(rows, device=dev)])
            new_tokens: dict[str, list[int]] = {}
            if samplers:
                requests = [r for r, _ in samplers]
                tokens = sample(
                    logits[torch.tensor([row for _, row in samplers], device=dev)],
                    [r.params for r in requests],
                    [self._generator(r) for r in requests],
                    [_penalty_history(r) for r in requests],
                )  # fmt: skip
                new_tokens = {r.request_id: [t] for r, t in zip(requests, tokens, strict=True)}
            for s, first in verifiers:
                r = s.request
                drafts = r.draft_token_ids[: s.num_draft_tokens]
                new_tokens[r.request_id] = verify(
                    logits[first : first + len(drafts) + 1], drafts, r.params,
                    self._generator(r), _penalty_history(r),
                )  # fmt: skip
        return new_tokens

    def _build_metadata(
        self, decodes: list[ScheduledRequest], prefills: list[ScheduledRequest], slot_mapping
    ) -> AttentionMetadata:
        dev, bs = self.device, self.block_size
        meta = AttentionMetadata(
            backend=self.backend, slot_mapping=slot_mapping, num_decode_tokens=len(decodes)
        )
        for s in prefills:
            meta.prefill_q_lens.append(s.num_new_tokens)
            meta.prefill_ctx_lens.append(s.request.num_computed_tokens + s.num_new_tokens)
        if self.backend == "torch":
            self._add_torch_indices(meta, decodes, prefills)
            return meta
        if decodes:
            seq_lens = [s.request.num_computed_tokens + 1 for s in decodes]
            meta.decode_block_tables = _pad_tables(
                [s.block_table for s in decodes], cdiv(max(seq_lens), bs), dev
            )
            meta.decode_seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
        if prefills:
            ctx_lens = meta.prefill_ctx_lens
            meta.prefill_block_tables = _pad_tables(
                [s.block_table for s in prefills], cdiv(max(ctx_lens), bs), dev
            )
            meta.prefill_seq_lens = torch.tensor(ctx_lens, dtype=torch.int32, device=dev)
            starts = [0, *itertools.accumulate(meta.prefill_q_lens)]
            meta.prefill_query_start_loc = torch.tensor(starts, dtype=torch.int32, device=dev)
        return meta

    def _add_torch_indices(
        self, meta: AttentionMetadata, decodes: list[ScheduledRequest],
        prefills: list[ScheduledRequest],
    ) -> None:  # fmt: skip
        """Cache rows for the torch backend's head-major layout (see attention_torch.py)."""
        dev, bs = self.device, self.block_size
        num_kv_heads = self.arch.num_kv_heads
        num_blocks = self.kv_caches[0][0].shape[1]  # head-major [Hkv, blocks, bs, D]
        meta.store_index = store_rows(meta.slot_mapping, num_kv_heads, num_blocks * bs)
        most_rows = 0  # the largest gather of the step sizes the workspace
        seq_lens = [s.request.num_computed_tokens + 1 for s in decodes]
        for start, end in split_by_length(seq_lens) if decodes else []:
            width = cdiv(seq_lens[end - 1], bs)  # blocks of the group's longest context
            tables = _pad_tables([s.block_table for s in decodes[start:end]], width, dev)
            pos = torch.arange(width * bs, device=dev)
            lens = torch.tensor(seq_lens[start:end], device=dev)
            group = DecodeGroup(
                start, end, gather_rows(tables.flatten().long(), num_kv_heads, num_blocks),
                pos[None, :] < lens[:, None],
            )  # fmt: skip
            meta.decode_groups.append(group)
            most_rows = max(most_rows, group.gather_index.numel())
        for s, ctx_len in zip(prefills, meta.prefill_ctx_lens, strict=True):
            rows = None
            if ctx_len > s.num_new_tokens:
                table = s.block_table[: cdiv(ctx_len, bs)]
                block_ids = torch.tensor(table, dtype=torch.long, device=dev)
                rows = gather_rows(block_ids, num_kv_heads, num_blocks)
                most_rows = max(most_rows, rows.numel())
            meta.prefill_gather_index.append(rows)
        if most_rows:
            meta.workspace = self._workspace(most_rows * bs * self.arch.head_dim)

    def _workspace(self, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Grow-only scratch for `numel` gathered K and V elements each (torch backend)."""
        if self._gather_workspace is None or self._gather_workspace.shape[1] < numel:
            self._gather_workspace = torch.empty(
                2, max(numel, 2 * getattr(self._gather_workspace, "shape", (0, 0))[1]),
                dtype=self.dtype, device=self.device,
            )  # fmt: skip
        return self._gather_workspace[0], self._gather_workspace[1]

    def _generator(self, request: Request) -> torch.Generator | None:
        if request.params.greedy:
            return None
        gen = self._generators.get(request.request_id)
        if gen is None:
            seed = request.params.seed
            if seed is None:
                seed = self._seed_rng.getrandbits(63)
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self._generators[request.request_id] = gen
        return gen

    def release(self, request_id: str) -> None:
        """Forget per-request state (its RNG) once the request has finished."""
        self._generators.pop(request_id, None)

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the allocated K and V tensors (must equal metrics.kv_cache_bytes)."""
        return self.kv_cache.numel() * self.kv_cache.element_size()

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _pad_tables(tables: list[list[int]], width: int, device: torch.device) -> torch.Tensor:
    rows = [t[:width] + [0] * (width - min(len(t), width)) for t in tables]
    return torch.tensor(rows, dtype=torch.int32, device=device)


def _init_random_weights(model: LlamaForCausalLM, seed: int) -> None:
    device = model.embed_tokens.weight.device
    # Drawn on the model's device (an 8B model on a GPU would take minutes on the CPU), in
    # row blocks so it never needs a float32 copy of itself.
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                for chunk in param.split(4096, dim=0):
                    noise = torch.randn(chunk.shape, generator=gen, device=device)
                    chunk.copy_(noise * 0.02)


def _penalty_history(request: Request) -> list[int] | tuple[()]:
    """The tokens a repetition penalty looks at; () when the request has none (no copy)."""
    return request.all_token_ids if request.params.repetition_penalty != 1.0 else ()
