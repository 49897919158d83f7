"""AutoAWQ GEMM checkpoints (quantization="awq"): the int32 packing against the format
description, the checks of quantization_config and tensors, and engine greedy output equal to
a plain float32 folder holding the same dequantized weights (tiny random AWQ folder made here)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from engine import LLM, SamplingParams
from engine.runner.models.presets import MODEL_PRESETS
from engine.runner.quant.awq import AWQ_ORDER, check_awq_config, pack_awq_int32, unpack_awq_int32
from engine.runner.quant.formats import Int4Weight, dequantize_int4, quantize_int4
from engine.runner.quant.linear import Int4Linear

AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm",
              "zero_point": True}  # fmt: skip
ARCH = MODEL_PRESETS["tiny"]


def test_pack_matches_the_format_description_and_round_trips():
    values = torch.randint(
        0, 16, (6, 24), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    packed = pack_awq_int32(values)
    assert packed.dtype == torch.int32 and packed.shape == (6, 3)
    for r in range(6):
        for c in range(3):
            word = int(packed[r, c]) & 0xFFFFFFFF
            for i in range(8):  # nibble i holds column 8c + AWQ_ORDER[i]
                assert (word >> (4 * i)) & 15 == int(values[r, 8 * c + AWQ_ORDER[i]])
    assert torch.equal(unpack_awq_int32(packed), values)


@pytest.mark.parametrize(
    ("change", "field"),
    [({"bits": 8}, "bits"), ({"version": "gemv"}, "version"), ({"zero_point": False}, "zero_point"),
     ({"group_size": 48}, "group_size")],
)  # fmt: skip
def test_quantization_config_checks_name_the_field(change, field):
    assert check_awq_config(AWQ_CONFIG, "f") == 32
    with pytest.raises(ValueError, match=f"quantization_config.{field}"):
        check_awq_config({**AWQ_CONFIG, **change}, "f")
    with pytest.raises(ValueError, match="needs an AutoAWQ checkpoint"):
        check_awq_config(None, "f")


def _hf_linears(layer: int) -> dict[str, torch.Tensor]:
    """Random float weights of one decoder layer under Hugging Face names."""
    gen = torch.Generator().manual_seed(layer)
    h, inter, d = ARCH.hidden_size, ARCH.intermediate_size, ARCH.head_dim
    shapes = {"self_attn.q_proj": (ARCH.num_heads * d, h), "self_attn.k_proj": (ARCH.num_kv_heads * d, h),
              "self_attn.v_proj": (ARCH.num_kv_heads * d, h), "self_attn.o_proj": (h, ARCH.num_heads * d),
              "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h), "mlp.down_proj": (h, inter)}  # fmt: skip
    return {
        f"model.layers.{layer}.{k}": torch.randn(s, generator=gen) * 0.2 for k, s in shapes.items()
    }


def _folders(tmp_path, drop: str | None = None):
    """An AWQ folder and a plain float32 folder with the AWQ weights dequantized."""
    gen = torch.Generator().manual_seed(9)
    common = {"model.embed_tokens.weight": torch.randn(ARCH.vocab_size, ARCH.hidden_size, generator=gen),
              "model.norm.weight": torch.rand(ARCH.hidden_size, generator=gen) + 0.5}  # fmt: skip
    awq, plain = dict(common), dict(common)
    for i in range(ARCH.num_layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            common_norm = torch.rand(ARCH.hidden_size, generator=gen) + 0.5
            awq[f"model.layers.{i}.{norm}.weight"] = plain[f"model.layers.{i}.{norm}.weight"] = (
                common_norm
            )
        for name, w in _hf_linears(i).items():
            q = quantize_int4(w, 32)
            scales = q.scales.half()  # AutoAWQ stores fp16 scales: the engine sees these
            plain[f"{name}.weight"] = dequantize_int4(
                Int4Weight(q.qweight, scales.float(), q.zeros, 32)
            )
            awq[f"{name}.qweight"] = pack_awq_int32(q.qweight.t().contiguous())
            awq[f"{name}.qzeros"] = pack_awq_int32(q.zeros.t().contiguous())
            awq[f"{name}.scales"] = scales.t().contiguous()
    if drop:
        del awq[drop]
    cfg = {"model_type": "llama", "hidden_size": ARCH.hidden_size, "intermediate_size": ARCH.intermediate_size,
           "num_attention_heads": ARCH.num_heads, "num_key_value_heads": ARCH.num_kv_heads,
           "head_dim": ARCH.head_dim, "num_hidden_layers": ARCH.num_layers, "vocab_size": ARCH.vocab_size,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048,
           "tie_word_embeddings": True, "eos_token_id": 2}  # fmt: skip
    folders = []
    for name, tensors, extra in (
        ("awq", awq, {"quantization_config": AWQ_CONFIG}),
        ("plain", plain, {}),
    ):
        folder = tmp_path / name
        folder.mkdir()
        save_file(
            {k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors")
        )
        (folder / "config.json").write_text(json.dumps({**cfg, **extra}))
        folders.append(str(folder))
    return folders


ENGINE = {"dtype": "float32", "max_model_len": 256, "num_kv_blocks": 128}


PROMPTS = [[(13 * i + j) % 49152 for j in range(3 + 11 * i)] for i in range(8)]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _greedy(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_awq_greedy_equals_plain_torch_with_the_dequantized_weights(tmp_path):
    """The checkpoint as it is (--no-quantize-lm-head): int4 decoder linears, 16-bit LM head."""
    awq_dir, plain_dir = _folders(tmp_path)
    awq = LLM(model=awq_dir, quantization="awq", quantize_lm_head=False, **ENGINE)
    summary = awq.engine.runner.quant_summary
    assert summary.method == "awq" and summary.group_size == 32
    assert summary.linear_params == ARCH.num_layers * awq.engine.shape.layer_linear_params
    assert awq.engine.runner.model.lm_head is None  # still the tied embedding
    # The cost model's bytes per step: the int4 decoder linears plus the 16-bit (here float32)
    # LM head, which a step reads in full.
    shape = awq.engine.shape
    head_bytes = ARCH.vocab_size * ARCH.hidden_size * 4
    assert shape.weight_bytes == summary.linear_bytes + head_bytes + shape.norm_params * 4
    assert _greedy(awq) == _greedy(LLM(model=plain_dir, **ENGINE))


def test_awq_lm_head_gets_an_int4_round_to_nearest_copy(tmp_path):
    """By default the LM head AutoAWQ leaves 16-bit is quantized as `int4` would at the
    checkpoint's group size; greedy output equals the plain folder with that head dequantized
    (an untied float32 head), and the cost model reads 4-bit head bytes."""
    awq_dir, plain_dir = _folders(tmp_path)
    awq = LLM(model=awq_dir, quantization="awq", **ENGINE)
    model = awq.engine.runner.model
    head = model.lm_head
    assert isinstance(head, Int4Linear) and head.group_size == 32
    assert model.embed_tokens.weight.dtype == torch.float32  # the embedding stays as it was
    rtn = dequantize_int4(quantize_int4(model.embed_tokens.weight, 32))
    torch.testing.assert_close(head.dequantized_weight(), rtn, rtol=0, atol=1e-6)
    summary = awq.engine.runner.quant_summary
    layer_params = ARCH.num_layers * awq.engine.shape.layer_linear_params
    assert summary.linear_params == layer_params + ARCH.vocab_size * ARCH.hidden_size
    shape = awq.engine.shape
    assert shape.weight_bytes == summary.linear_bytes + shape.norm_params * 4
    plain = LLM(model=plain_dir, **ENGINE)
    dst = plain.engine.runner.model
    with torch.no_grad():
        twin_head = nn.Linear(ARCH.hidden_size, ARCH.vocab_size, bias=False)
        twin_head.weight.copy_(head.dequantized_weight())
        dst.lm_head = twin_head.requires_grad_(False)
    assert _greedy(awq) == _greedy(plain)


def test_bad_awq_inputs_are_clear_errors(tmp_path):
    awq_dir, plain_dir = _folders(tmp_path, drop="model.layers.1.mlp.up_proj.qzeros")
    with pytest.raises(ValueError, match=r"lacks tensor layers\.1\.mlp\.up_proj\.qzeros"):
        LLM(model=awq_dir, quantization="awq", **ENGINE)
    with pytest.raises(ValueError, match="needs an AutoAWQ checkpoint"):
        LLM(model=plain_dir, quantization="awq", **ENGINE)
    with pytest.raises(ValueError, match="is an AutoAWQ checkpoint; load it with"):
        LLM(model=awq_dir, **ENGINE)
