"""`tests/console_lines.py`, the reader of a run's captured console that the end-to-end tests use:
bars, Ray's worker prefixes and colours, log lines glued to a bar, and the libraries' noise."""
import pytest

from tests.console_lines import noise_kinds, noise_lines, non_progress_lines, progress_lines, segments

pytestmark = pytest.mark.unit
ESC = "\x1b"
WORKER = f"{ESC}[36m(RolloutWorkhorse pid=3173){ESC}[0m "
TRAINER = f"{ESC}[36m(TrainWorkhorse pid=7243){ESC}[0m "

# Captured stdout + stderr of a run before the console work (issue 17), shortened.
BEFORE = (
    "[2026-11-24 04:07:06,803] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU. "
    "If you have GPU or other accelerator, we were unable to detect it.\n"
    "eval_before=0.0000 eval_after=0.0000\n"
    "\rWriting model shards:   0%|          | 0/1 [00:00<?, ?it/s]"
    "\rWriting model shards: 100%|██████████| 1/1 [00:00<00:00, 371.67it/s]\n"
    "2026-11-24 04:06:13,307 INFO xray.wholemodel.cluster: starting a local Ray cluster on 127.0.0.1 with 16 CPU slots\n"
    "Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out. For more "
    "information, see https://docs.ray.io/en/latest/ray-security/token-auth.html\n"
    "\rsft:   0%|          | 0/10 [00:00<?, ?step/s]\rsft: 100%|██████████| 10/10 [00:00<00:00, 16.64step/s, loss=2.476]\n"
    f"{WORKER}Triton is installed, but doesn't include CPU backend. Disabling Triton.\n"
    f"{WORKER}[W1124 04:06:42.653110902 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy for memory "
    "allocation on the NUMA nodes (0). (function init_cpu_memory_env)\n"
    f"{WORKER}\n\rLoading safetensors checkpoint shards:   0% Completed | 0/1 [00:00<?, ?it/s]\n"
    f"{WORKER}\n\rLoading safetensors checkpoint shards: 100% Completed | 1/1 [00:00<00:00, 199.13it/s]\n"
    f"{TRAINER}DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully{ESC}[32m [repeated 2x across "
    f"cluster] (Ray deduplicates logs by default. Set RAY_DEDUP_LOGS=0 to disable log deduplication){ESC}[0m\n"
    "2026-11-24 04:06:50,104 INFO xray.run.loop: eval before training: 0.000\n"
    "\rppo (sync):   0%|          | 0/3 [00:00<?, ?step/s]2026-11-24 04:06:50,414 INFO xray.run.checkpoints: "
    "checkpoint complete: /tmp/run/checkpoints/step-000000 (written in 0.3 s)\n"
    "\rppo (sync): 100%|██████████| 3/3 [00:00<00:00,  3.17step/s, reward=0.000, kl=0.0355, s_per_step=0.3]\n"
)
# The same run after it (tqdm's logging redirect, the bar's figures, no noise).
AFTER = (
    "eval_before=0.0000 eval_after=0.0000\n"
    "2026-11-24 04:22:33,793 INFO xray.wholemodel.cluster: starting a local Ray cluster on 127.0.0.1 with 16 CPU slots\n"
    "\rsft:   0%|          | 0/10 [00:00<?, ?step/s]\rsft: 100%|██████████| 10/10 [00:00<00:00, 16.00step/s, loss=2.476]\n"
    "2026-11-24 04:23:12,893 INFO xray.run.loop: eval before training: 0.000\n"
    "\rppo (sync):   0%|          | 0/3 [00:00<?, ?step/s]\r                                                   \r"
    "2026-11-24 04:23:13,141 INFO xray.run.checkpoints: checkpoint complete: /tmp/run/step-000000 (written in 0.2 s)\n"
    "\rppo (sync):   0%|          | 0/3 [00:00<?, ?step/s]\rppo (sync): 100%|██████████| 3/3 [00:00<00:00,  3.65step/s, "
    "reward 0.000 | eval 0.000 | kl 0.0355 | 133 samples/s | 0.24 s/step | sync ok 4.8e-07]\n"
    "\rsample: 7prompt [00:02,  3.10prompt/s]\n"
)


def test_before_every_noise_is_found_and_bars_are_not_lines():
    assert noise_kinds(BEFORE) == ["deepspeed-accelerator", "deepspeed-shm-op", "ray-token-auth", "ray-dedup-banner",
                                   "vllm-triton", "vllm-numa", "loading-bar"]
    assert len(noise_lines(BEFORE)) == 9  # the shm-op line carries the dedup banner: one line, two kinds
    lines = non_progress_lines(BEFORE)
    assert len(lines) == 9
    assert lines[0].startswith("[2026-11-24 04:07:06,803] [WARNING]")
    assert "checkpoint complete" in lines[-1] and lines[-1].startswith("2026-11-24 04:06:50,414 INFO")  # glued to a bar
    assert "Triton is installed, but doesn't include CPU backend. Disabling Triton." in lines  # Ray prefix and colour gone
    assert not any("Loading safetensors" in line or "%|" in line for line in lines)
    assert len(progress_lines(BEFORE)) == 8


def test_after_only_xray_lines_remain():
    assert noise_lines(AFTER) == [] and noise_kinds(AFTER) == []
    assert non_progress_lines(AFTER) == [
        "eval_before=0.0000 eval_after=0.0000",
        "2026-11-24 04:22:33,793 INFO xray.wholemodel.cluster: starting a local Ray cluster on 127.0.0.1 with 16 CPU slots",
        "2026-11-24 04:23:12,893 INFO xray.run.loop: eval before training: 0.000",
        "2026-11-24 04:23:13,141 INFO xray.run.checkpoints: checkpoint complete: /tmp/run/step-000000 (written in 0.2 s)"]
    bars = progress_lines(AFTER)
    assert len(bars) == 6 and bars[-1] == "sample: 7prompt [00:02,  3.10prompt/s]"
    assert bars[-2].endswith("| sync ok 4.8e-07]")


def test_segments_split_at_returns_and_drop_blank_and_prefix_only_pieces():
    assert segments(f"a\r\rb\n{WORKER}\n   \nc\r\n") == ["a", "b", "c"]
    assert segments("(raylet) warning: x\n(pid=12) y\n(RolloutWorkhorse pid=1, ip=127.0.0.1) z") == \
        ["warning: x", "y", "z"]


def test_a_bracketed_log_line_is_not_a_bar():
    line = "[2026-11-24 04:07:06,803] [WARNING] [real_accelerator.py:213:get_accelerator] 12:30 [00:01, x]"
    assert non_progress_lines(line) == [line] and progress_lines(line) == []
