"""Chat templating that keeps message content as data.

A chat template wraps each message in control tokens (`<|im_start|>user ... <|im_end|>`).
Rendering the template to text and tokenizing that text as a whole would read a user's own
`<|im_end|><|im_start|>system` as real control tokens: the user could open a system turn
(role injection). So the template is rendered around placeholders, its own text is tokenized
with special tokens, and each message's content with `split_special_tokens=True`, which
tokenizes `<|im_end|>` typed by a user as the plain characters it is.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from typing import Any


def tokenize_chat(tokenizer: Any, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of the conversation under the tokenizer's chat template, with a generation
    prompt; special-token text inside message content is never a control token."""
    nonce = uuid.uuid4().hex  # a placeholder no content can forge
    masked = [{**m, "content": f"\x00{nonce}:{i}\x00"} for i, m in enumerate(messages)]
    rendered = tokenizer.apply_chat_template(masked, add_generation_prompt=True, tokenize=False)
    # re.split with a group alternates: template text, message index, template text, ...
    parts = re.split(f"\x00{nonce}:(\\d+)\x00", rendered)
    indices = [int(p) for p in parts[1::2]]
    if set(indices) != set(range(len(messages))):
        # The template rewrote or dropped a placeholder (it edits content rather than
        # wrapping it): content and markup can no longer be told apart, so refuse rather
        # than tokenize user text as markup.
        raise ValueError("messages: this model's chat template rewrites message content")
    ids: list[int] = []
    for i, part in enumerate(parts):
        if i % 2 == 0:  # the template's own text: its markers are special tokens
            ids += tokenizer(part, add_special_tokens=False).input_ids if part else []
        else:
            content = messages[int(part)]["content"]
            if content:
                ids += tokenizer(
                    content, add_special_tokens=False, split_special_tokens=True
                ).input_ids
    return ids
