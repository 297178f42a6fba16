"""Built-in verifiable rewards for the built-in tasks (`exact_answer` scores `builtin:arith`).

TRL's reward-function convention: called with the batch's `prompts` and `completions` (lists of
strings) and every other dataset column as a keyword argument holding one value per sample;
returns one float per completion.
"""
from __future__ import annotations

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
