"""Greedy output must be token-for-token identical to Hugging Face transformers (float32, CPU),
for a batch of mixed-length prompts, in every scheduling mode the engine offers."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

pytestmark = pytest.mark.slow  # > 5 s: `make test-fast` leaves it out

MAX_NEW_TOKENS = 24

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "Write a haiku about the sea.",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
    "The quick brown fox",
    "In 1969, Neil Armstrong",
    "Translate to French: I like cheese.",
    "Q: What is the boiling point of water at sea level?\nA:",
    "Once upon a time, in a land far, far away, there lived a dragon who loved to read books "
    "about mathematics and the stars, and every night",
    "The three primary colors are",
    "import numpy as np\n\nx = np.arange(10)\n",
    "A list of fruits: apple, banana,",
    "Explain photosynthesis in one sentence:",
    "Roses are red, violets are blue,",
    "The most important rule of programming is",
    "Dear Sir or Madam, I am writing to",
    "SELECT name FROM users WHERE",
    "Paged attention stores the KV cache in fixed-size blocks so that memory is allocated on "
    "demand instead of reserving the maximum sequence length for every request. This means",
    "Summer",
]


@pytest.fixture(scope="module")
def hf_reference(llm_f32) -> dict[str, list[int]]:
    """Greedy continuations from transformers, one prompt at a time (no padding effects)."""
    from transformers import AutoModelForCausalLM

    folder = llm_f32.engine.source.weights_dir
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    tokenizer = llm_f32.tokenizer
    reference = {}
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = torch.tensor([tokenizer(prompt).input_ids])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_NEW_TOKENS,
                do_sample=False,
                pad_token_id=tokenizer.eos_token_id,
            )
            reference[prompt] = out[0, ids.shape[1] :].tolist()
    return reference


def _check(llm: LLM, reference: dict[str, list[int]]) -> None:
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0))
    mismatches = [
        (p, o.token_ids, reference[p]) for p, o in zip(PROMPTS, outs, strict=True)
        if o.token_ids != reference[p]
    ]  # fmt: skip
    assert not mismatches, f"{len(mismatches)} prompts differ from HF, first: {mismatches[0]}"
    stats = llm.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks, "blocks leaked after the run"
    llm.engine.block_manager.check_invariants()


def test_prompts_are_mixed_lengths(llm_f32):
    lengths = [len(llm_f32.tokenizer(p).input_ids) for p in PROMPTS]
    assert min(lengths) <= 2 and max(lengths) >= 30


def test_continuous_paged_matches_hf(llm_f32, hf_reference):
    _check(llm_f32, hf_reference)


def test_preemption_matches_hf(hf_reference):
    # 12 blocks x 16 tokens cannot hold 20 requests at once: the scheduler must preempt.
    llm = LLM(dtype="float32", num_kv_blocks=12, max_model_len=192)
    _check(llm, hf_reference)
    assert llm.stats().num_preemptions_total > 0


def test_chunked_prefill_matches_hf(hf_reference):
    llm = LLM(dtype="float32", max_num_batched_tokens=8, max_model_len=256)
    _check(llm, hf_reference)
    # Prompts longer than the budget were prefilled over several steps.
    assert any(s.kind == "mixed" for s in llm.stats().steps)


def test_static_batching_matches_hf(hf_reference):
    llm = LLM(dtype="float32", batching="static", max_num_seqs=8, max_model_len=256)
    _check(llm, hf_reference)


def test_contiguous_layout_matches_hf(hf_reference):
    llm = LLM(dtype="float32", kv_layout="contiguous", max_model_len=128, num_kv_blocks=64)
    _check(llm, hf_reference)
