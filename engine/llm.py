"""LLM: offline batch generation in the caller's thread (tests, benchmarks, scripts)."""

from __future__ import annotations

from collections.abc import Sequence

from engine.config import EngineConfig
from engine.core.block_manager import BlockSnapshot
from engine.core.engine import LLMEngine, Prompt
from engine.request import RequestOutput, SamplingParams
from engine.telemetry.prom_null import new_metrics_registry
from engine.telemetry.stats import EngineStats

Messages = Sequence[dict[str, str]]


class LLM:
    def __init__(self, model: str = "smollm2-135m", **config_fields: object) -> None:
        unknown = set(config_fields) - EngineConfig.field_names()
        if unknown:
            raise ValueError(f"{sorted(unknown)[0]}: not an EngineConfig field")
        self.config = EngineConfig(model=model, **config_fields)  # type: ignore[arg-type]
        self.engine = LLMEngine(self.config, make_metrics=new_metrics_registry)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts (strings or token-id lists) to completion; outputs in input order.
        With SamplingParams.n > 1 a prompt gives n outputs (its sequences, by `index`) in a
        row."""
        prompts = _as_batch(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params: {len(params)} given for {len(prompts)} prompts")
        # Validate everything before anything runs: one bad prompt rejects the whole batch.
        requests = [self.engine.make_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        for request in requests:
            self.engine.add(request)
        results: dict[tuple[str, int], RequestOutput] = {}
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step_or_raise():  # raising beats looping forever
                    if out.finished:
                        results[(out.request_id, out.index)] = out
        except BaseException:
            self.engine.abort_all("generation interrupted")
            raise
        return [results[(r.group_id, i)] for r in requests for i in range(r.params.n)]

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them."""
        if not isinstance(messages, list | tuple) or not messages:
            raise ValueError("messages: must be a non-empty list of {role, content} messages")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts = [self.engine.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, params)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def block_snapshot(self) -> BlockSnapshot:
        return self.engine.block_snapshot()


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, list | tuple):
        raise ValueError(
            f"prompts: must be a string, a list of token ids or a list of those, got {prompts!r}"
        )
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    for prompt in prompts:  # the engine checks each id against the vocabulary
        if not isinstance(prompt, str | list | tuple):
            raise ValueError(
                f"prompt: must be a string or a list of token ids, got {prompt!r} in a batch"
            )
    return prompts
