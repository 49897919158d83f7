"""The draft model of speculative_method="draft": a second, cheaper model in the same process
that proposes the tokens the target then verifies in one forward (engine/core/spec_decode.py).

KV: the draft has its own per-layer K/V tensors with the same number of blocks as the target's
pool, indexed by the same block tables and slots (a token at position p sits in the same slot
in both), so one BlockManager pages, shares (prefix cache, copy-on-write) and preempts both.

Each step, before the target's forward:
1. catch-up, one forward over every scheduled request: the tokens the target computes this
   step (prompt chunks, plain decodes) plus, for a drafting request, the tokens the target
   accepted last step that the draft has no K/V for yet, then its last token, whose logits give
   draft token d_1;
2. k - 1 batched one-token forwards over the drafting requests: d_j in, d_{j+1} out.
Draft positions are the target's positions, so a rejected draft's slot is simply overwritten
later by the right token. Draft K/V only shapes the proposals: whatever it holds, the verifier
keeps the target's tokens (greedy) or distribution (sampling) exact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.core.detokenizer import token_slice
from engine.core.scheduler import ScheduledRequest
from engine.request import Request
from engine.runner.attention.base import AttentionBackend, AttentionInputs, slots_of
from engine.runner.model_build import WeightFormat, build_model, finish_weights
from engine.runner.model_loader import ModelSource, load_tokenizer, resolve_model
from engine.runner.models.layer_ops import TorchOps
from engine.runner.models.llama import LlamaForCausalLM
from engine.runner.quant import QuantSummary
from engine.runner.sampler import draw_tokens, greedy_tokens, logits_to_probs

GeneratorOf = Callable[[Request], torch.Generator | None]


@dataclass(frozen=True)
class Draft:
    """One request's proposal for this step."""

    token_ids: list[int]  # d_1 .. d_n
    # [n, V] float32: q_0 .. q_{n-1}, the distributions each d_i was drawn from (sampling
    # requests, for rejection sampling); None for greedy requests (argmax drafts).
    probs: torch.Tensor | None


@dataclass
class _Row:
    """A request in the catch-up forward: positions [start, end) of its tokens."""

    scheduled: ScheduledRequest
    start: int
    end: int


def resolve_draft_source(config: EngineConfig, target: ModelSource) -> ModelSource:
    """The draft's ModelSource, checked against the target's vocabulary and tokenizer."""
    spec = config.speculative_model or config.model
    try:
        source = resolve_model(spec)
    except ValueError as exc:
        raise ValueError(f"speculative_model: {exc}") from None
    if source.arch.vocab_size != target.arch.vocab_size:
        raise ValueError(
            f"speculative_model: {spec!r} has a vocabulary of {source.arch.vocab_size} tokens, "
            f"the target {target.name!r} {target.arch.vocab_size}; a draft must share the "
            "target's tokenizer"
        )
    if source.tokenizer_dir != target.tokenizer_dir and not _same_tokenizer(source, target):
        raise ValueError(
            f"speculative_model: {spec!r} has a different tokenizer from the target "
            f"{target.name!r}; a draft must share the target's tokenizer"
        )
    return source


def _same_tokenizer(a: ModelSource, b: ModelSource) -> bool:
    ta, tb = load_tokenizer(a), load_tokenizer(b)
    if ta is None or tb is None:
        return ta is None and tb is None  # token ids only on both sides: the vocab size
    return ta.get_vocab() == tb.get_vocab()


class DraftModel:
    def __init__(
        self,
        config: EngineConfig,
        source: ModelSource,
        max_model_len: int,
        backend: AttentionBackend,  # the target's: the draft takes its class and settings
        ops: TorchOps,  # the target's small per-layer ops (layer_ops.py): stateless, shared
    ) -> None:
        arch = source.arch
        if arch.max_position_embeddings < max_model_len:
            raise ValueError(
                f"speculative_model: context length {arch.max_position_embeddings} is below "
                f"max_model_len={max_model_len}"
            )
        self.source = source
        self.arch = arch
        self.device = backend.device
        self.block_size = backend.block_size
        self.attn_backend = type(backend)(
            arch.num_kv_heads, arch.head_dim, backend.block_size, backend.dtype,
            backend.device, backend.kv_cache_dtype,
        )  # fmt: skip
        fmt = WeightFormat(
            config.speculative_quantization, config.quantization_group_size, config.seed
        )
        self.model: LlamaForCausalLM
        self.quant_summary: QuantSummary | None
        self.model, self.quant_summary = build_model(
            source, max_model_len, self.attn_backend, backend.device, backend.dtype, fmt, ops,
            field="speculative_quantization",
        )  # fmt: skip
        self.attn_backend.host_huge_pages = backend.host_huge_pages
        # Prepacked 16-bit linears, huge pages, bound kernel calls: as the target's.
        finish_weights(self.model, config, backend.device, backend.dtype, ops.kernels)
        self.kv_caches: list = []  # allocate() fills it once the pool is sized
        # The last propose()'s forward passes, for the cost model: per pass (new tokens per
        # row, context per row after the pass, rows through the LM head).
        self.last_passes: list[tuple[list[int], list[int], int]] = []
        # Request id -> (positions whose draft K/V is valid, the request's preemption count
        # then): after a preemption the request recomputes and its old count is stale.
        self._valid: dict[str, tuple[int, int]] = {}

    # --- memory ---
    def kv_bytes_per_block(self) -> int:
        return self.attn_backend.kv_bytes_per_block(self.arch.num_layers)

    def kv_fixed_bytes(self) -> int:
        return self.attn_backend.kv_fixed_bytes(self.arch.num_layers)

    def allocate(self, num_blocks: int) -> list:
        return self.attn_backend.allocate_kv_caches(self.arch.num_layers, num_blocks)

    @property
    def kv_cache_bytes(self) -> int:
        first = self.kv_caches[0]
        tensors = [first.key] if first.key_scale is None else [first.key, first.key_scale]
        return sum(t.untyped_storage().nbytes() for t in tensors)

    # --- per step ---
    def propose(
        self, scheduled: list[ScheduledRequest], generator_of: GeneratorOf
    ) -> dict[str, Draft]:
        """Catch up on every scheduled request and draft for those with slots; returns request
        id -> Draft. Called inside inference_mode, after copy-on-write, before the target."""
        rows = [self._row(s) for s in scheduled]
        drafting = [row for row in rows if row.scheduled.num_draft_slots]
        logits = self._catch_up(rows, drafting)
        self.last_passes = [([r.end - r.start for r in rows], [r.end for r in rows], len(drafting))]
        drafts: dict[str, tuple[list[int], list[torch.Tensor]]] = {}
        active = drafting
        for step in range(max((r.scheduled.num_draft_slots for r in drafting), default=0)):
            if step:
                logits = self._decode(active, drafts, step)
            self._pick(logits, active, drafts, generator_of)
            active = [r for r in active if r.scheduled.num_draft_slots > step + 1]
        out = {}
        for rid, (tokens, probs) in drafts.items():
            out[rid] = Draft(tokens, torch.stack(probs) if probs else None)
        return out

    def accepted(self, scheduled: ScheduledRequest, num_accepted: int) -> None:
        """After verification: the draft wrote K/V for the last token and d_1 .. d_{n-1};
        those up to the last accepted draft hold the request's real tokens."""
        request = scheduled.request
        start = request.num_computed_tokens + 1  # (read before Scheduler.update)
        valid = start + min(num_accepted, scheduled.num_draft_slots - 1)
        self._valid[request.request_id] = (valid, request.metrics.num_preemptions)

    def release(self, request_id: str) -> None:
        self._valid.pop(request_id, None)

    def _row(self, s: ScheduledRequest) -> _Row:
        request = s.request
        computed = request.num_computed_tokens
        valid, preemptions = self._valid.get(request.request_id, (computed, -1))
        if preemptions != request.metrics.num_preemptions:
            # New here, or recomputing after a preemption: positions before num_computed
            # came from the prefix cache or a parent's fork, whose draft wrote them too.
            valid = computed
        start = min(valid, computed)
        end = computed + s.num_new_tokens - s.num_draft_slots
        self._valid[request.request_id] = (end, request.metrics.num_preemptions)
        return _Row(s, start, end)

    def _catch_up(self, rows: list[_Row], drafting: list[_Row]) -> torch.Tensor:
        """One forward over every row's tokens; logits of the drafting rows' last tokens."""
        decodes = [r for r in rows if r.end - r.start == 1]
        if self.attn_backend.sort_decodes_by_length:
            decodes.sort(key=lambda r: r.end)
        prefills = [r for r in rows if r.end - r.start > 1]
        ordered = decodes + prefills
        input_ids: list[int] = []
        positions: list[int] = []
        last_index: dict[int, int] = {}  # id(row) -> its last token's index in the batch
        for r in ordered:
            input_ids.extend(token_slice(r.scheduled.request, r.start, r.end))
            positions.extend(range(r.start, r.end))
            last_index[id(r)] = len(positions) - 1
        inputs = AttentionInputs(
            slot_mapping=self._slots(ordered, positions),
            decode_seq_lens=[r.end for r in decodes],
            decode_block_tables=[r.scheduled.block_table for r in decodes],
            prefill_q_lens=[r.end - r.start for r in prefills],
            prefill_ctx_lens=[r.end for r in prefills],
            prefill_block_tables=[r.scheduled.block_table for r in prefills],
        )
        hidden = self._forward(input_ids, positions, inputs)
        if not drafting:
            return hidden[:0]
        index = torch.tensor([last_index[id(r)] for r in drafting], device=self.device)
        return self.model.compute_logits(hidden[index])

    def _decode(self, active: list[_Row], drafts: dict, step: int) -> torch.Tensor:
        """d_step of each active row in at position num_computed + step: logits [B, V]."""
        input_ids = [drafts[r.scheduled.request.request_id][0][-1] for r in active]
        positions = [r.scheduled.request.num_computed_tokens + step for r in active]
        self.last_passes.append(([1] * len(active), [p + 1 for p in positions], len(active)))
        inputs = AttentionInputs(
            slot_mapping=self._slots(active, positions, one_each=True),
            decode_seq_lens=[p + 1 for p in positions],
            decode_block_tables=[r.scheduled.block_table for r in active],
            prefill_q_lens=[],
            prefill_ctx_lens=[],
            prefill_block_tables=[],
        )
        return self.model.compute_logits(self._forward(input_ids, positions, inputs))

    def _slots(self, rows: list[_Row], positions: list[int], one_each: bool = False):
        slots: list[int] = []
        i = 0
        for r in rows:
            count = 1 if one_each else r.end - r.start
            slots.extend(
                slots_of(r.scheduled.block_table, positions[i : i + count], self.block_size)
            )
            i += count
        return torch.tensor(slots, device=self.device)

    def _forward(self, input_ids: list[int], positions: list[int], inputs: AttentionInputs):
        meta = self.attn_backend.build_metadata(inputs, self.kv_caches)
        return self.model(
            torch.tensor(input_ids, device=self.device),
            torch.tensor(positions, device=self.device),
            self.kv_caches,
            meta,
        )

    @staticmethod
    def _pick(
        logits: torch.Tensor, active: list[_Row], drafts: dict, generator_of: GeneratorOf
    ) -> None:
        """Next draft token per row: the argmax for greedy requests; for sampling ones a draw
        from q (the request's temperature / top-k / top-p / min-p on the draft's logits),
        keeping q for rejection sampling."""
        sampling = [i for i, r in enumerate(active) if not r.scheduled.request.params.greedy]
        tokens = greedy_tokens(logits)
        probs = None
        if sampling:
            rows = torch.tensor(sampling, device=logits.device)
            probs = _draft_probs(logits[rows], [active[i] for i in sampling])
            generators = [generator_of(active[i].scheduled.request) for i in sampling]
            for i, token in zip(sampling, draw_tokens(probs, generators), strict=True):
                tokens[i] = token
        for i, r in enumerate(active):
            entry = drafts.setdefault(r.scheduled.request.request_id, ([], []))
            entry[0].append(tokens[i])
        for j, i in enumerate(sampling):
            drafts[active[i].scheduled.request.request_id][1].append(probs[j])


def _draft_probs(logits: torch.Tensor, rows: list[_Row]) -> torch.Tensor:
    """q for sampling rows (logits [B, V], one row each): [B, V] float32."""
    params = [r.scheduled.request.params for r in rows]
    device = logits.device
    return logits_to_probs(
        logits,
        torch.tensor([p.temperature for p in params], device=device),
        torch.tensor([p.top_k for p in params], device=device).long(),
        torch.tensor([p.top_p for p in params], device=device),
        torch.tensor([p.min_p for p in params], device=device),
    )
