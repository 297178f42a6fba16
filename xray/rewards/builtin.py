"""Built-in verifiable rewards for the built-in tasks (`exact_answer` scores `builtin:arith`).

TRL's reward-function convention: called with the batch's `prompts` and `completions` (lists of
strings) and every other dataset column as a keyword argument holding one value per sample;
returns one float per completion. `judged_answer` is `exact_answer` behind a simulated remote
judge: each sample waits a seeded log-normal latency without using the CPU, as a call to a remote
verifier or sandbox would (`benchmarks/async_vs_sync.py`'s `latency` setting).
"""
from __future__ import annotations

import asyncio
import math
import random
import re

_NUMBER = re.compile(r"-?\d+")


def exact_answer(prompts: list[str], completions: list[str], answer: list, **_: object) -> list[float]:
    """1.0 when the first integer in the completion equals the row's `answer`, else 0.0."""
    scores = []
    for completion, expected in zip(completions, answer):
        m = _NUMBER.search(completion)
        scores.append(1.0 if m is not None and m.group(0) == str(expected).strip() else 0.0)
    return scores


def strict_answer(prompts: list[str], completions: list[str], answer: list, **_: object) -> list[float]:
    """1.0 when the whole completion, stripped of surrounding whitespace, equals the row's `answer`
    (nothing may follow the answer: rewards stopping right after it), else 0.0."""
    return [1.0 if isinstance(c, str) and c.strip() == str(a).strip() else 0.0
            for c, a in zip(completions, answer)]


JUDGE_MEDIAN_S = 0.15
"""`judged_answer`'s median latency per sample, in seconds."""
JUDGE_SIGMA = 1.0
"""The standard deviation of the latency's logarithm (a long tail: the 99th percentile is ~10x the median)."""


def judge_latency(prompt: str, completion: str) -> float:
    """The seconds the judge takes on one sample: log-normal, seeded by the sample itself, so the
    same sample waits as long in every run and mode."""
    rng = random.Random(f"{prompt}\x00{completion}")
    return rng.lognormvariate(math.log(JUDGE_MEDIAN_S), JUDGE_SIGMA)


async def judged_answer(prompts: list[str], completions: list[str], answer: list, **_: object) -> list[float]:
    """`exact_answer`, each sample answered after its `judge_latency`; the samples of one call wait
    concurrently (an `async def` reward: awaited on the run's event loop, no thread, no CPU)."""
    await asyncio.gather(*[asyncio.sleep(judge_latency(p, c)) for p, c in zip(prompts, completions)])
    return exact_answer(prompts, completions, answer)
