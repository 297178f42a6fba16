"""Hugging Face exports keep every side file of the source model, and a Megatron step checkpoint
exports from its files alone (`python -m xray.export`).

The side files: the real SmolLM2 directory's exported tokenizer renders a chat prompt to the same
ids as the source's, its chat template byte for byte; of a directory holding every kind of file,
exactly the non-weight ones are carried over. The checkpoint: a tiny Llama's weights are cut into
the shards of a tp=2 x pp=2 x dp=2 Megatron checkpoint (the engine's own `convert.to_shard`,
one file per rank, as `MegatronEngine.save` writes them) inside a run directory; the export gives
the source's tensors back bit for bit, with its config and tokenizer, loadable by transformers;
a LoRA checkpoint's adapters come back as a `peft` directory. (DeepSpeed's reader and the engines'
own files are checked against the run's `final/actor` in tests/e2e/test_ppo_e2e.py.)
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

pytestmark = pytest.mark.unit


def test_export_keeps_the_tokenizer_and_chat_template_of_a_real_model(smollm2, tmp_path):
    from transformers import AutoTokenizer

    from xray.backends.hf_dir import save_hf_model

    source = Path(smollm2)
    out = save_hf_model({"w": torch.ones(2)}, source, tmp_path / "out")
    for name in ("chat_template.jinja", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                 "config.json"):
        assert (out / name).read_bytes() == (source / name).read_bytes(), name
    chat = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 12+7?"}]
    tokenizers = [AutoTokenizer.from_pretrained(d) for d in (source, out)]
    ids = [t.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"] for t in tokenizers]
    assert ids[0] == ids[1] and len(ids[0]) > 20
    text = tokenizers[1].apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n") and "What is 12+7?" in text
    from safetensors.torch import load_file
    assert list(load_file(str(out / "model.safetensors"))) == ["w"]  # the export's weights, not the source's


def test_side_files_are_every_file_but_the_weights(tmp_path):
    from xray.backends.hf_dir import save_hf_model, side_files

    source = tmp_path / "src"
    (source / "nested").mkdir(parents=True)
    weights = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
               "pytorch_model.bin", "pytorch_model.bin.index.json", "consolidated.pth"]
    kept = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
            "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt",
            "preprocessor_config.json", "README.md"]
    for i, name in enumerate(weights + kept + [".gitattributes", "nested/extra.json"]):
        (source / name).write_text(f"file {i}")
    assert [p.name for p in side_files(source)] == sorted(kept)
    out = save_hf_model({"w": torch.zeros(1)}, source, tmp_path / "out")
    assert sorted(p.name for p in out.iterdir()) == sorted(kept + ["model.safetensors"])
    assert all((out / n).read_text() == (source / n).read_text() for n in kept)


def _megatron_checkpoint(step_dir: Path, model_dir: Path, tp: int, pp: int, dp: int, lora=None, adapters=None):
    """Write `model_dir`'s weights (or the `adapters`, peft names) as the rank files of a Megatron
    checkpoint of layout tp x pp x dp, with the engine's own shard layout and header."""
    from safetensors.torch import load_file

    from xray.backends.megatron.checkpoint import header_of, save_shard
    from xray.backends.megatron.convert import stage_entries, to_shard
    from xray.backends.megatron.lora import checkpoint_header, trained_entries
    from xray.backends.megatron.spec import read_spec
    from xray.config.parallel import ParallelDims

    spec, parallel = read_spec(model_dir), ParallelDims(tp=tp, pp=pp, dp=dp)
    full = adapters if lora is not None else load_file(str(model_dir / "model.safetensors"))
    header = header_of(spec, parallel, "actor", None if lora is None else checkpoint_header(lora))
    for rank in range(parallel.world_size):
        c = parallel.coords(rank)
        entries = (stage_entries(spec, c.pp_rank, pp) if lora is None
                   else trained_entries(spec, lora, c.pp_rank, pp, False))
        model = {e.megatron_name: to_shard(e, [full[n] for n in e.hf_names], spec, c.tp_rank, tp) for e in entries}
        save_shard(step_dir / "actor", rank, header, {"model": model, "step": 7, "rng": {}})
    (step_dir / "trainer_state.json").write_text(json.dumps({"step": 7, "model_dir": str(model_dir)}))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from xray.builtin.tiny_llama import TinySpec, build_tiny_model
    from xray.data.tokenizer import save_char_tokenizer

    directory = build_tiny_model(tmp_path_factory.mktemp("export") / "tiny", TinySpec(num_layers=2), seed=4)
    save_char_tokenizer(directory)
    return directory


def test_a_megatron_checkpoint_of_any_layout_exports_its_weights_bit_for_bit(tiny_llama, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from xray.export import main

    step = tmp_path / "run/checkpoints/step-000007"
    _megatron_checkpoint(step, tiny_llama, tp=2, pp=2, dp=2)
    (tmp_path / "run/config.yaml").write_text(yaml.safe_dump({"model": {"path": "builtin:tiny-llama"}}))
    assert main([str(step), str(tmp_path / "out")]) == 0
    source, exported = (load_file(str(d / "model.safetensors")) for d in (tiny_llama, tmp_path / "out"))
    assert sorted(exported) == sorted(source) and len(source) == 21
    assert all(torch.equal(exported[k], source[k]) and exported[k].dtype == source[k].dtype for k in source)
    assert {p.name for p in (tmp_path / "out").iterdir()} == {p.name for p in tiny_llama.iterdir()}
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    logits = model(torch.tensor([[3, 5, 7]])).logits
    assert logits.shape == (1, 3, 256) and torch.isfinite(logits).all()


def test_a_lora_checkpoint_exports_its_adapters_as_a_peft_directory(tiny_llama, tmp_path):
    from xray.backends.lora import load_adapter
    from xray.config.lora import LoraConfig, peft_names
    from xray.run.export import export_checkpoint

    lora = LoraConfig(rank=4, alpha=16.0, target_modules=("q_proj", "down_proj"))
    g = torch.Generator().manual_seed(0)
    adapters = {}
    for layer in range(2):
        for module, (out_f, in_f) in (("self_attn.q_proj", (128, 128)), ("mlp.down_proj", (128, 256))):
            a, b = peft_names(f"model.layers.{layer}.{module}.weight")
            adapters[a], adapters[b] = torch.randn(4, in_f, generator=g), torch.randn(out_f, 4, generator=g)
    step = tmp_path / "run/checkpoints/step-000007"
    _megatron_checkpoint(step, tiny_llama, tp=2, pp=1, dp=1, lora=lora, adapters=adapters)
    (tmp_path / "run/config.yaml").write_text(yaml.safe_dump(
        {"model": {"path": str(tiny_llama)}, "actor": {"lora": {"rank": 4, "alpha": 16.0,
                                                                 "target_modules": ["q_proj", "down_proj"]}}}))
    out = export_checkpoint(step, tmp_path / "adapter")
    tensors, config = load_adapter(out)
    assert sorted(tensors) == sorted(adapters) and all(torch.equal(tensors[k], adapters[k]) for k in adapters)
    assert config["r"] == 4 and config["lora_alpha"] == 16.0 and config["target_modules"] == ["q_proj", "down_proj"]
    assert config["base_model_name_or_path"] == str(tiny_llama)


def test_export_mistakes_say_the_fix(tiny_llama, tmp_path, capsys):
    from xray.export import main

    step = tmp_path / "run/checkpoints/step-000007"
    _megatron_checkpoint(step, tiny_llama, tp=1, pp=1, dp=1)
    assert main([str(step.parent), str(tmp_path / "out")]) == 2
    assert "is not a complete checkpoint (no trainer_state.json)" in capsys.readouterr().err
    assert main([str(step), str(tmp_path / "out"), "--role", "critic"]) == 2
    assert "holds no 'critic' checkpoint; choose --role among ['actor']" in capsys.readouterr().err
    (step / "trainer_state.json").write_text(json.dumps({"step": 7, "model_dir": str(tmp_path / "gone")}))
    assert main([str(step), str(tmp_path / "out")]) == 2
    assert "pass it with --model-dir DIR" in capsys.readouterr().err
    assert main([str(step), str(tmp_path / "out"), "--model-dir", str(tiny_llama)]) == 0
    assert (tmp_path / "out/model.safetensors").is_file() and capsys.readouterr().out.strip() == str(tmp_path / "out")
