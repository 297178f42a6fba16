"""The console of `python -m xray.train` (issue 17, item 1): the Workhorses' quiet start-up
(`xray.workhorse.quiet`), the driver's levels and flags (`xray.run.console`), and the one progress
line of an RL run (`xray.run.progress`). The patterns are checked against the installed libraries'
own sources, so a library that rewords its noise fails here rather than on a user's console."""
import importlib.util
import io
import logging
import math
import os
from pathlib import Path

import pytest

from xray.run import console
from xray.run.progress import StepProgress, progress_text, sync_text
from xray.workhorse import quiet

pytestmark = pytest.mark.unit


def library_source(package: str, relative: str) -> str:
    """A file of an installed package, read without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None:
        pytest.skip(f"{package} is not installed")
    return (Path(spec.submodule_search_locations[0]) / relative).read_text()


def test_workhorse_environment_per_device(monkeypatch):
    monkeypatch.delenv(quiet.LOG_LEVEL_ENV, raising=False)
    cpu, gpu = quiet.workhorse_env("CPU"), quiet.workhorse_env("gpu")
    assert cpu["DS_ACCELERATOR"] == "cpu" and cpu["TORCH_CPP_LOG_LEVEL"] == "ERROR"
    assert "DS_ACCELERATOR" not in gpu and "TORCH_CPP_LOG_LEVEL" not in gpu  # a GPU keeps DeepSpeed's detection
    for env in (cpu, gpu):
        assert env["TQDM_DISABLE"] == "1" and env["VLLM_LOGGING_LEVEL"] == "ERROR"
        assert env[quiet.IN_WORKHORSE_ENV] == "1" and quiet.LOG_LEVEL_ENV not in env
    monkeypatch.setenv(quiet.LOG_LEVEL_ENV, "DEBUG")  # `-v` in the driver
    assert quiet.workhorse_env("CPU")[quiet.LOG_LEVEL_ENV] == "DEBUG"


def test_drop_lines_drops_whole_matching_lines_only():
    out = io.StringIO()
    stream = quiet.DropLines(out, quiet.STDOUT_NOISE)
    print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully", file=stream)
    print("DeepSpeed says: a real message", file=stream)
    stream.write("partial ")
    stream.write("line\nno newline yet")
    assert out.getvalue() == "DeepSpeed says: a real message\npartial line\n"
    stream.flush()
    assert out.getvalue().endswith("no newline yet")


class Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def captured(logger_name: str, monkeypatch) -> Records:
    """A handler on `logger_name` itself, with the logger's filters restored after the test."""
    logger = logging.getLogger(logger_name)
    monkeypatch.setattr(logger, "filters", [])
    records = Records()
    monkeypatch.setattr(logger, "handlers", [*logger.handlers, records])  # the original list comes back
    return records


def test_install_filters_only_in_a_workhorse_process(monkeypatch):
    fake_stdout = io.StringIO()
    monkeypatch.setattr("sys.stdout", fake_stdout)
    records = captured("vllm.triton_utils.importing", monkeypatch)
    monkeypatch.delenv(quiet.IN_WORKHORSE_ENV, raising=False)
    quiet.install_filters()  # a Workhorse built as a plain class: nothing changes
    import sys

    assert sys.stdout is fake_stdout
    monkeypatch.setenv(quiet.IN_WORKHORSE_ENV, "1")
    quiet.install_filters()
    quiet.install_filters()  # once per process
    assert isinstance(sys.stdout, quiet.DropLines) and sys.stdout.stream is fake_stdout
    logger = logging.getLogger("vllm.triton_utils.importing")
    assert len(logger.filters) == 1
    logger.warning("Triton is installed, but doesn't include CPU backend. Disabling Triton.")
    logger.warning("Triton failed to compile kernel x")
    assert records.messages == ["Triton failed to compile kernel x"]


def test_driver_filters_drop_the_notices_and_keep_the_warnings(monkeypatch):
    ds = captured("DeepSpeed", monkeypatch)
    ray_auth = captured("ray._private.authentication.authentication_token_setup", monkeypatch)
    quiet.quiet_driver()
    logging.getLogger("DeepSpeed").warning("Setting accelerator to CPU. If you have GPU or other accelerator, "
                                           "we were unable to detect it.")
    logging.getLogger("DeepSpeed").warning("ZeRO stage 3 offload is slow")
    auth = logging.getLogger("ray._private.authentication.authentication_token_setup")
    auth.warning("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out.")
    auth.warning("Token authentication is disabled for this Ray cluster. Anyone with network access ...")
    assert ds.messages == ["ZeRO stage 3 offload is slow"]
    assert ray_auth.messages == ["Token authentication is disabled for this Ray cluster. Anyone with network access ..."]


@pytest.mark.parametrize("package, relative, source, message, pattern", [
    ("deepspeed", "accelerator/real_accelerator.py", '"Setting accelerator to CPU. If you have GPU or other accelerator',
     "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.",
     quiet.DRIVER_NOISE["DeepSpeed"]),
    ("deepspeed", "accelerator/real_accelerator.py", 'os.environ["DS_ACCELERATOR"]', None, None),
    ("deepspeed", "comm/torch.py", "print(f'DeepSpeed {builder.absolute_name()} built successfully')",
     "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully", quiet.STDOUT_NOISE),
    ("vllm", "triton_utils/importing.py", '"Triton is installed, but doesn\'t include CPU backend. "',
     "Triton is installed, but doesn't include CPU backend. Disabling Triton.",
     quiet.LOGGED_NOISE["vllm.triton_utils.importing"]),
    ("ray", "_private/authentication/authentication_token_setup.py",
     '"Token authentication is enabled for this Ray cluster. Set "',
     "Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out. For more "
     "information, see https://docs.ray.io/en/latest/ray-security/token-auth.html",
     quiet.DRIVER_NOISE["ray._private.authentication.authentication_token_setup"]),
])
def test_the_noise_is_where_the_filters_look(package, relative, source, message, pattern):
    assert source in library_source(package, relative), f"{package}/{relative} changed: re-check xray/workhorse/quiet.py"
    if pattern is not None:
        assert pattern.search(message)


def test_progress_text_shows_the_step_figures():
    metrics = {"reward/mean": 0.51234, "kl": 0.012345, "time/generate_s": 0.4, "time/train_s": 0.25,
               "sync/max_abs_logprob_diff": 2.4e-7}
    text = progress_text(metrics, 32, 0.43, sync_text(2.4e-7))
    assert text == "reward 0.512 | eval 0.430 | kl 0.0123 | 49 samples/s | 0.65 s/step | sync ok 2.4e-07"
    async_metrics = {"reward/mean": 0.5, "samples_per_s": 80.0, "async/staleness": 1.0}  # no phases: the wall clock
    assert progress_text(async_metrics, 32, None, None, wall_s=0.4) == \
        "reward 0.500 | kl 0.0000 | 80 samples/s | 0.40 s/step | staleness 1"
    assert progress_text({"reward/mean": 0.5}, 32, None, None, wall_s=0.5) == \
        "reward 0.500 | kl 0.0000 | 64 samples/s | 0.50 s/step"
    assert sync_text(float("nan")) == "unverified" and sync_text(None) is None


def test_step_progress_keeps_the_last_eval_and_sync(monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    step = {"reward/mean": 0.25, "time/train_s": 0.5}
    with StepProgress(range(1, 4), "ppo (sync)", 16, eval_before=0.125) as progress:
        progress.step({**step, "sync/max_abs_logprob_diff": 1e-7})
        assert progress.bar.postfix.endswith("eval 0.125 | kl 0.0000 | 32 samples/s | 0.50 s/step | sync ok 1.0e-07")
        progress.step({**step, "eval": 0.5})  # an async step without a sync: the last check stays
        assert "eval 0.500" in progress.bar.postfix and progress.bar.postfix.endswith("sync ok 1.0e-07")
        progress.step({**step, "sync/max_abs_logprob_diff": math.nan})
        assert progress.bar.n == 3 and progress.bar.postfix.endswith("sync unverified")
    monkeypatch.setenv("TQDM_DISABLE", "1")  # --quiet
    with StepProgress(range(1, 4), "ppo (sync)", 16) as progress:
        assert progress.bar.disable


@pytest.fixture
def restored_logging(monkeypatch):
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", list(root.handlers))
    monkeypatch.setattr(root, "level", root.level)
    for name in console.OWN_LOGGERS:
        monkeypatch.setattr(logging.getLogger(name), "level", logging.getLogger(name).level)
    for name in ("TQDM_DISABLE", quiet.LOG_LEVEL_ENV):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("level, own, libraries, bars, workhorses", [
    ("default", logging.INFO, logging.WARNING, True, None),
    ("quiet", logging.WARNING, logging.WARNING, False, None),
    ("verbose", logging.DEBUG, logging.INFO, True, "DEBUG"),
])
def test_console_levels(restored_logging, level, own, libraries, bars, workhorses):
    console.setup_console(level)
    assert logging.getLogger("xray").level == own and logging.getLogger("algorithms").level == own
    assert logging.getLogger().level == libraries
    assert console.progress_shown() is bars
    assert os.environ.get(quiet.LOG_LEVEL_ENV) == workhorses
    (handler,) = logging.getLogger().handlers
    assert handler.stream is __import__("sys").stderr  # stdout carries only the result line


def test_command_line_flags():
    from xray.train import parser

    args, extra = parser().parse_known_args(["ppo", "-v", "--ppo.kl_coef=0.1"])
    assert console.console_level(args) == "verbose" and extra == ["--ppo.kl_coef=0.1"]
    args, extra = parser().parse_known_args(["ppo", "--quiet"])
    assert console.console_level(args) == "quiet" and extra == []
    assert console.console_level(parser().parse_known_args(["ppo"])[0]) == "default"
    with pytest.raises(SystemExit) as stop:
        parser().parse_known_args(["ppo", "-v", "--quiet"])
    assert stop.value.code == 2


def test_a_bucket_reload_keeps_only_errors_of_vllms_layerwise_reloader_and_its_account_in_the_ledger(caplog):
    """vLLM warns about every layer a bucket's reload leaves untouched; during a reload only its
    errors pass, before and after everything does (a filter, not a level change). Its account of
    the parameters a reload did not write leaves the log for the ledger: over a sync's reloads, a
    parameter is missed only if every reload missed it."""
    from xray.backends.vllm_held import ReloadLedger

    ledger = ReloadLedger()
    noisy, account = logging.getLogger(ledger.LAYERWISE), logging.getLogger(ledger.ACCOUNT)
    with caplog.at_level(logging.INFO, logger=noisy.name), caplog.at_level(logging.INFO, logger=account.name):
        with ledger.reloading():
            noisy.warning("layer not reloaded")
            noisy.error("reload failed")
            account.warning("Following weights were not loaded from checkpoint: %s", {"a.weight", "b.weight"})
        with ledger.reloading():
            account.warning("Following weights were not loaded from checkpoint: %s", {"b.weight", "c.weight"})
        noisy.warning("after")
    assert [r.getMessage() for r in caplog.records] == ["reload failed", "after"]
    assert ledger.take() == ["b.weight"] and ledger.take() == []
    assert noisy.filters == []
