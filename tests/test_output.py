"""OutputProcessor without a model: deltas, stop strings inside verified drafts, held-back text."""

from __future__ import annotations

from engine.core.block_manager import BlockManager
from engine.core.output import OutputProcessor
from engine.core.scheduler import Scheduler
from engine.request import Request, SamplingParams

CHARS = "xyzabcde"  # token id i is the character CHARS[i]


class CharTokenizer:
    """One character per token, so every text boundary is easy to predict."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(CHARS[i] for i in ids)


def ids(text: str) -> list[int]:
    return [CHARS.index(c) for c in text]


def test_a_stop_string_inside_verified_drafts_ends_the_request_at_its_token():
    sched = Scheduler(BlockManager(16, 4), max_num_seqs=4, max_num_batched_tokens=64)
    processor = OutputProcessor(CharTokenizer(), sched)
    params = SamplingParams(max_tokens=10, stop="cd", ignore_eos=True)
    request = Request("r", ids("xyz"), params, arrival_time=0.0, max_total_tokens=64)
    processor.start(request)
    sched.add_request(request)

    out = sched.schedule()
    (first,) = processor.process(sched.update(out, {"r": ids("a")}, now=1.0))
    # "a" could not start "cd", but one character is held back for any stop string of 2.
    assert (first.new_token_ids, first.new_text, first.finished) == (ids("a"), "", False)

    out = sched.schedule(drafts={"r": ids("bcd")})
    touched = sched.update(out, {"r": ids("bcde")}, now=2.0)  # all 3 accepted, plus "e"
    (last,) = processor.process(touched)
    assert last.finished and last.finish_reason == "stop"
    assert (last.text, last.new_text) == ("ab", "ab")  # the stop string is not in the text
    assert last.new_token_ids == ids("bcd")  # "e" came after the stop: dropped
    assert request.output_token_ids == ids("abcd") and len(request.metrics.token_times) == 4
    assert not sched.running and sched.block_manager.num_free_blocks == 16


def test_an_abort_releases_the_held_back_text():
    sched = Scheduler(BlockManager(16, 4), max_num_seqs=4, max_num_batched_tokens=64)
    processor = OutputProcessor(CharTokenizer(), sched)
    params = SamplingParams(max_tokens=10, stop="dd", ignore_eos=True)
    request = Request("r", ids("xyz"), params, arrival_time=0.0, max_total_tokens=64)
    processor.start(request)
    sched.add_request(request)
    out = sched.schedule()
    (delta,) = processor.process(sched.update(out, {"r": ids("d")}))
    assert delta.new_text == ""  # "d" may begin "dd"
    final = processor.final_output(sched.abort("r"))
    assert (final.finished, final.finish_reason, final.new_text) == (True, "abort", "d")
    assert final.new_token_ids == []
