"""Quiet start-up: the libraries' start-up noise kept out of the console, at its source.

Every Workhorse is a process of its own that imports torch, DeepSpeed, vLLM and Ray, and Ray
forwards what it prints to the driver's console, so one library line becomes one line per
Workhorse. Each noisy line seen on a run is silenced here with the library's own switch where
it has one (environment variables handed to the Workhorses through Ray's `runtime_env`, by
`xray.wholemodel.handle`), else with a filter that drops exactly that line (`install_filters`,
called when a Workhorse is built; `quiet_driver`, called by `xray.run.console` and before xray
starts or joins Ray, `xray.wholemodel.cluster`).

    noise                                         where                 switch
    DeepSpeed "Setting accelerator to CPU ..."    CPU Workhorses        DS_ACCELERATOR=cpu
                                                  driver                a logging filter
    DeepSpeed "DeepSpeed ... built successfully"  DeepSpeed Workhorses  a stdout line filter (a print)
    Ray "Token authentication is enabled ..."     driver                a logging filter (RAY_AUTH_MODE=token
                                                                        needs Ray's private config refresh)
    vLLM "Triton is installed, but doesn't ..."   vLLM Workhorses       a logging filter (logged at import,
                                                                        before VLLM_LOGGING_LEVEL applies)
    vLLM C++ "NUMA binding: Using MEMBIND ..."    vLLM CPU Workhorses   TORCH_CPP_LOG_LEVEL=ERROR
    bars of model loading (vLLM, transformers)    Workhorses            TQDM_DISABLE=1

Errors and tracebacks are never touched. Besides the lines above, a Workhorse runs with Python's
warnings off (PYTHONWARNINGS) and, on CPU, torch's C++ warnings off (TORCH_CPP_LOG_LEVEL): C++
errors still raise.
"""
from __future__ import annotations

import io
import logging
import os
import re
import sys
from typing import TextIO

IN_WORKHORSE_ENV = "XRAY_WORKHORSE_PROCESS"
"""Set in a Workhorse Ray actor's process: `install_filters` acts there only (a Workhorse built as
a plain class, in a test or a notebook, leaves its process's streams alone)."""
LOG_LEVEL_ENV = "XRAY_LOG_LEVEL"
"""The driver's console level (`python -m xray.train -v` / `--quiet`), handed to the Workhorses."""

WORKHORSE_ENV = {
    "PYTHONWARNINGS": "ignore::UserWarning,ignore::FutureWarning,ignore::DeprecationWarning",
    "VLLM_LOGGING_LEVEL": "ERROR",
    "TQDM_DISABLE": "1",  # a Workhorse's bars reach the console as broken fragments; the driver shows progress
    "PYTHONUNBUFFERED": "1",  # its prints reach the console as they are made (`xray.wholemodel.cluster`)
    IN_WORKHORSE_ENV: "1",
}
"""Every Workhorse's environment (on top of the thread counts `xray.wholemodel.handle` sets)."""

CPU_ENV = {
    "DS_ACCELERATOR": "cpu",  # what DeepSpeed would detect, without its warning
    "TORCH_CPP_LOG_LEVEL": "ERROR",  # C++ warnings (vLLM CPU's NUMA notice); C++ errors still raise
}
"""A CPU Workhorse's environment on top of `WORKHORSE_ENV`."""

STDOUT_NOISE = re.compile(r"^DeepSpeed \S+ built successfully$")
"""Lines some libraries print (not log) on stdout: dropped from a Workhorse's stdout."""
LOGGED_NOISE = {"vllm.triton_utils.importing": re.compile(r"^Triton is installed, but doesn't include CPU backend")}
"""In a Workhorse: logger name -> the message it logs at start-up that is noise."""
DRIVER_NOISE = {
    "DeepSpeed": re.compile(r"^Setting accelerator to CPU\."),
    "ray._private.authentication.authentication_token_setup": re.compile(
        r"^Token authentication is enabled for this Ray cluster\. Set RAY_AUTH_MODE=disabled"),
}
"""In the driver: logger name -> noise. DeepSpeed, imported on the way by other libraries, warns
(on stdout) that it found no accelerator, though the driver computes nothing with it; setting
DS_ACCELERATOR there would reach a local Ray cluster's GPU Workhorses. Ray announces the token
authentication it turns on for a new local cluster (its warning when authentication is off stays)."""


def workhorse_env(device: str) -> dict[str, str]:
    """The environment variables a Workhorse on `device` (CPU or GPU) starts with."""
    env = dict(WORKHORSE_ENV)
    if device.upper() == "CPU":
        env.update(CPU_ENV)
    if os.environ.get(LOG_LEVEL_ENV):
        env[LOG_LEVEL_ENV] = os.environ[LOG_LEVEL_ENV]
    return env


class DropMessage(logging.Filter):
    """Drops the records whose message matches `pattern`; lets every other record through."""

    def __init__(self, pattern: re.Pattern[str]):
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


class DropLines(io.TextIOBase):
    """A text stream that passes everything to `stream` except whole lines matching `pattern`
    (a partial line is held until its newline or a flush)."""

    def __init__(self, stream: TextIO, pattern: re.Pattern[str]):
        self.stream, self.pattern, self.pending = stream, pattern, ""

    def write(self, text: str) -> int:
        *lines, self.pending = (self.pending + text).split("\n")
        kept = [line + "\n" for line in lines if not self.pattern.match(line)]
        if kept:
            self.stream.write("".join(kept))
        return len(text)

    def flush(self) -> None:
        if self.pending and not self.pattern.match(self.pending):
            self.stream.write(self.pending)
            self.pending = ""
        self.stream.flush()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.stream, "encoding", "utf-8")


def install_filters() -> None:
    """In a Workhorse process: drop the known noise lines (once per process), and log at the
    driver's console level (`-v` shows the Workhorses' DEBUG lines too)."""
    if os.environ.get(IN_WORKHORSE_ENV) != "1":
        return
    _drop_messages(LOGGED_NOISE)
    if not isinstance(sys.stdout, DropLines):
        sys.stdout = DropLines(sys.stdout, STDOUT_NOISE)
    level = os.environ.get(LOG_LEVEL_ENV)
    root = logging.getLogger("xray")
    if level and not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
        root.setLevel(level)


def quiet_driver() -> None:
    """In the driver (`python -m xray.train`): drop `DRIVER_NOISE`."""
    _drop_messages(DRIVER_NOISE)


def _drop_messages(noise: dict[str, re.Pattern[str]]) -> None:
    for name, pattern in noise.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropMessage) for f in logger.filters):
            logger.addFilter(DropMessage(pattern))
