"""`benchmarks/gpu_grpo.py`'s pieces that need no Ray and no GPU: its reward, its FLOP count (against
the parameters of the Hugging Face model it builds), its tokenizer, and its xray config at the GPU
size (Qwen3-0.6B's shape, 64 prompts x 8 samples), planned as `python -m xray.train grpo` plans it.
The whole script runs at a tiny size on the CPU with `--cpu-dry-run` (by hand: about 90 s)."""
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))  # as when it runs as a script: its sibling benchmarks import
    try:
        spec = importlib.util.spec_from_file_location("gpu_grpo_under_test", ROOT / "benchmarks/gpu_grpo.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_reward_is_the_share_of_even_word_ids(bench):
    assert bench.even_words(["w2 w3 w4 w10", "w7", "", "no words"]) == [0.75, 0.0, 0.0, 0.0]


def test_flops_count_every_matmul_parameter_of_the_built_model(bench):
    from transformers import AutoModelForCausalLM

    from xray.builtin.tiny_llama import hf_config

    spec = bench.DRY_SPEC
    model = AutoModelForCausalLM.from_config(hf_config(spec))
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))  # lm_head too (tied)
    q_width = spec.num_heads * spec.head_dim
    assert q_width != spec.hidden_size  # Qwen3's trait, kept in small
    one = bench.train_flops(spec, [1.0])
    assert one == 6 * linear + 12 * spec.num_layers * q_width
    lengths = [300.0, 500.0]
    assert bench.train_flops(spec, lengths) == 6 * linear * 800 + 12 * spec.num_layers * q_width * (300**2 + 500**2)
    big = bench.QWEN3_0_6B  # 440M in the layers + the 155.6M tied embedding / output layer
    layers = big.num_layers * (1024 * (2048 + 2 * 1024) + 2048 * 1024 + 3 * 1024 * 3072)
    assert (bench.train_flops(big, [1.0]) - 12 * 28 * 2048) / 6 == layers + 151936 * 1024 == 595_984_384


def test_word_tokenizer_round_trips_ids(bench, tmp_path):
    from transformers import AutoTokenizer

    bench.save_word_tokenizer(tmp_path, 64)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert tok("w5 w63 w3").input_ids == [5, 63, 3]
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.decode([5, 63, 2], skip_special_tokens=True) == "w5 w63"


@pytest.mark.parametrize("dry", [False, True])
def test_config_plans_at_both_sizes(bench, tmp_path, dry):
    from xray.train import resolve

    job, _ = bench.parse_job(["--cpu-dry-run"] if dry else [])
    assert (job.spec, job.prompts, job.samples, job.device) == \
        ((bench.DRY_SPEC, 2, 2, "cpu") if dry else (bench.QWEN3_0_6B, 64, 8, "cuda"))
    rows = bench.write_prompts(tmp_path / "p.jsonl", job, 4 * job.prompts + 2)
    lengths = [len(r["prompt"].split()) for r in rows]
    assert job.prompt_tokens[0] <= min(lengths) and max(lengths) < job.prompt_tokens[1]
    config = bench.xray_config(job, tmp_path / "model", tmp_path / "p.jsonl", 2, tmp_path / "cfg")
    _, cfg, plan, _, _ = resolve(["grpo", "--backend", "megatron-vllm", "--config", str(config)])
    assert (cfg.ppo.rollout_batch_size, cfg.rollout.n_samples) == (job.prompts, job.samples)
    assert cfg.ppo.mini_batch_size == job.completions and cfg.ppo.kl_coef == bench.KL_COEF
    assert cfg.rollout.max_new_tokens == job.response_tokens and not cfg.actor.activation_checkpointing
    assert {r.role for r in plan.roles} == {"actor", "reference", "rollout"}
    assert plan.shares_devices("actor", "rollout")
    assert plan.rollout_sleep is (not dry)  # vLLM sleeps beside the actor on a GPU; CPU vLLM has no sleep mode
