import os

# Before any kernel module imports triton: Triton kernels run (and are tested) on CPU.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build the C++ CPU kernels before the first test (about 30 s each, once per machine,
    then cached): attention_backend="auto" and fused_ops use them on CPU, and no test's own
    timeout (a server start, a subprocess) should pay for the compile. Without a compiler
    these return the reason and the engines run the torch path, as they would for a user."""
    from kernels.cpu_attention import cpu_kernel_status
    from kernels.cpu_fused_ops import cpu_fused_ops_status

    cpu_kernel_status()
    cpu_fused_ops_status()


@pytest.fixture(scope="session")
def make_llm():
    """make_llm(**kwargs) -> LLM(**kwargs), one engine per distinct EngineConfig for the whole
    session (the embedded model takes 10-30 s to load on a 2-core CPU). Only for tests that
    leave the engine as they found it (requests finished, nothing reconfigured), so that the
    next file sees the same engine it would have built; counters and step history do grow, so
    read them as differences."""
    from engine import LLM, EngineConfig

    engines: dict[EngineConfig, LLM] = {}

    def make(**kwargs: object) -> LLM:
        config = EngineConfig(**kwargs)  # keyed by config: defaults spelt out or not, same key
        if config not in engines:
            engines[config] = LLM(**kwargs)
        return engines[config]

    return make


@pytest.fixture(scope="session")
def llm_f32(make_llm):
    """The embedded model in float32 (parity tests), shared by the whole session."""
    return make_llm(dtype="float32", max_model_len=512)


@pytest.fixture(scope="session")
def tiny_llm(make_llm):
    """A 2-layer random model: fast tests of engine mechanics."""
    return make_llm(model="random:tiny", dtype="float32", max_model_len=256, num_kv_blocks=64)


@pytest.fixture(scope="module")
def tiny_service():
    """The 2-layer random model behind an EngineService (the app's threaded engine), one per
    test file: the Chat tab's backends and other streaming clients run against it."""
    from engine import EngineConfig, EngineService

    service = EngineService(EngineConfig(model="random:tiny", dtype="float32", max_model_len=256,
                                         num_kv_blocks=64))  # fmt: skip
    yield service
    service.shutdown()


@pytest.fixture(scope="session")
def tiny_hf_folder(tmp_path_factory):
    """A tiny random Llama as a local Hugging Face folder (tests/tiny_hf.py), float32."""
    from tiny_hf import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
