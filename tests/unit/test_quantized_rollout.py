"""Quantized experience makers (`rollout.quantization`) without vLLM: the reference per-channel fp8
quantization, the held check built on it, the sync's judgement, the plan's refusals, and the policy
loss's behaviour weight and gap metric."""
from pathlib import Path

import pytest
import torch

from xray.sync.end_to_end import rollout_gap
from xray.backends.held import HeldCheck
from xray.backends.quantize import FP8, fp8_difference, fp8_per_channel
from xray.config import ConfigError, load_config
from xray.config.engines import engine
from xray.config.plan import plan_run
from xray.config.schema import SyncConfig
from xray.data import columns as C
from xray.sync import WeightSyncError
from xray.sync.end_to_end import GapBound
from xray.sync.weights import check_exact, probe_bound
from algorithms.specs import command_spec

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
TINY, GPU_1X = str(ROOT / "configs/ppo_tiny_cpu.yaml"), str(ROOT / "configs/ppo_gpu_1x.yaml")
FP8_BF16 = ["--rollout.quantization=fp8", "--rollout.dtype=bfloat16"]


def test_fp8_per_channel_scales_each_row_to_448():
    w = torch.tensor([[1.0, -2.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]])
    codes, scale = fp8_per_channel(w, torch.bfloat16)
    assert codes.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (2, 1)
    assert float(scale[0, 0]) == pytest.approx(2.0 / 448) and float(scale[1, 0]) == pytest.approx(1 / (448 * 512))
    assert codes[0].float().tolist() == [224.0, -448.0, 112.0, 0.0] and codes[1].float().abs().sum() == 0


def test_fp8_per_channel_round_trip_is_within_half_an_fp8_step():
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    codes, scale = fp8_per_channel(w, torch.float32)
    error = (codes.float() * scale - w).abs() / w.abs().clamp_min(1e-3)
    assert float(error[w.abs() > 0.1].max()) <= 2 ** -4  # e4m3: 3 mantissa bits, half a step 1/16


def test_fp8_difference_counts_codes_and_scales():
    w = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    codes, scale = fp8_per_channel(w, torch.bfloat16)
    assert fp8_difference(codes, scale, codes.clone(), scale.clone()) is None
    other = codes.clone().view(torch.uint8)
    other[3, 5] += 1
    assert fp8_difference(codes, scale, other.view(FP8), scale).startswith("fp8: 1/128 codes and 0/8 scales")


def test_held_check_compares_fp8_codes_laid_out_as_vllm_keeps_them():
    w = torch.randn(12, 20, generator=torch.Generator().manual_seed(2))
    codes, scale = fp8_per_channel(w, torch.bfloat16)
    check = HeldCheck()
    assert check.compare_fp8("a.weight", codes.t(), scale, w, torch.bfloat16)  # held as [K, N], scales [N, 1]
    assert check.compare_fp8("b.weight", codes.t(), scale, w + 0.05, torch.bfloat16)  # the engine holds something else
    # another layout (a tensor-parallel shard), or no scale: left to the functional check
    assert not check.compare_fp8("c.weight", codes.t()[:, :6], scale[:6], w, torch.bfloat16)
    assert not check.compare_fp8("d.weight", codes.t(), None, w, torch.bfloat16)
    report = check.take()
    assert report["exact"] == 1 and report["functional"] == report["unchecked"] == 0, report
    assert len(report["mismatched"]) == 1 and report["mismatched"][0].startswith("b.weight [fp8: "), report


def test_a_quantized_mismatch_fails_the_sync_naming_the_tensor():
    names = [f"x{i}.weight" for i in range(14)]
    replica = {"held": {"exact": 14, "unchecked": 0, "mismatched": ["x.down_proj.weight [fp8: 3/64 codes]"],
                        "checked": names}, "holds": names, "dtype": "bfloat16", "quantization": "fp8"}
    with pytest.raises(WeightSyncError, match=r"version 4 failed verification.*x\.down_proj\.weight \[fp8"):
        check_exact(4, [replica])
    replica["held"]["mismatched"] = []
    totals = check_exact(4, [replica])
    assert totals["quantized"] is True and (totals["exact"], totals["unchecked"], totals["holds"]) == (14, 0, 14)
    replica["held"]["unchecked"] = 1  # a tensor neither read back nor checked functionally fails the sync
    with pytest.raises(WeightSyncError, match="1 engine tensor.s. could be neither read back nor checked"):
        check_exact(4, [replica])
    cfg = SyncConfig()
    assert probe_bound(cfg, ["bfloat16"], quantized=True) == GapBound("mean", 0.6)
    assert probe_bound(cfg, ["bfloat16", "float32"]) == GapBound("mean", cfg.bf16_mean_tolerance) == GapBound("mean", 0.15)
    assert probe_bound(cfg, ["float32"]) == GapBound("max", 1e-3)


def test_schemes_per_device_and_what_is_refused():
    vllm = engine("vllm")
    assert vllm.scheme("none", "cpu") is None
    assert vllm.scheme("fp8", "cpu") == "fp8_per_channel" and vllm.scheme("fp8", "cuda") == "fp8_per_tensor"
    assert vllm.offered("cpu") == ("none", "fp8")
    with pytest.raises(ValueError, match="int8 is unsupported on cpu.*NaN.*this device offers: none, fp8"):
        vllm.scheme("int8", "cpu")
    with pytest.raises(ValueError, match="fp8 is unsupported on cpu.*this device offers: none$"):
        engine("dsinfer").scheme("fp8", "cpu")


def _plan(*argv: str, config: str = TINY, backend: str = "megatron-vllm"):
    return plan_run(load_config(config, list(argv)), backend, command_spec("ppo"))


def test_plan_takes_fp8_on_a_bf16_vllm_rollout_and_says_so():
    plan = _plan(*FP8_BF16)
    assert plan.rollout_quantization == "fp8_per_channel"
    assert "rollout quantization: vLLM fp8_per_channel" in plan.describe()
    assert _plan().rollout_quantization is None and "quantization" not in _plan().describe()
    # on GPU vLLM quantizes per tensor, which the held check cannot read back: only unverified
    plan = _plan("--rollout.quantization=fp8", "--sync.verify=false", config=GPU_1X)  # bf16 model
    assert plan.rollout_quantization == "fp8_per_tensor"


@pytest.mark.parametrize("argv, backend, needle", [
    (["--rollout.quantization=fp8"], "megatron-vllm", "set --rollout.dtype=bfloat16"),
    (["--rollout.quantization=int8", "--rollout.dtype=bfloat16"], "megatron-vllm", "this device offers: none, fp8"),
    (FP8_BF16, "deepspeed-dsinfer", "only the vLLM rollout quantizes, this run's is dsinfer"),
    ([*FP8_BF16, "--actor.lora={rank: 4}"], "megatron-vllm", "train without actor.lora"),
    (["--rollout.quantization=fp8", f"--config={GPU_1X}"], "megatron-vllm",
     "quantizes with fp8_per_tensor, whose weights the verified sync cannot read back code for code .* "
     "set rollout.quantization=none, or --sync.verify=false"),
])
def test_plan_refuses_what_is_unsupported_with_the_fix(argv, backend, needle):
    config = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), TINY)
    with pytest.raises(ConfigError, match=needle):
        _plan(*[a for a in argv if not a.startswith("--config=")], config=config, backend=backend)


def test_a_quantized_rollout_turns_on_the_truncated_behaviour_weight():
    cfg = load_config(TINY, FP8_BF16)
    loss = actor_loss(cfg)
    assert loss.behaviour_weight_cap == cfg.async_.behaviour_weight_cap and C.BEHAVIOUR_LOGPROBS in loss.reads
    assert actor_loss(load_config(TINY)).behaviour_weight_cap is None


def actor_loss(cfg):
    """The actor's loss the run builds for `cfg` (`RLTrainer`'s facts, without starting models)."""
    from xray.run.algorithm import LossFacts

    off_policy = cfg.trainer.mode == "async" or cfg.rollout.quantization != "none"
    facts = LossFacts(cfg.async_.behaviour_weight_cap if off_policy else None)
    return command_spec("ppo").algorithm(cfg).losses(facts)["actor"]


def test_rollout_gap_is_over_response_tokens_only():
    old = torch.tensor([[0.0, -1.0, -2.0], [-0.5, -0.5, 9.0]])
    behaviour = torch.tensor([[0.0, -1.5, -1.0], [-0.25, -0.5, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    gap = rollout_gap(old, behaviour, mask)
    assert gap == {"rollout_logprob_gap_mean": pytest.approx(1.75 / 4), "rollout_logprob_gap_max": 1.0}
    assert rollout_gap(old, behaviour, torch.zeros_like(mask))["rollout_logprob_gap_max"] == 0.0
