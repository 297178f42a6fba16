"""LoRA settings: the names they resolve to, their errors, and the adapter shared helpers."""
from __future__ import annotations

import pytest
import torch

from xray.backends.lora import initial_a, load_adapter, merge, save_adapter
from xray.backends.vllm_adapter import AdapterError, engine_kwargs, is_adapter_tensor
from xray.config.lora import ALL_LINEAR, LoraConfig, LoraConfigError, adapted_weights, peft_names
from xray.config.overrides import apply_overrides, parse_overrides
from xray.config.schema import RunConfig
from xray.config.typed import ConfigError, build


def test_targets_and_scaling():
    assert LoraConfig().targets() == ALL_LINEAR
    assert LoraConfig(target_modules=("v_proj", "q_proj")).targets() == ("q_proj", "v_proj")  # model order
    assert LoraConfig(rank=8, alpha=32).scaling == 4.0
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.bias",
             "model.layers.0.mlp.down_proj.weight", "model.embed_tokens.weight", "lm_head.weight"]
    assert adapted_weights(names, LoraConfig(target_modules=("q_proj",))) == names[:1]
    assert adapted_weights(names, LoraConfig()) == [names[0], names[2]]


@pytest.mark.parametrize("kwargs, match", [(dict(rank=0), "rank"), (dict(alpha=0), "alpha"),
                                           (dict(dropout=1.0), "dropout"),
                                           (dict(target_modules=("lm_head",)), "lm_head"),
                                           (dict(target_modules=()), "empty")])
def test_bad_settings_say_the_fix(kwargs, match):
    with pytest.raises(LoraConfigError, match=match):
        LoraConfig(**kwargs)


def test_yaml_and_overrides_build_it():
    cfg = build(RunConfig, {"actor": {"lora": {"rank": 4, "target_modules": ["q_proj", "v_proj"]}}})
    assert cfg.actor.lora == LoraConfig(rank=4, target_modules=("q_proj", "v_proj"))
    assert build(RunConfig, {"actor": {"lora": {"target_modules": "all-linear"}}}).actor.lora.targets() == ALL_LINEAR
    tree = apply_overrides({}, parse_overrides(["--actor.lora.rank=16", "--actor.lora.alpha=16"]))
    assert build(RunConfig, tree).actor.lora == LoraConfig(rank=16, alpha=16.0)
    with pytest.raises((ConfigError, LoraConfigError), match="target_modules"):
        build(RunConfig, {"actor": {"lora": {"target_modules": "everything"}}})


def test_peft_names_and_directory(tmp_path):
    a, b = peft_names("model.layers.3.mlp.up_proj.weight")
    assert (a, b) == ("base_model.model.model.layers.3.mlp.up_proj.lora_A.weight",
                      "base_model.model.model.layers.3.mlp.up_proj.lora_B.weight")
    assert is_adapter_tensor(a) and not is_adapter_tensor("model.layers.3.mlp.up_proj.weight")
    tensors = {a: torch.ones(4, 8), b: torch.zeros(16, 4)}
    save_adapter(tmp_path, tensors, LoraConfig(rank=4, alpha=8), "base")
    loaded, config = load_adapter(tmp_path)
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["base_model_name_or_path"] == "base"
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())


def test_initial_adapter_is_seeded_and_kaiming_bounded():
    a = initial_a("model.layers.0.self_attn.q_proj.weight", 64, 8, seed=1)
    assert torch.equal(a, initial_a("model.layers.0.self_attn.q_proj.weight", 64, 8, seed=1))
    assert not torch.equal(a, initial_a("model.layers.0.self_attn.k_proj.weight", 64, 8, seed=1))
    assert not torch.equal(a, initial_a("model.layers.0.self_attn.q_proj.weight", 64, 8, seed=2))
    assert a.shape == (8, 64) and float(a.abs().max()) <= 1 / 8 and float(a.abs().max()) > 0.1
    w, b = torch.randn(16, 64), torch.randn(16, 8)
    assert torch.allclose(merge(w, a, b, 2.0), w + 2.0 * b @ a)


def test_vllm_rank_rounds_up_to_an_allowed_one():
    assert engine_kwargs(LoraConfig(rank=4))["max_lora_rank"] == 8
    assert engine_kwargs(LoraConfig(rank=16))["max_lora_rank"] == 16
    with pytest.raises(AdapterError, match="lower it"):
        engine_kwargs(LoraConfig(rank=600))
