"""engine/cli.py: every CLI takes its engine flags from EngineConfig through one helper, with
choices from the Literals; a field a CLI leaves out is listed here with the reason."""

import argparse
import typing

import pytest

import app
from benchmarks import batch1, kv_quant, prefix, quant, spec, throughput
from engine.cli import FLAG_HELP, add_engine_args, config_from_args
from engine.config import EngineConfig, literal_choices
from engine.serving import server

# CLI -> (its parser, the EngineConfig fields deliberately not flags there).
CLIS = {
    "app.py": (app.build_parser, set()),
    "engine.serving.server": (server.build_parser, set()),
    # Benchmarks: their own --seed seeds the workload; each varies one setting itself.
    "benchmarks.throughput": (throughput.build_parser, {"seed", "batching"}),
    "benchmarks.prefix": (prefix.build_parser, {"seed", "enable_prefix_caching"}),
    "benchmarks.spec": (
        spec.build_parser,
        {"seed", "speculative_method", "speculative_quantization", "max_num_seqs"},
    ),
    "benchmarks.quant": (
        quant.build_parser,
        {"seed", "quantization", "int8_activations", "max_num_seqs"},
    ),
    "benchmarks.batch1": (batch1.build_parser, {"seed"}),
    "benchmarks.kv_quant": (
        kv_quant.build_parser,
        {"seed", "kv_cache_dtype", "kv_cache_memory_bytes"},
    ),
}


def _engine_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Field name -> the action of the engine flag of that name."""
    names = EngineConfig.field_names()
    return {
        a.dest: a
        for a in parser._actions
        if a.dest in names and any(s.startswith("--") for s in a.option_strings)
    }


@pytest.mark.parametrize("cli", list(CLIS))
def test_every_config_field_is_a_flag_or_listed_absent(cli):
    build, absent = CLIS[cli]
    actions = _engine_actions(build())
    assert set(actions) == EngineConfig.field_names() - absent
    for name, action in actions.items():
        assert action.option_strings[0] == "--" + name.replace("_", "-")
        assert FLAG_HELP[name] in action.help


@pytest.mark.parametrize("cli", list(CLIS))
def test_choices_come_from_the_literals(cli):
    build, _ = CLIS[cli]
    actions = _engine_actions(build())
    choices = literal_choices()
    for name, action in actions.items():
        assert action.choices == choices.get(name), name


def test_literal_choices_are_the_annotations():
    hints = typing.get_type_hints(EngineConfig)
    assert literal_choices()["kv_layout"] == typing.get_args(hints["kv_layout"])
    assert set(literal_choices()) == {
        "device", "dtype", "kv_layout", "kv_cache_dtype", "batching", "speculative_method",
        "attention_backend", "quantization", "kv_scale_granularity", "speculative_quantization",
    }  # fmt: skip
    with pytest.raises(ValueError, match="kv_layout: must be one of paged, contiguous"):
        EngineConfig(kv_layout="ragged")  # type: ignore[arg-type]


def test_every_field_has_help():
    assert set(FLAG_HELP) == EngineConfig.field_names()


def test_unset_flags_keep_the_config_default_and_cli_defaults_apply():
    p = argparse.ArgumentParser()
    add_engine_args(p, defaults={"enable_prefix_caching": True}, exclude=("seed",))
    args = p.parse_args(["--dtype", "float32", "--num-kv-blocks", "8", "--no-enforce-eager"])
    assert vars(args) == {
        "dtype": "float32", "num_kv_blocks": 8, "enforce_eager": False,
        "enable_prefix_caching": True,
    }  # fmt: skip
    config = config_from_args(args, batching="static")
    assert config == EngineConfig(
        dtype="float32", num_kv_blocks=8, enable_prefix_caching=True, batching="static"
    )
    with pytest.raises(SystemExit):
        p.parse_args(["--seed", "1"])  # excluded
    with pytest.raises(ValueError, match="not an EngineConfig field"):
        add_engine_args(argparse.ArgumentParser(), defaults={"nonsense": 1})


def test_per_cli_defaults():
    assert app.build_parser().parse_args([]).enable_prefix_caching is True  # the app caches chats
    assert not hasattr(server.build_parser().parse_args([]), "enable_prefix_caching")
    assert throughput.build_parser().parse_args([]).dtype == "bfloat16"
    assert config_from_args(server.build_parser().parse_args([])) == EngineConfig()
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        config_from_args(app.build_parser().parse_args(["--gpu-memory-utilization", "2"]))
