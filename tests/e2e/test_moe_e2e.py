"""A mixture of experts end to end: `python -m xray.train grpo` on a tiny Qwen3-MoE (2 layers of 4
experts, 2 per token, over the character tokenizer) for 3 steps, on deepspeed-vllm, megatron-vllm and
megatron-dsinfer, each with another registered policy loss (`--ppo.policy_loss`): GSPO's sequence
ratio on deepspeed-vllm, CISPO's clipped, stop-gradient importance weight on megatron-vllm, the PPO
clip on megatron-dsinfer; every step verified.

The actor and reference train and score at dp=2 (DeepSpeed ZeRO-3, or Megatron at tp=1 with the
experts split over the two replicas, ep=2: each holds 2 of a layer's 4, and the export gathers them),
whose exports name the experts fused (DeepSpeed, as transformers 5 holds them) or one by one
(Megatron, as transformers 5 saves them); the actor adds the router's load-balancing loss
(`actor.moe`, each engine's own: Hugging Face's on DeepSpeed, Megatron's per-layer one), logged
each step as `actor/router_aux_loss`. On megatron-dsinfer the rollout reports the experts it chose
and the actor's forwards replay them (`actor.moe.routing_replay`), Megatron's export (one tensor per
expert) written into DeepSpeed-Inference's fused experts. On the vLLM pairs the rollout
generates on vLLM, and every step's sync reloads each MoE block in place (its experts' kernel
packed again) and checks it by its forward: nothing unchecked, the probe within the fp32 bound.
The exported `final/actor` loads in transformers and in vLLM, whose log-probs of sequences equal
transformers' within 1e-5.
"""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.e2e.test_ppo_e2e import FP32_PROBE

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from xray.builtin.tiny_llama import TinySpec, build_tiny_model
    from xray.data.tokenizer import VOCAB_SIZE, save_char_tokenizer

    spec = TinySpec(arch="qwen3_moe", vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_heads=2,
                    num_kv_heads=2, max_position_embeddings=128, moe_intermediate_size=32)
    directory = build_tiny_model(tmp_path_factory.mktemp("moe") / "tiny", spec, seed=3)
    save_char_tokenizer(directory)
    return directory


POLICY_LOSS = {"deepspeed-vllm": "gspo", "megatron-vllm": "cispo", "megatron-dsinfer": "vanilla"}
"""The registered policy loss each pair's run trains with (`algorithms/policy_losses`)."""


@pytest.mark.parametrize("backend", ["deepspeed-vllm", "megatron-vllm", "megatron-dsinfer"])
def test_grpo_three_steps_on_qwen3_moe(tmp_path, tiny_moe, backend):
    run = tmp_path / "run"
    layout = ["--actor.zero_stage=3"] if backend.startswith("deepspeed") else ["--actor.ep=2", "--reference.ep=2"]
    if backend.endswith("dsinfer"):  # the rollout reports its routing, the actor's forwards replay it
        layout.append("--actor.moe.routing_replay=true")
    args = ["--backend", backend, "--config", str(ROOT / "configs/critic_free_tiny_cpu.yaml"),
            f"--model.path={tiny_moe}", "--device_groups.nproc_per_node=3", "--device_groups.train_group.ranks=[0, 1]",
            "--device_groups.rollout_group.ranks=[2]", "--actor.dp=2", *layout,
            "--actor.moe.load_balancing=aux_loss", "--actor.moe.aux_loss_coef=0.01",
            "--actor.micro_batch_size=4", "--reference.dp=2", "--reference.micro_batch_size=8",
            "--rollout.n_samples=2", "--rollout.max_new_tokens=4", "--ppo.rollout_batch_size=8",
            "--ppo.mini_batch_size=8", "--data.eval_size=8", "--trainer.steps=3", "--trainer.save_every=0",
            "--reward.function=tests.e2e.test_critic_free_e2e:digit_share", "--output-dir", str(run),
            f"--ppo.policy_loss={POLICY_LOSS[backend]}"]
    p = subprocess.run([sys.executable, "-m", "xray.train", "grpo", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stderr[-6000:]
    rows = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert sorted(rows) == [1, 2, 3]
    for step, row in rows.items():
        assert all(math.isfinite(v) for v in row.values() if isinstance(v, float)), row
        assert row["sync/version"] == step and row["sync/unchecked"] == 0, row
        # per layer: q/k/v and o by their products, the router and the experts' tensors (2 fused, or 3 for
        # each of 4 experts) by the block's forward; read back: the embedding, final norm, head, 4 norms a layer
        experts = 2 if backend.startswith("deepspeed") else 3 * 4
        if backend.endswith("dsinfer"):  # every tensor read back: per layer q/k/v/o, their 2 norms, 2 more,
            # the router and each expert's 3 as they arrive (into the module's fused experts)
            assert (row["sync/held_functional"], row["sync/held_exact"]) == (0, 3 + 2 * (4 + 2 + 2 + 1 + 12)), row
        else:
            assert (row["sync/held_functional"], row["sync/held_exact"]) == (2 * (2 + 1 + experts), 3 + 2 * 4), row
        assert row.get("sync/max_abs_logprob_diff", 0.0) <= FP32_PROBE, row
        assert row["rollout_logprob_gap_max"] <= FP32_PROBE, row  # the actor's forward (replaying, on dsinfer)
        assert 0.5 < row["actor/router_aux_loss"] < 2 * 2, row  # balanced: 2 (Megatron 1 a layer; HF top-k)
        assert math.isfinite(row["actor/policy_loss"]) and 0.0 <= row["actor/policy_clipfrac"] <= 1.0, row
    assert yaml.safe_load((run / "config.yaml").read_text())["ppo"]["policy_loss"] == POLICY_LOSS[backend]
    check_export(run / "final/actor")


def check_export(directory: Path) -> None:
    """The exported actor loads in transformers and vLLM, which agree on log-probs."""
    from tests.backends.rollout_common import hf_sequence_stats, max_abs_diff
    from xray.backends import load_backend
    from xray.check.reference import load_hf

    hf = load_hf(str(directory))
    assert hf.config.model_type == "qwen3_moe"
    engine = load_backend("vllm").build_engine(directory, dtype="float32", seed=0, max_model_len=128, kv_cache_gib=1)
    try:
        seqs = [[5, 9, 14, 20, 7, 3, 11, 30], [12, 4, 8, 16, 2, 40]]
        lens = [3, 2]
        assert max_abs_diff(engine.logprobs(seqs, lens), hf_sequence_stats(hf, seqs, lens)[0]) <= 1e-5
    finally:
        engine.shutdown()
