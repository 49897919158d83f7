"""OutputProcessor: the requests a step touched -> the RequestOutput deltas callers see.

It extends each request's text with the step's tokens (incremental detokenization in
detokenizer.py), ends a request at a stop string (the scheduler finishes it and frees its
blocks), holds back streamed text that could be the start of a stop string, and builds the
deltas. It keeps no state of its own: everything it tracks lives on the Request.
"""

from __future__ import annotations

import logging
from typing import Any

from engine.core.detokenizer import detokenize_new, find_stop, init_offsets, stop_holdback
from engine.core.scheduler import Scheduler
from engine.request import Request, RequestOutput, RequestStatus

logger = logging.getLogger(__name__)


class OutputProcessor:
    def __init__(self, tokenizer: Any, scheduler: Scheduler) -> None:
        # A Hugging Face tokenizer, or None for models without one (token ids only, no text).
        self.tokenizer = tokenizer
        self.scheduler = scheduler

    def start(self, request: Request) -> None:
        """Set up a new request's detokenization state (once, before it is added)."""
        init_offsets(request)

    def process(self, requests: list[Request]) -> list[RequestOutput]:
        """One delta per request that got tokens this step; a request may finish here (stop
        string, or an error), so callers read `finished` on the request or the output after.

        A request whose detokenizing raises fails alone: it is aborted (its blocks freed if
        it still held them) and its final output carries the error; the others go on."""
        outputs = []
        for request in requests:
            try:
                outputs.append(self._output_for(request))
            except Exception as exc:
                outputs.append(self._fail(request, exc))
        return outputs

    def final_output(self, request: Request) -> RequestOutput:
        """The last delta of a request ended outside a step (abort): no new tokens, and the
        text held back for stop strings is released."""
        return self._delta(request, new_token_ids=[])

    def _fail(self, request: Request, exc: Exception) -> RequestOutput:
        logger.exception("request %s failed in detokenizing", request.request_id)
        if request.finished:  # a token stop this step: its blocks are already free
            request.status = RequestStatus.FINISHED_ABORTED
        else:
            self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        out = self.final_output(request)
        out.error = f"engine error: detokenizing failed: {type(exc).__name__}: {exc}"
        return out

    def _output_for(self, request: Request) -> RequestOutput:
        if self.tokenizer is not None:
            self._detokenize(request)
        num_new = request.num_new_output_tokens  # 1, or more after verified drafts
        new_token_ids = request.output_token_ids[len(request.output_token_ids) - num_new :]
        return self._delta(request, new_token_ids)

    def _detokenize(self, request: Request) -> None:
        """Extend the request's text with this step's tokens; end it at a stop string.

        Several tokens (verified drafts) are taken one at a time when stop strings are set,
        so that the request ends at the token that completed the stop string and the tokens
        after it are dropped, exactly as one-token decoding would have ended it."""
        num_new = request.num_new_output_tokens
        if num_new <= 1 or not request.params.stop:
            self._extend_text(request, final=request.finished)
            return
        self._cut_at_stop_string(request, num_new)
        # Tokens dropped after a stop string drop their logprobs too (kept one per token).
        del request.output_logprobs[request.num_output_tokens :]

    def _cut_at_stop_string(self, request: Request, num_new: int) -> None:
        """Re-add the step's tokens one at a time; drop those after a completed stop string."""
        tokens = request.output_token_ids[-num_new:]
        del request.output_token_ids[-num_new:]
        for i, token in enumerate(tokens):
            request.output_token_ids.append(token)
            if self._extend_text(request, final=request.finished and i == num_new - 1):
                dropped = num_new - 1 - i
                if dropped:
                    del request.metrics.token_times[-dropped:]
                    del request.metrics.token_drafted[-dropped:]
                    request.num_new_output_tokens -= dropped
                    request.metrics.num_output_tokens -= dropped
                return

    def _extend_text(self, request: Request, final: bool) -> bool:
        """Detokenize up to the last output token; True when a stop string ended the request."""
        new_text = detokenize_new(self.tokenizer, request, final=final)
        params = request.params
        if not new_text or request.below_min_tokens:  # min_tokens: no stop string before them
            return False
        cut = find_stop(request.output_text, params.stop, len(new_text))
        if cut is None:
            return False
        request.output_text = request.output_text[:cut]
        if request.finished:  # the same token also hit a length limit: stop wins
            request.status = RequestStatus.FINISHED_STOPPED
        else:
            self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
        return True

    def _delta(self, request: Request, new_token_ids: list[int]) -> RequestOutput:
        # While streaming, hold back text that could be the start of a stop string.
        sendable = len(request.output_text)
        if request.params.stop and not request.finished:
            sendable -= stop_holdback(request.params.stop)
        sent = request.num_text_chars_sent
        new_text = request.output_text[sent:sendable] if sendable > sent else ""
        request.num_text_chars_sent = max(sent, sendable)
        params = request.params
        logprobs = new_logprobs = prompt_logprobs = None
        if params.logprobs is not None:
            logprobs = list(request.output_logprobs)
            new_logprobs = logprobs[len(logprobs) - len(new_token_ids) :]
        if params.prompt_logprobs is not None and self._prompt_scored(request):
            prompt_logprobs = [None, *request.prompt_logprobs]
        return RequestOutput(
            request_id=request.group_id,  # the caller's id, for each of the n sequences
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=list(request.output_token_ids),
            text=request.output_text[: request.num_text_chars_sent],
            new_token_ids=new_token_ids,
            new_text=new_text,
            finished=request.finished,
            finish_reason=request.finish_reason,
            metrics=request.metrics,
            logprobs=logprobs,
            new_logprobs=new_logprobs,
            prompt_logprobs=prompt_logprobs,
            index=request.sample_index,
            request_finished=request.finished,  # the engine corrects it for n > 1
        )

    @staticmethod
    def _prompt_scored(request: Request) -> bool:
        """Every prompt token after the first has its logprob (an abort mid-prefill: not)."""
        return len(request.prompt_logprobs) == request.num_prompt_tokens - 1
