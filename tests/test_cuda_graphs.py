"""CUDA graphs: bucket choice on CPU; identical tokens with and without graphs on a GPU."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cuda_graphs import batch_size_buckets


def test_buckets_cover_every_batch_size():
    buckets = batch_size_buckets(64)
    assert buckets[:4] == [1, 2, 4, 8] and buckets[-1] == 64
    assert batch_size_buckets(5) == [1, 2, 4, 5]
    for batch in range(1, 65):
        assert any(b >= batch for b in buckets)


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
