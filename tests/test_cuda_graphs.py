"""CUDA graphs: on CPU, the runner's static buffers, padding and bucket choice (the graph
replaced by a re-run of the forward pass over the same buffers); on a GPU, identical tokens
with and without real graphs."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.runner.cuda_graphs import CudaGraphRunner, batch_size_buckets


def test_buckets_cover_every_batch_size():
    buckets = batch_size_buckets(64)
    assert buckets[:4] == [1, 2, 4, 8] and buckets[-1] == 64
    assert batch_size_buckets(5) == [1, 2, 4, 5]
    for batch in range(1, 65):
        assert any(b >= batch for b in buckets)


class RerunGraphRunner(CudaGraphRunner):
    """Replays a bucket by running the model again on the static buffers, as a graph would
    (same inputs, same output tensor), and counts the replays per bucket."""

    replays: dict[int, int]

    def _capture_bucket(self, batch: int, args: tuple) -> torch.Tensor:
        self.replays = getattr(self, "replays", {})
        self.replays[batch] = 0
        output = self.model(*args)

        def replay() -> None:
            self.replays[batch] += 1
            output.copy_(self.model(*args))

        self.graphs[batch] = replay
        return output

    def run(self, *args, **kwargs) -> torch.Tensor:
        # Whatever earlier steps left in the static buffers must not matter: fill them with
        # live-looking garbage (real slots, long lengths) before each step.
        generator = torch.Generator().manual_seed(sum(self.replays.values()))
        num_slots = self.kv_caches[0][0].shape[0] * self.kv_caches[0][0].shape[1]
        attn = self.attn_buffers
        for buffer, high in ((self.input_ids, 1000), (self.positions, 32),
                             (attn.slot_mapping, num_slots), (attn.seq_lens, 32),
                             (attn.block_tables, self.kv_caches[0][0].shape[0])):  # fmt: skip
            buffer.copy_(torch.randint(high, buffer.shape, generator=generator))
        return super().run(*args, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_graph_runner_buffers_and_padding_keep_tokens_on_cpu(kv_cache_dtype):
    """Decode batches from 5 down to 1 replay buckets 8, 4, 2 and 1: the padding rows (slot -1,
    seq_len 0) must neither write the cache nor change a real row's token (with int8 KV, nor
    its scales: the graphs capture the per-layer scale tensors with the cache)."""
    prompts = [[(7 * i + j) % 1000 + 3 for j in range(n)] for i, n in enumerate([5, 17, 9, 3, 12])]
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 12, 5, 2, 8)
    ]
    common = dict(model="random:tiny", dtype="float32", attention_backend="triton",
                  max_num_seqs=8, num_kv_blocks=32, block_size=8, max_model_len=64,
                  kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    eager_llm = LLM(**common)
    eager = eager_llm.generate(prompts, params)
    llm = LLM(**common)
    runner = llm.engine.runner
    assert runner.graph_runner is None  # CPU: no real graphs
    graphs = RerunGraphRunner(
        runner.model, runner.attn_backend, runner.kv_caches, 8, runner.max_model_len
    )
    graphs.capture()
    runner.graph_runner = graphs
    out = llm.generate(prompts, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in eager]
    # Same blocks, same K/V: a padding row that wrote a slot would show here even where it
    # did not flip a greedy token. (Not bitwise: the padded matmuls may round differently.)
    for layer, eager_layer in zip(runner.kv_caches, eager_llm.engine.runner.kv_caches, strict=True):
        for mine, eager_one in zip(layer, eager_layer, strict=True):  # K, V (and scales)
            if mine is None:
                continue
            # int8: a value on a rounding boundary may land one step apart (not bitwise).
            tolerance = {"rtol": 0, "atol": 1} if mine.dtype == torch.int8 else {}
            torch.testing.assert_close(mine.float(), eager_one.float(), **tolerance)
    stats = llm.stats()
    # Every pure-decode step replayed a graph; prefill and mixed steps ran eagerly.
    assert sum(graphs.replays.values()) == sum(s.kind == "decode" for s in stats.steps)
    assert all(n > 0 for n in graphs.replays.values())  # 5 -> 8 and 3 -> 4 pad rows
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graphs_give_the_same_tokens_as_eager():
    prompts = [[(11 * i + j) % 5000 + 3 for j in range(8 + 13 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    common = dict(model="random:smollm2-135m", dtype="float32", max_num_seqs=8,
                  max_model_len=512, num_kv_blocks=256)  # fmt: skip
    graphed = LLM(enforce_eager=False, **common)
    assert graphed.engine.runner.graph_runner is not None
    eager = LLM(enforce_eager=True, **common)
    assert eager.engine.runner.graph_runner is None
    assert [o.token_ids for o in graphed.generate(prompts, params)] == [
        o.token_ids for o in eager.generate(prompts, params)
    ]
