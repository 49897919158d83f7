"""The tokenizer that builds load-test prompts in remote mode (the server tokenizes its own chat;
only the load generator needs token ids here). Never a hub access (the machine may be offline)
and never torch: tokenizers load with local_files_only through the torch-free engine.tokenizer.

The chain, first that works:
  1. the served model id (or --tokenizer): a local folder, a local GGUF (llama.cpp names its
     model after the file) or a Hugging Face name already in the local cache;
  2. the embedded model's tokenizer (smollm2-135m);
  3. no tokenizer: token-id prompts drawn from ids every modern vocabulary has. The completions
     API takes lists of ids (vLLM, SGLang, llama.cpp and ours accept them), so lengths are exact.
Which one was used is `source`, shown in the UI and written to the results.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from playground.loadgen.workload import Tokenizer

if TYPE_CHECKING:
    from playground.remote.client import RemoteServer

# Token-id prompts without a tokenizer: ids in [FIRST_PLAIN_ID, vocab). Special and byte tokens
# sit below ~1000 in Llama-2/SmolLM/Gemma-style vocabularies and above 100k in Llama-3/Qwen ones;
# every modern vocabulary has at least 32000 ids.
FIRST_PLAIN_ID = 1000
DEFAULT_ID_VOCAB = 32000


class TokenIdPrompts:
    """A Tokenizer with no vocabulary behind it: enough for random token-id prompts
    (vocab_size, all_special_ids), never for text."""

    def __init__(self, vocab_size: int | None = None) -> None:
        self.vocab_size = max(vocab_size or DEFAULT_ID_VOCAB, FIRST_PLAIN_ID + 1)
        self.all_special_ids = list(range(FIRST_PLAIN_ID))  # ids kept out of prompts

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        raise ValueError(
            "tokenizer: none was found, so only random token-id prompts work; dataset prompts "
            "with a shared prefix need the served model's tokenizer (--tokenizer)"
        )


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "~", ".")) or name.endswith(".gguf") or "\\" in name


def tokenizer_from_name(name: str) -> Tokenizer:
    """A local tokenizer for a model id, folder, GGUF or cached Hugging Face name; ValueError
    says why not. Never downloads."""
    from engine import tokenizer as files

    if name == files.EMBEDDED_MODEL:
        return files.load_tokenizer_files(files.embedded_tokenizer_dir())
    path = Path(name).expanduser()
    if path.is_dir():
        tokenizer = files.load_tokenizer_files(path)
        if tokenizer is None:
            raise ValueError(f"{name!r}: the folder ships no tokenizer")
        return tokenizer
    if path.is_file() and path.suffix == ".gguf":
        return files.load_tokenizer_files(files.gguf_tokenizer_dir(path))
    if _looks_like_path(name):
        raise ValueError(f"{name!r}: no such folder or GGUF on this machine")
    try:
        return files.load_cached_tokenizer(name)
    except Exception as e:  # not in the local hub cache (OSError), or not a fast tokenizer
        raise ValueError(
            f"{name!r}: not in the local Hugging Face cache ({type(e).__name__})"
        ) from None


@dataclass(frozen=True)
class PromptTokenizer:
    tokenizer: Tokenizer
    source: str  # which link of the chain, and why the earlier ones failed


def resolve_prompt_tokenizer(name: str | None, server_vocab_size: int | None) -> PromptTokenizer:
    """The chain of the module docstring. server_vocab_size (llama.cpp reports it) rejects a
    tokenizer whose ids the served model does not have."""
    from engine.tokenizer import EMBEDDED_MODEL

    why: list[str] = []
    candidates = [(name, "the served model's"), (EMBEDDED_MODEL, "the embedded model's")]
    if name == EMBEDDED_MODEL:
        candidates.pop()
    for candidate, what in candidates:
        if not candidate:
            continue
        try:
            tokenizer = tokenizer_from_name(candidate)
        except (ValueError, OSError) as e:
            why.append(str(e))
            continue
        vocab = getattr(tokenizer, "vocab_size", 0)
        if server_vocab_size is not None and vocab > server_vocab_size:
            why.append(f"{candidate!r}: {vocab} ids, the server's model has {server_vocab_size}")
            continue
        note = f" ({'; '.join(why)})" if why else ""
        return PromptTokenizer(tokenizer, f"{what} tokenizer `{candidate}`{note}")
    ids = TokenIdPrompts(server_vocab_size)
    return PromptTokenizer(
        ids,
        f"no tokenizer: token ids {FIRST_PLAIN_ID}..{ids.vocab_size - 1} ({'; '.join(why)})",
    )


class LazyTokenizer:
    """resolve_prompt_tokenizer on first use (not at start-up), kept."""

    def __init__(self, name: str | None, server_vocab_size: int | None = None) -> None:
        self.name = name
        self.server_vocab_size = server_vocab_size
        self._resolved: PromptTokenizer | None = None
        self._lock = threading.Lock()

    @classmethod
    def for_remote(cls, remote: RemoteServer) -> LazyTokenizer:
        return cls(remote.tokenizer_name or remote.model, remote.vocab_size)

    @property
    def description(self) -> str:
        """For the UI before the first load: what will be tried."""
        if self._resolved is not None:
            return self._resolved.source
        return f"`{self.name}` if local, else the embedded model's, else plain token ids"

    def resolve(self) -> PromptTokenizer:
        with self._lock:
            if self._resolved is None:
                self._resolved = resolve_prompt_tokenizer(self.name, self.server_vocab_size)
            return self._resolved

    def get(self) -> Tokenizer:
        return self.resolve().tokenizer

    @property
    def source(self) -> str:
        return self.resolve().source
