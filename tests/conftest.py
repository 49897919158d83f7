import os

# Before any kernel module imports triton: Triton kernels run (and are tested) on CPU.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest


@pytest.fixture(scope="session")
def llm_f32():
    """The embedded model in float32 (parity tests), shared by the whole session."""
    from engine import LLM

    return LLM(dtype="float32", max_model_len=512)


@pytest.fixture(scope="session")
def tiny_llm():
    """A 2-layer random model: fast tests of engine mechanics."""
    from engine import LLM

    return LLM(model="random:tiny", dtype="float32", max_model_len=256, num_kv_blocks=64)
