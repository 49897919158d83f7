"""ModelRunner: owns the weights and the KV tensors, turns a SchedulerOutput into tensors.

Only this module (and the model it runs) creates tensors. Per-step host work is O(batch +
new tokens + context blocks); nothing is rebuilt per layer.
"""

from __future__ import annotations

import logging
import os
import random
import time
from dataclasses import dataclass, replace

import torch

from engine.config import ANY_ROWS, EngineConfig
from engine.core.block_manager import cdiv
from engine.core.detokenizer import token_slice
from engine.core.scheduler import ScheduledRequest, SchedulerOutput
from engine.core.spec_decode import verify
from engine.request import Request, SamplingParams
from engine.runner.attention import default_backend_name, get_backend
from engine.runner.attention.base import AttentionBackend, AttentionInputs, slots_of
from engine.runner.cuda_graphs import CudaGraphRunner
from engine.runner.draft_model import Draft, DraftModel, resolve_draft_source
from engine.runner.logprobs import add_logprobs, prompt_logit_rows
from engine.runner.model_build import WeightFormat, build_model, finish_weights
from engine.runner.model_loader import ModelSource
from engine.runner.models.layer_ops import make_layer_ops
from engine.runner.models.llama import LlamaForCausalLM
from engine.runner.models.prepack import PrepackedLinear
from engine.runner.onednn_cache import bound_onednn_caches
from engine.runner.quant import QuantSummary
from engine.runner.quant.linear import QuantLinear
from engine.runner.sampler import NO_HISTORY, TokenHistory, sample
from engine.runner.step_io import RunnerOutput, StepInputs, fail_request

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
        return torch.bfloat16  # GPUs; AVX-512 CPUs (the C++ kernels emulate it without AVX512-BF16)
    return _DTYPES[dtype]


@dataclass(frozen=True)
class KVCacheSpec:
    num_blocks: int
    block_size: int  # tokens per block
    bytes_per_block: int  # K and V, all layers


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource, max_model_len: int) -> None:
        # Every engine (the service's and the offline LLM's) sees ever-new matmul shapes: cap
        # oneDNN's per-shape caches before the first forward pass reads their sizes.
        bound_onednn_caches()
        self.config = config
        self.arch = source.arch
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.max_model_len = max_model_len
        self.block_size = config.block_size
        self.attn_backend = self._make_backend(config.attention_backend)
        if self.device.type == "cpu":
            torch.set_num_threads(config.num_threads or os.cpu_count() or 1)
        self._generators: dict[str, torch.Generator] = {}
        self._seed_rng = random.Random(config.seed)
        self.graph_runner: CudaGraphRunner | None = None
        self.quant_summary: QuantSummary | None = None  # set by _load_model when quantized
        # fp8 with calculate_kv_scales: True until a step has set the current pool's scales.
        self._kv_scales_pending = False
        # RMSNorm, RoPE, SiLU-and-mul: the C++ ops on CPU unless off or they cannot be built.
        self.layer_ops, self.fused_ops_fallback = make_layer_ops(
            config.fused_ops, self.device, self.arch
        )
        if self.fused_ops_fallback:
            logger.warning("fused_ops: the torch ops run instead: %s", self.fused_ops_fallback)
        self.attn_backend.host_huge_pages = config.huge_pages
        self.model = self._load_model(source)
        # Prepacked 16-bit linears (CPU), the weights in huge pages, the kernel calls bound.
        finished = finish_weights(
            self.model, config, self.device, self.dtype, self.layer_ops.kernels
        )
        self.num_prepacked_linears = finished.num_prepacked_linears  # 0: off or not possible
        self.weight_huge_page_bytes = finished.huge_page_bytes
        # speculative_method="draft": the second model, its KV counted in the pool's budget.
        self.drafter: DraftModel | None = None
        if config.speculative_method == "draft":
            draft_source = resolve_draft_source(config, source)
            self.drafter = DraftModel(
                config, draft_source, max_model_len, self.attn_backend, self.layer_ops
            )
        self._step_drafts: dict[str, Draft] = {}  # this step's draft-model proposals
        self.kv_spec = self._plan_kv_cache()
        # Per layer (K, V[, K scales, V scales]), views of one [layers, 2, ...] tensor each.
        self.kv_caches = self.attn_backend.allocate_kv_caches(
            self.arch.num_layers, self.kv_spec.num_blocks
        )
        self._kv_scales_pending = config.calculate_kv_scales  # a new pool: scales not set
        if self.drafter is not None:  # same blocks, same slots: one block manager for both
            self.drafter.kv_caches = self.drafter.allocate(self.kv_spec.num_blocks)
        # The block axis of one layer's K/V (and int8 scale) tensors: where the backend's
        # layout puts it, found as the one axis that grows with the number of blocks.
        one, two = self.attn_backend.kv_cache_shape(1), self.attn_backend.kv_cache_shape(2)
        self._block_axis = next(i for i, (a, b) in enumerate(zip(one, two, strict=True)) if a != b)
        if self._use_cuda_graphs():
            self.graph_runner = CudaGraphRunner(
                self.model, self.attn_backend, self.kv_caches, config.max_num_seqs, max_model_len
            )
            self.graph_runner.capture()

    # --- set-up ---
    def _make_backend(self, name: str) -> AttentionBackend:
        if name == "auto":
            name = default_backend_name(self.device.type)
        arch, kv_dtype = self.arch, self.config.kv_cache_dtype
        # Triton converts to/from float8e4nv in hardware only from sm_89 (Ada, Hopper).
        if kv_dtype == "fp8" and name == "triton" and not _has_fp8(self.device):
            raise ValueError(
                "kv_cache_dtype: fp8 with the Triton backend needs a GPU of compute "
                "capability >= 8.9; use int8, or attention_backend='torch'"
            )
        return get_backend(name)(
            arch.num_kv_heads, arch.head_dim, self.block_size, self.dtype, self.device, kv_dtype,
            calculate_kv_scales=self.config.calculate_kv_scales,
            kv_scale_granularity=self.config.kv_scale_granularity,
        )  # fmt: skip

    def _use_cuda_graphs(self) -> bool:
        return (
            self.device.type == "cuda"
            and self.attn_backend.supports_cuda_graphs
            and not self.config.enforce_eager
        )

    def _load_model(self, source: ModelSource) -> LlamaForCausalLM:
        c = self.config
        fmt = WeightFormat(
            c.quantization, c.quantization_group_size, c.seed, c.quantize_lm_head,
            c.int8_activations,
        )  # fmt: skip
        model, self.quant_summary = build_model(
            source, self.max_model_len, self.attn_backend, self.device, self.dtype, fmt,
            self.layer_ops,
        )  # fmt: skip
        return model

    def _plan_kv_cache(self) -> KVCacheSpec:
        # K and V of every layer in the backend's layout and the storage dtype (plus scales):
        # the same byte budget holds ~2x the blocks in int8/fp8 as in a 16-bit dtype.
        num_layers = self.arch.num_layers
        bytes_per_block = self.attn_backend.kv_bytes_per_block(num_layers)
        fixed_bytes = self.attn_backend.kv_fixed_bytes(num_layers)
        if self.drafter is not None:  # a block holds its tokens' K/V in both models
            bytes_per_block += self.drafter.kv_bytes_per_block()
            fixed_bytes += self.drafter.kv_fixed_bytes()
        if self.config.num_kv_blocks is not None:
            num_blocks = self.config.num_kv_blocks
        elif self.device.type == "cuda":
            num_blocks = self._profile_cuda_blocks(bytes_per_block, fixed_bytes)
        else:
            num_blocks = (self.config.kv_cache_memory_bytes - fixed_bytes) // bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"num_kv_blocks: the KV budget holds no block of {bytes_per_block} bytes; "
                "raise kv_cache_memory_bytes / gpu_memory_utilization or set num_kv_blocks"
            )
        return KVCacheSpec(num_blocks, self.block_size, bytes_per_block)

    def _profile_cuda_blocks(self, bytes_per_block: int, fixed_bytes: int) -> int:
        """Blocks that fit in gpu_memory_utilization x device memory after weights and a
        worst-case forward pass (max_num_batched_tokens tokens) have taken their share."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self.profile_forward(min(self.config.max_num_batched_tokens, self.max_model_len))
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        budget = int(total * self.config.gpu_memory_utilization) - peak - fixed_bytes
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
        saved, saved_pending = getattr(self, "kv_caches", None), self._kv_scales_pending
        self.kv_caches = self.attn_backend.allocate_kv_caches(self.arch.num_layers, num_blocks)
        self._kv_scales_pending = self.config.calculate_kv_scales  # the scratch pool's own
        drafter = self.drafter
        saved_draft = drafter.kv_caches if drafter is not None else []
        if drafter is not None:  # the draft runs over the same tokens first
            drafter.kv_caches = drafter.allocate(num_blocks)
        try:
            self.execute(SchedulerOutput(scheduled=[dummy], num_prefill_tokens=num_tokens))
        finally:
            self._kv_scales_pending = saved_pending
            if saved is None:
                del self.kv_caches
            else:
                self.kv_caches = saved
            if drafter is not None:
                drafter.kv_caches = saved_draft
            self.release("profile")

    # --- per step: prepare inputs -> forward -> logit rows -> sample / verify ---
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run one step; returns the new tokens of every request that reached its end: one,
        or with speculative drafts the accepted ones plus one (engine/core/spec_decode.py),
        and the requests whose sampling failed. A failure of the forward pass itself raises."""
        with torch.inference_mode():
            if out.block_copies:
                self._copy_blocks(out.block_copies)
            draft_time_s = self._run_drafter(out)
            step = self._prepare_inputs(out)
            hidden = self._forward(step)
            picks, rows = self._logit_rows(step)
            prompt_rows = prompt_logit_rows(step, rows)
            passes = self.drafter.last_passes if self.drafter is not None else []
            if not rows:
                return RunnerOutput(draft_time_s=draft_time_s, draft_passes=passes)
            logits = self.model.compute_logits(self._hidden_rows(hidden, rows))
            result = self._sample_and_verify(logits, picks)
            add_logprobs(logits, picks, prompt_rows, result)
            return replace(result, draft_time_s=draft_time_s, draft_passes=passes)

    def _hidden_rows(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """hidden[rows]: a view when the rows are consecutive (decode steps: every row), else a
        gather. Indexing with a tensor took ~50 us a step of an int4 batch-1 decode in the
        engine (10 us on its own, against 1.3 us for a slice; 2-core EPYC)."""
        first = rows[0]
        if rows == list(range(first, first + len(rows))):
            return hidden[first : first + len(rows)]
        return hidden[torch.tensor(rows, device=self.device)]

    def _run_drafter(self, out: SchedulerOutput) -> float:
        """speculative_method="draft": the draft model catches up on the step's tokens and
        proposes into the reserved slots. Returns its wall time in seconds (0 without one)."""
        self._step_drafts = {}
        if self.drafter is None:
            return 0.0
        self.drafter.last_passes = []
        start = time.perf_counter()
        self._step_drafts = self.drafter.propose(out.scheduled, self._generator)
        self.synchronize()
        return time.perf_counter() - start

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: each destination block gets the source's K and V in every layer,
        before the forward pass writes this step's tokens into the destination."""
        axis = self._block_axis
        source = torch.tensor([s for s, _ in pairs], device=self.device)
        destination = torch.tensor([d for _, d in pairs], device=self.device)
        caches = [*self.kv_caches, *(self.drafter.kv_caches if self.drafter else [])]
        for layer in caches:
            tensors = [layer.key, layer.value]
            if self.attn_backend.kv_cache_dtype == "int8":  # per-token scales live in blocks
                tensors += [layer.key_scale, layer.value_scale]  # (fp8's are per head: shared)
            for t in tensors:
                t.index_copy_(axis, destination, t.index_select(axis, source))

    def _prepare_inputs(self, out: SchedulerOutput) -> StepInputs:
        decodes = [s for s in out.scheduled if s.num_new_tokens == 1]
        if self.attn_backend.sort_decodes_by_length:
            decodes.sort(key=lambda s: s.request.num_computed_tokens)
        ordered = decodes + [s for s in out.scheduled if s.num_new_tokens > 1]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for s in ordered:
            start = s.request.num_computed_tokens
            end = start + s.num_new_tokens
            input_ids.extend(token_slice(s.request, start, end))
            input_ids.extend(self._draft_ids(s))  # drafts sit past the known tokens
            positions.extend(range(start, end))
            slots.extend(slots_of(s.block_table, range(start, end), self.block_size))
        return StepInputs(ordered, len(decodes), input_ids, positions, slots)

    def _forward(self, step: StepInputs) -> torch.Tensor:
        """The model over the step's tokens: hidden states [T, hidden]."""
        decodes = step.decodes
        graphs = self.graph_runner
        # The scale-setting step runs eagerly: captured graphs skip that work (base.py).
        eager_only = self._kv_scales_pending
        if not step.prefills and graphs and graphs.can_run(len(decodes)) and not eager_only:
            return graphs.run(
                step.input_ids, step.positions, step.slots, [s.block_table for s in decodes],
                [s.request.num_computed_tokens + 1 for s in decodes],
            )  # fmt: skip
        dev = self.device
        meta = self.attn_backend.build_metadata(self._attention_inputs(step), self.kv_caches)
        hidden = self.model(
            torch.tensor(step.input_ids, device=dev),
            torch.tensor(step.positions, device=dev),
            self.kv_caches,
            meta,
        )
        # Every layer has stored real tokens (eager steps have no padding): scales are set.
        self._kv_scales_pending = False
        return hidden

    def _attention_inputs(self, step: StepInputs) -> AttentionInputs:
        decodes, prefills = step.decodes, step.prefills
        return AttentionInputs(
            slot_mapping=torch.tensor(step.slots, device=self.device),
            decode_seq_lens=[s.request.num_computed_tokens + 1 for s in decodes],
            decode_block_tables=[s.block_table for s in decodes],
            prefill_q_lens=[s.num_new_tokens for s in prefills],
            prefill_ctx_lens=[s.request.num_computed_tokens + s.num_new_tokens for s in prefills],
            prefill_block_tables=[s.block_table for s in prefills],
            calculate_kv_scales=self._kv_scales_pending,
        )

    @staticmethod
    def _logit_rows(step: StepInputs) -> tuple[list[tuple[ScheduledRequest, int]], list[int]]:
        """Which hidden rows become logits: the last token of each request that reached its
        end, plus, for a request verifying drafts, the rows of its drafts. Returns each such
        request with its first row in the logits, and the hidden rows."""
        picks: list[tuple[ScheduledRequest, int]] = []
        rows: list[int] = []
        end = 0  # one past the request's last token in the packed batch
        for s in step.requests:
            end += s.num_new_tokens
            if s.num_draft_tokens or s.samples:
                picks.append((s, len(rows)))
                rows.extend(range(end - s.num_draft_tokens - 1, end))
        return picks, rows

    def _sample_and_verify(
        self, logits: torch.Tensor, picks: list[tuple[ScheduledRequest, int]]
    ) -> RunnerOutput:
        """One sampled token per request without drafts; verified drafts (+1) for the rest.
        A request whose sampling raises fails alone (RunnerOutput.failed)."""
        result = RunnerOutput()
        samplers = [(s.request, row) for s, row in picks if not s.num_draft_tokens]
        if samplers:
            self._sample_batch(logits, samplers, result)
        for s, first in picks:
            if s.num_draft_tokens:
                r, drafts = s.request, self._draft_ids(s)
                proposal = self._step_drafts.get(r.request_id)
                try:
                    tokens = verify(
                        logits[first : first + len(drafts) + 1], drafts, r.params,
                        self._generator(r), _penalty_history(r),
                        proposal.probs if proposal is not None else None,
                        [r.masked_stop_token_ids(i) for i in range(len(drafts) + 1)],
                    )  # fmt: skip
                except Exception as exc:  # verification is per request already
                    fail_request(r, "draft verification", exc, result)
                    continue
                result.sampled[r.request_id] = tokens
                if self.drafter is not None and s.num_draft_slots:
                    self.drafter.accepted(s, len(tokens) - 1)
        return result

    def _sample_batch(
        self, logits: torch.Tensor, samplers: list[tuple[Request, int]], result: RunnerOutput
    ) -> None:
        """All requests without drafts in one batched draw. If that raises, nobody can tell
        which request caused it, so each is sampled again alone from its generator's state
        before the batch: the others get exactly the tokens the batch would have given them
        (the sampler is batch-independent per row), and the culprit fails alone."""
        requests = [r for r, _ in samplers]
        try:
            generators = [self._generator(r) for r in requests]
        except Exception:  # e.g. a seed torch refuses: find whose, one at a time
            self._sample_each(logits, samplers, result)
            return
        # Draws consume generator state row by row; a raise at row i has already advanced
        # rows < i, so keep the states to replay them (a few bytes per random request).
        states = [g.get_state() if g is not None else None for g in generators]
        rows = [row for _, row in samplers]
        batch_logits = logits  # every row in order, the usual case: no copy (64 x 49152 logits
        if rows != list(range(logits.shape[0])):  # rows took 0.8-2.8 ms to index on CPU)
            batch_logits = logits[torch.tensor(rows, device=self.device)]
        try:
            tokens = sample(
                batch_logits,
                [r.params for r in requests],
                generators,
                [_penalty_history(r) for r in requests],
                self.layer_ops.argmax_rows,
                self.layer_ops.sample_rows,
                [r.masked_stop_token_ids() for r in requests],
            )
        except Exception:
            for gen, state in zip(generators, states, strict=True):
                if gen is not None and state is not None:
                    gen.set_state(state)
            self._sample_each(logits, samplers, result)
            return
        for r, t in zip(requests, tokens, strict=True):
            result.sampled[r.request_id] = [t]

    def _sample_each(
        self, logits: torch.Tensor, samplers: list[tuple[Request, int]], result: RunnerOutput
    ) -> None:
        """The fallback after a failed batched draw: one request at a time."""
        for r, row in samplers:
            try:
                token = sample(
                    logits[row : row + 1], [r.params], [self._generator(r)],
                    [_penalty_history(r)], self.layer_ops.argmax_rows,
                    self.layer_ops.sample_rows, [r.masked_stop_token_ids()],
                )[0]  # fmt: skip
            except Exception as exc:
                fail_request(r, "sampling", exc, result)
                continue
            result.sampled[r.request_id] = [token]

    def _generator(self, request: Request) -> torch.Generator | None:
        if request.params.greedy:
            return None
        gen = self._generators.get(request.request_id)
        if gen is None:
            seed = request.seed  # params.seed + the sequence's index among n
            if seed is None:
                seed = self._seed_rng.getrandbits(63)
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self._generators[request.request_id] = gen
        return gen

    def release(self, request_id: str) -> None:
        """Forget per-request state (its RNG, its draft's progress) once it has finished."""
        self._generators.pop(request_id, None)
        if self.drafter is not None:
            self.drafter.release(request_id)

    def _draft_ids(self, scheduled: ScheduledRequest) -> list[int]:
        """The speculative tokens this step verifies for the request (the one place they are
        read): the n-gram proposer's, carried by the scheduler, or the draft model's."""
        if scheduled.num_draft_slots:
            return self._step_drafts[scheduled.request.request_id].token_ids
        return scheduled.draft_token_ids

    @property
    def weight_bytes(self) -> int:
        """Bytes the weights take as stored (quantized values, scales and zeros included; with
        prepacking, the packed weights and a tied LM head's packed copy)."""
        if self.quant_summary is not None:
            return self.quant_summary.total_bytes
        tensors = [*self.model.parameters()]
        tensors += [m.packed_weight for m in self.model.modules() if isinstance(m, PrepackedLinear)]
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def linear_bytes_per_param(self) -> float | None:
        """Stored bytes per weight of the matmul layers (decoder linears + LM head, what the
        cost model reads per step); None when they are not quantized."""
        summary = self.quant_summary
        if summary is None:
            return None
        if isinstance(self.model.lm_head, QuantLinear):
            return summary.linear_bytes_per_param
        # A 16-bit LM head (--no-quantize-lm-head); every step reads it all the same. (Its
        # shape, not its weight: a prepacked head has no plain weight to read.)
        head_params = self.arch.vocab_size * self.arch.hidden_size
        head_bytes = head_params * self.dtype.itemsize
        return (summary.linear_bytes + head_bytes) / (summary.linear_params + head_params)

    @property
    def matmul_dtype(self) -> str:
        """What the linear layers' many-row products multiply: "int8" with int8 activations in
        effect (EngineConfig.int8_activations on a CPU that runs them), else the model dtype."""
        summary = self.quant_summary
        if summary is not None and summary.int8_activations_min_rows > 0:
            return "int8"
        return str(self.dtype).removeprefix("torch.")

    @property
    def layer_ops_description(self) -> str:
        if self.fused_ops_fallback:
            return f"torch (fused ops unavailable: {self.fused_ops_fallback})"
        step = self.model.decode_step  # built only with the C++ ops (models/decode_step.py)
        if step is not None:
            if step.max_rows == ANY_ROWS:  # every product takes any rows (int8 activations)
                return "cpu (fused C++ ops; every step in one C++ call)"
            return f"cpu (fused C++ ops; steps of <= {step.max_rows} tokens in one C++ call)"
        labels = {"cpu": "cpu (fused C++ ops)", "triton": "triton (fused Triton ops)"}
        return labels.get(self.layer_ops.name, "torch")

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the allocated K and V tensors and their scales (every layer's caches are
        views of one data and one scale tensor; must equal metrics.kv_cache_bytes)."""
        first = self.kv_caches[0]
        tensors = [first.key] if first.key_scale is None else [first.key, first.key_scale]
        return sum(t.untyped_storage().nbytes() for t in tensors)

    @property
    def draft_kv_cache_bytes(self) -> int:
        """Bytes of the draft model's K/V tensors (0 without a draft model)."""
        return self.drafter.kv_cache_bytes if self.drafter is not None else 0

    @property
    def kv_cache_dtype_name(self) -> str:
        """The K/V element type in the pool: "bfloat16", "int8", "float8_e4m3fn", ..."""
        return str(self.attn_backend.kv_storage_dtype).removeprefix("torch.")

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _has_fp8(device: torch.device) -> bool:
    """Whether Triton can convert float8e4nv on `device` (the CPU interpreter can load it)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def _penalty_history(request: Request) -> TokenHistory:
    """The tokens its penalties look at (prompt, then output); none when the request has no
    penalty (all_token_ids copies them)."""
    if not request.params.changes_logits:
        return NO_HISTORY
    return TokenHistory(request.all_token_ids, request.num_prompt_tokens)
