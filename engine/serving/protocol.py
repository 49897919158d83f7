"""The OpenAI API's shapes: request models (pydantic), response/chunk builders and errors.

Unknown request fields are accepted and ignored (clients send vendor extensions through
`extra_body`); fields we cannot honor are rejected with a 400 naming the field. Types are
strict (JSON's own types only: `true` is no integer, `"4"` no number, `1.0` no token id) and
numbers are bounded here already, so nonsense never reaches SamplingParams or the engine.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_validation_error(err: ValidationError) -> APIError:
    """A pydantic error as a 400 naming the first bad field (e.g. "messages.0.role")."""
    parts, first_param = [], None
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"] if not str(x).startswith(("function-", "list[")))
        # Union members show up as their type names ("str", "list[int]"): drop those.
        loc = ".".join(p for p in loc.split(".") if p not in ("str", "int", "float", "bool"))
        first_param = first_param or loc or None
        parts.append(f"{loc}: {e['msg']}" if loc else e["msg"])
    return bad_request("; ".join(dict.fromkeys(parts)), param=first_param)


def unencodable_string(obj: Any) -> str | None:
    """The path ("messages.0.content") of the first string or key in a parsed JSON body that
    is not valid Unicode text (a lone surrogate such as "\\ud800", which JSON can escape but
    UTF-8 cannot encode: the tokenizer and the JSON encoder would fail on it); None if all are
    fine. Iterative, so any nesting json.loads accepted is walked without recursion."""
    todo: list[tuple[str, Any]] = [("", obj)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, str):
            items: Any = ()
            if not _is_text(value):
                return path or "body"
        elif isinstance(value, dict):
            items = value.items()
        elif isinstance(value, list):
            items = enumerate(value)
        else:
            continue
        for key, item in items:
            if isinstance(key, str) and not _is_text(key):
                return path or "body"
            todo.append((f"{path}.{key}" if path else str(key), item))
    return None


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# --- requests --------------------------------------------------------------------------------


# Bounds at the HTTP schema (SamplingParams checks the sampler's own, tighter ranges too).
MAX_INT32 = 2**31 - 1  # counts and ids: anything larger is a typo or an attack
MAX_SEED = 2**64 - 1  # torch.Generator takes at most 64 bits
MAX_LOGPROBS = 20  # = engine.request.MAX_LOGPROBS (this module must load without the engine)
Count = Annotated[int, Field(ge=0, le=MAX_INT32)]
TokenId = Annotated[int, Field(ge=0, le=MAX_INT32)]
# -1e6..1e6: wide enough for every real setting, and no value that overflows a float32 tensor.
Real = Annotated[float, Field(ge=-1e6, le=1e6)]


class _Model(BaseModel):
    # strict: no coercion ("4" -> 4, true -> 1, 1.0 -> 1); allow_inf_nan: JSON has neither.
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Model):
    include_usage: bool = False


class _SamplingRequest(_Model):
    model: str | None = None  # None = the served model
    max_tokens: Count | None = None
    temperature: Real | None = None  # None = 1.0, OpenAI's default
    top_p: Real | None = None
    top_k: Annotated[int, Field(ge=-1, le=MAX_INT32)] | None = None  # (vLLM): -1 = off
    min_p: Real | None = None  # extension (vLLM)
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None  # extension (vLLM)
    ignore_eos: bool = False  # extension (vLLM): generate exactly max_tokens
    min_tokens: Count | None = None  # extension (vLLM): tokens before any stop may end it
    repetition_penalty: Real | None = None  # extension (vLLM)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Count = 1
    presence_penalty: Real | None = None
    frequency_penalty: Real | None = None
    logit_bias: dict[str, Real] | None = None
    user: str | None = None
    # vLLM's extensions we do not implement, kept (as anything) only to refuse them: see
    # NOT_HONORED_VLLM_FIELDS.
    use_beam_search: Any = None
    include_stop_str_in_output: Any = None
    skip_special_tokens: Any = None
    truncate_prompt_tokens: Any = None
    prompt_logprobs: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    logits_processors: Any = None
    return_tokens_as_token_ids: Any = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    # A text, a list of token ids, or a batch of one of those (only batches of one are served).
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    echo: bool = False  # the prompt leads the text (and its tokens the logprobs)
    logprobs: Count | None = None  # k alternatives per token, 0..MAX_LOGPROBS
    suffix: str | None = None
    best_of: Count | None = None


class ChatMessage(_Model):
    role: str
    # A string or OpenAI content parts [{"type": "text", "text": ...}].
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: Count | None = None  # the newer name of max_tokens; wins if both
    logprobs: bool = False
    top_logprobs: Count | None = None  # needs logprobs=true; 0..MAX_LOGPROBS
    echo: bool = False  # a completions parameter: refused here (400) rather than ignored
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: Any = None  # vLLM (not honored: NOT_HONORED_VLLM_FIELDS)
    continue_final_message: Any = None
    chat_template: Any = None


# --- responses -------------------------------------------------------------------------------


def usage(outputs: Sequence[Any]) -> dict:
    """OpenAI's usage object for a request's final RequestOutputs (one per choice): the prompt
    counted once, every choice's tokens, and prompt_tokens_details.cached_tokens, the prompt
    tokens the prefix cache held (0 with it off), which OpenAI and vLLM report there too."""
    first = outputs[0]
    num_prompt_tokens = len(first.prompt_token_ids)
    num_output_tokens = sum(len(out.token_ids) for out in outputs)
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": num_prompt_tokens + num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": first.metrics.num_cached_tokens},
    }


def sse(obj: dict[str, Any] | str) -> str:
    """One server-sent event."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n"


SSE_DONE = sse("[DONE]")


def _envelope(
    request_id: str, obj: str, model: str, choices: list[dict[str, Any]], **extra: Any
) -> dict[str, Any]:
    """What every OpenAI response and stream chunk carries around its choices."""
    return {
        "id": request_id,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        **extra,
    }


# `logprobs` below is a choice's logprobs object (engine/serving/logprobs_format.py) or None;
# `index` is the choice's index among the request's n.


def completion_choice(
    index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_response(
    request_id: str, model: str, choices: list[dict[str, Any]], usage_: dict[str, int]
) -> dict[str, Any]:
    return _envelope(request_id, "text_completion", model, choices, usage=usage_)


def completion_chunk(
    request_id: str, model: str, text: str, finish_reason: str | None,
    logprobs: dict[str, Any] | None = None, index: int = 0,
) -> dict[str, Any]:  # fmt: skip
    choice = completion_choice(index, text, finish_reason, logprobs)
    return _envelope(request_id, "text_completion", model, [choice])


def chat_choice(
    index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    message = {"role": "assistant", "content": text}
    return {
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }


def chat_response(
    request_id: str, model: str, choices: list[dict[str, Any]], usage_: dict[str, int]
) -> dict[str, Any]:
    return _envelope(request_id, "chat.completion", model, choices, usage=usage_)


def chat_chunk(
    request_id: str, model: str, delta: dict[str, Any], finish_reason: str | None,
    logprobs: dict[str, Any] | None = None, index: int = 0,
) -> dict[str, Any]:  # fmt: skip
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return _envelope(request_id, "chat.completion.chunk", model, [choice])


def usage_chunk(request_id: str, model: str, obj: str, usage_: dict[str, int]) -> dict[str, Any]:
    """The last chunk when stream_options.include_usage: no choices, only usage."""
    return _envelope(request_id, obj, model, [], usage=usage_)


# --- requests -> engine inputs ---------------------------------------------------------------

_CHAT_ROLES = ("system", "developer", "user", "assistant")


def field_of(message: str) -> str | None:
    """The field an engine ValueError names ("top_p: must be in (0, 1]" -> "top_p")."""
    head, sep, _ = message.partition(":")
    return head.strip() if sep and head.strip().isidentifier() else None


# vLLM's request extensions that change the tokens or the answer's shape, with the values that
# change neither (what we serve anyway). Unknown fields are ignored (extra="ignore"), but these
# a vLLM client sends on purpose: guided_json ignored would give free text that looks like an
# answer. So any other value gets a 400 naming the field. The ones we implement
# (top_k, min_p, ignore_eos, min_tokens, stop_token_ids, repetition_penalty) are fields of
# their own above.
NOT_HONORED_VLLM_FIELDS: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (None, False),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "truncate_prompt_tokens": (None,),
    "prompt_logprobs": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
    "logits_processors": (None, []),
    "return_tokens_as_token_ids": (None, False),
    "add_generation_prompt": (None, True),  # chat only, as the three below
    "continue_final_message": (None, False),
    "chat_template": (None,),
}


def _reject_not_honored(req: _SamplingRequest) -> None:
    for name, neutral in NOT_HONORED_VLLM_FIELDS.items():
        value = getattr(req, name, None)
        # Same type and value, or the same object: 0 == False in Python, but use_beam_search=0
        # is no boolean (and the API's types are strict).
        if not any(value is v or (type(value) is type(v) and value == v) for v in neutral):
            raise bad_request(
                f"{name}: not supported (a vLLM extension this engine does not implement)",
                param=name,
            )


def _reject_unsupported(req: _SamplingRequest) -> None:
    _reject_not_honored(req)
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise bad_request("suffix: not supported", param="suffix")
        if req.best_of not in (None, 1):
            raise bad_request("best_of: only best_of=1 is supported", param="best_of")
    if isinstance(req, ChatCompletionRequest):
        if req.echo:
            raise bad_request(
                "echo: not supported by chat completions (it is a completions parameter)",
                param="echo",
            )
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs: needs logprobs=true", param="top_logprobs")
        if req.top_logprobs is not None and req.top_logprobs > MAX_LOGPROBS:
            raise bad_request(
                f"top_logprobs: must be an integer in [0, {MAX_LOGPROBS}], got {req.top_logprobs}",
                param="top_logprobs",
            )
        if req.tools:
            raise bad_request("tools: tool calling is not supported", param="tools")
        kind = (req.response_format or {}).get("type", "text")
        if kind != "text":
            raise bad_request(
                f"response_format: only 'text' is supported, got {kind!r}", param="response_format"
            )


def _logprobs_settings(req: _SamplingRequest) -> tuple[int | None, int | None]:
    """(SamplingParams.logprobs, prompt_logprobs) the request asks for: completions score the
    prompt only under echo (its tokens lead the answer); chat never scores the prompt."""
    if isinstance(req, CompletionRequest):
        return req.logprobs, req.logprobs if req.echo else None
    if isinstance(req, ChatCompletionRequest) and req.logprobs:
        return req.top_logprobs or 0, None
    return None, None


def sampling_params(req: _SamplingRequest, max_tokens: int) -> Any:
    """The request's SamplingParams; a bad value becomes a 400 naming its field."""
    from engine.request import SamplingParams

    _reject_unsupported(req)
    logprobs, prompt_logprobs = _logprobs_settings(req)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            seed=req.seed,
            stop=req.stop or (),
            stop_token_ids=req.stop_token_ids or (),
            ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens or 0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            logit_bias=req.logit_bias,  # {"<token id>": bias}; SamplingParams parses the ids
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            n=req.n,  # > max_num_seqs: the engine's "n: ..." ValueError, a 400 naming n
        )
    except ValueError as e:
        message, param = str(e), field_of(str(e))
        if param == "max_tokens" and getattr(req, "max_completion_tokens", None) is not None:
            param = "max_completion_tokens"  # name the field the client actually sent
            message = message.replace("max_tokens", param, 1)
        raise bad_request(message, param=param) from None


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """The one prompt of a completion request: a text or a list of token ids (the engine
    checks the ids against the vocabulary)."""
    prompt: Any = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise bad_request(
                "prompt: batches of several prompts are not supported; send one per request",
                param="prompt",
            )
        prompt = prompt[0]
    if len(prompt) == 0:
        raise bad_request("prompt: must not be empty", param="prompt")
    return prompt


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, str]]:
    """Messages for the chat template: text-only content, 'developer' read as 'system'."""
    if not req.messages:
        raise bad_request("messages: must not be empty", param="messages")
    messages = []
    for i, m in enumerate(req.messages):
        if m.role not in _CHAT_ROLES:
            raise bad_request(
                f"messages.{i}.role: must be one of {', '.join(_CHAT_ROLES)}; got {m.role!r}",
                param=f"messages.{i}.role",
            )
        content = m.content
        if isinstance(content, list):
            texts = [p.get("text") for p in content if isinstance(p, dict)]
            if len(texts) != len(content) or any(
                p.get("type") != "text" or not isinstance(t, str)
                for p, t in zip(content, texts, strict=True)
            ):
                raise bad_request(
                    f"messages.{i}.content: only text content parts are supported",
                    param=f"messages.{i}.content",
                )
            content = "\n".join(texts)  # type: ignore[arg-type]
        role = "system" if m.role == "developer" else m.role
        messages.append({"role": role, "content": content or ""})
    return messages
