"""The tokenizer that builds load-test prompts in remote mode (the server tokenizes its own
chat; only the load generator needs token ids here)."""

from __future__ import annotations

import threading

from playground.loadgen.workload import Tokenizer


class LazyTokenizer:
    """Loaded on first use (not at start-up) and kept: an engine model spec (smollm2-135m, a
    folder, a GGUF) or a Hugging Face name."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._tokenizer: Tokenizer | None = None
        self._lock = threading.Lock()

    def get(self) -> Tokenizer:
        with self._lock:
            if self._tokenizer is None:
                from playground.loadgen import load_tokenizer

                try:
                    tokenizer = load_tokenizer(self.name)
                except Exception as e:  # not installed, not downloadable, not a tokenizer
                    tokenizer, why = None, f"{type(e).__name__}: {e}"
                else:
                    why = "it ships no tokenizer"
                if tokenizer is None:
                    raise ValueError(
                        f"tokenizer: could not load {self.name!r} ({why}); start the playground "
                        "with --tokenizer and the served model's HF folder or engine model spec"
                    )
                self._tokenizer = tokenizer
            return self._tokenizer
