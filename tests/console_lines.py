"""Reading a run's console output (stdout and stderr as captured): which lines are progress bars,
which are the libraries' start-up noise, and which are left. A test helper, beside `tests/`' tests;
the end-to-end tests call it on a real run's output, `tests/unit/test_console_lines.py` checks it.

    from tests.console_lines import noise_lines, non_progress_lines
    text = completed.stdout + completed.stderr
    assert noise_lines(text) == []
    assert len(non_progress_lines(text)) <= 15

A captured terminal line may hold several tqdm updates separated by carriage returns, lines that
Ray forwards from a Workhorse start with `(ClassName pid=N) ` and may carry ANSI colours, and a
log line written while a bar is up can follow the bar on the same line; all are taken apart here.
"""
from __future__ import annotations

import re

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
RAY_PREFIX = re.compile(r"^\((?:[\w.:-]+ )?pid=\d+(?:, ip=[^)]*)?\) ?|^\((?:raylet|gcs_server|autoscaler)[^)]*\) ?")
"""What Ray puts before a line it forwards from a worker process."""
BAR_END = re.compile(r"\[(?:\d+:)?\d+:\d\d(?:<(?:\?|(?:\d+:)?\d+:\d\d))?,\s*(?:\?|[\d.]+)\s*"
                     r"(?:[a-zA-Z]*/s|s/[a-zA-Z]+)[^\]]*\]")
"""The end of a tqdm bar: `[elapsed<remaining, rate, postfix]` (or `[elapsed, rate]` without a
total), the rate being `N unit/s`, `N s/unit` or `?unit/s`."""
BAR_START = re.compile(r"\d+%.*?[\d.]+[kMG]?/[\d.?]+[kMG]?\s*$|: +[\d.]+[kMG]?[a-zA-Z]*\s*$")
"""What comes right before a bar's end: `NN%|████| n/total ` (or `NN% Completed | n/total `) or,
without a total, `desc: n unit `."""

NOISE = {
    "deepspeed-accelerator": re.compile(r"Setting accelerator to CPU\. If you have GPU or other accelerator"),
    "deepspeed-shm-op": re.compile(r"DeepSpeed \S+ built successfully"),
    "ray-token-auth": re.compile(r"Token authentication is (?:enabled|disabled) for this Ray cluster"),
    "ray-dedup-banner": re.compile(r"Ray deduplicates logs by default"),
    "vllm-triton": re.compile(r"Triton is installed, but doesn't include CPU backend"),
    "vllm-numa": re.compile(r"NUMA binding: Using \w+ policy"),
    "loading-bar": re.compile(r"Loading safetensors checkpoint shards|Loading weights:|Writing model shards"),
}
"""The libraries' start-up lines a run must not print, by name: warnings, banners, loading bars."""


def segments(text: str) -> list[str]:
    """Every piece of `text` a terminal would draw as a line or a bar update: split at newlines
    and carriage returns, ANSI colours and Ray's worker prefix removed, blank pieces dropped."""
    out = []
    for line in text.split("\n"):
        for piece in ANSI.sub("", line).split("\r"):
            piece = RAY_PREFIX.sub("", piece).strip()
            if piece:
                out.append(piece)
    return out


def split_bar(piece: str) -> tuple[str | None, str]:
    """(the tqdm bar at the start of `piece` or None, the text after it)."""
    for end in BAR_END.finditer(piece):
        if BAR_START.search(piece[:end.start()]):
            return piece[:end.end()], piece[end.end():].strip()
    return None, piece


def progress_lines(text: str) -> list[str]:
    """The tqdm bar updates in `text`."""
    return [bar for bar, _ in map(split_bar, segments(text)) if bar is not None]


def non_progress_lines(text: str) -> list[str]:
    """Every line of `text` that is not a tqdm bar update (a log line glued to a bar counts)."""
    return [rest for _, rest in map(split_bar, segments(text)) if rest]


def noise_lines(text: str) -> list[str]:
    """The lines of `text`, bars included, that carry one of the libraries' start-up noises (`NOISE`)."""
    return [piece for piece in segments(text) if any(p.search(piece) for p in NOISE.values())]


def noise_kinds(text: str) -> list[str]:
    """The names of the `NOISE` kinds found in `text`, in `NOISE`'s order."""
    found = noise_lines(text)
    return [name for name, p in NOISE.items() if any(p.search(line) for line in found)]
