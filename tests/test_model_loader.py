"""Loading: random presets, and local HF folders of every supported family, checked against
transformers token for token on tiny random checkpoints (float32)."""

from __future__ import annotations

import pytest
import torch
import transformers

from engine import LLM, SamplingParams
from engine.runner.model_loader import resolve_model
from engine.runner.models.presets import MODEL_PRESETS

PROMPTS = [[5, 17, 42, 99, 3], [7] * 19, list(range(100, 140))]


def _tiny_config(cls, **overrides):
    fields = dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
    )  # fmt: skip
    return cls(**{**fields, **overrides})


FAMILIES = {
    "llama3-rope-scaling": lambda: _tiny_config(
        transformers.LlamaConfig,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "llama2": lambda: _tiny_config(transformers.LlamaConfig, num_key_value_heads=4),
    "qwen2-bias": lambda: _tiny_config(transformers.Qwen2Config),
    "mistral": lambda: _tiny_config(transformers.MistralConfig, sliding_window=None),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hf_folder_matches_transformers(family, tmp_path):
    torch.manual_seed(0)
    config = FAMILIES[family]()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # larger weights than the default init: peaky, decisive logits
        for name, p in model.named_parameters():
            if p.dim() > 1 or name.endswith(".bias"):
                p.normal_(0, 0.2)
    model.save_pretrained(tmp_path)
    expected = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
            expected.append(out[0, len(prompt) :].tolist())
    llm = LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=32, max_model_len=256)
    assert llm.tokenizer is None  # no tokenizer files: token-id prompts only
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected


def test_qwen2_bias_is_loaded(tmp_path):
    config = FAMILIES["qwen2-bias"]()
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    source = resolve_model(str(tmp_path))
    assert source.arch.attention_bias and source.arch.model_type == "qwen2"


@pytest.mark.parametrize("preset", ["smollm2-135m", "llama-2-7b", "llama-3-8b"])
def test_random_presets_have_known_shapes(preset):
    arch = resolve_model(f"random:{preset}").arch
    assert arch == MODEL_PRESETS[preset]
    expected_kv_heads = {"smollm2-135m": 3, "llama-2-7b": 32, "llama-3-8b": 8}[preset]
    assert arch.num_kv_heads == expected_kv_heads


def test_random_overrides():
    arch = resolve_model("random:smollm2-135m,num_layers=2").arch
    assert arch.num_layers == 2 and arch.hidden_size == 576
    with pytest.raises(ValueError, match="bad random-model override"):
        resolve_model("random:tiny,nonsense=3")


def test_embedded_model_is_converted_once(llm_f32):
    folder = llm_f32.engine.source.weights_dir
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("smollm2-135m").weights_dir == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    arch = llm_f32.engine.source.arch
    assert (arch.num_layers, arch.hidden_size, arch.num_heads, arch.num_kv_heads) == (30, 576, 9, 3)
    assert arch.tie_word_embeddings and arch.vocab_size == 49152
