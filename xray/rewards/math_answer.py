"""Built-in math rewards: the final answer of a reasoning completion against a dataset's gold answer.

Sits under `xray/rewards/` beside `builtin.py` (whose `exact_answer` reads the *first* integer, for
the built-in arithmetic task); name these in a config as `xray.rewards.math_answer:math_answer` or
`xray.rewards.math_answer:math_verify`. Both follow TRL's reward-function convention and score
1.0 (right), 0.0 (wrong, or no answer found) or None (the gold answer is empty or does not parse:
no score, see `reward.on_nonfinite`).

The completion's final answer (`final_answer`), in this order:
  1. the content of the last `\\boxed{...}` (nested braces kept whole: `\\boxed{\\frac{1}{2}}`);
  2. else what follows the last `####` on its line (GSM8K's format);
  3. else the last number in the text (`1,000`, `-2.5`, `3/4`, `$72`).
The gold answer (`gold_answer`) comes from the row's `answer` column (GSM8K: the rationale ending
in `#### 72`; MATH-500: the bare answer), or where that is missing or empty its `solution`
column (MATH: a worked solution with `\\boxed{}`): what follows `####`, else the last
`\\boxed{}`, else the whole text.

`math_answer` compares numbers exactly (`72 == 72.0 == $72 == 72% == 144/2`, commas and LaTeX
fractions read), else the two texts without spaces. `math_verify` also settles what is not a
plain number with the `math-verify` package (symbolic and LaTeX equivalence: `\\frac{1}{2}` and
`0.5`, `\\sqrt{2}/2` and `\\frac{\\sqrt2}{2}`), each pair in a worker process under a deadline
(`xray.rewards.symbolic`); a pair past it scores 0. It runs in its own processes whatever
`reward.workers` says.
"""
from __future__ import annotations

import re
from fractions import Fraction
from typing import Any, Callable, Optional, Sequence

_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+(?:\.\d+)?)?|-?\.\d+")
_PLAIN = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_FRAC = re.compile(r"^(-?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")
_THOUSANDS = re.compile(r"^(-?\d{1,3}(?:,\d{3})+)(\.\d+)?$")


def boxed_contents(text: str) -> list[str]:
    """The contents of every `\\boxed{...}` (and `\\fbox{...}`) in `text`, in order, each with
    its nested braces whole; escaped braces (`\\{`) do not count; an unclosed one is left out."""
    found = []
    for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            ch = text[i]
            if ch == "\\":
                i += 2
                continue
            depth += {"{": 1, "}": -1}.get(ch, 0)
            i += 1
        if depth == 0:
            found.append(text[m.end():i - 1].strip())
    return found


def hash_answer(text: str) -> Optional[str]:
    """What follows the last `####` on its line (GSM8K's final answer), or None."""
    at = text.rfind("####")
    if at < 0:
        return None
    rest = text[at + 4:].strip().splitlines()
    return rest[0].strip() if rest and rest[0].strip() else None


def last_number(text: str) -> Optional[str]:
    """The last number written in `text` (`1,000`, `-2.5`, `3/4`), or None."""
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def final_answer(completion: str) -> Optional[str]:
    """The completion's final answer: the last `\\boxed{}`, else `#### N`, else the last number."""
    boxed = boxed_contents(completion)
    if boxed:
        return boxed[-1] or None
    return hash_answer(completion) or last_number(completion)


def gold_answer(gold: Any) -> Optional[str]:
    """The answer in a gold column's value: after `####`, else the last `\\boxed{}`, else the
    whole text; None when it is empty."""
    text = "" if gold is None else str(gold).strip()
    if not text:
        return None
    boxed = boxed_contents(text)
    return hash_answer(text) or (boxed[-1] if boxed else text)


def to_number(text: str) -> Optional[Fraction]:
    """`text` as an exact number, or None: `72`, `72.0`, `$72`, `\\$1,000`, `72%`, `-3/4`,
    `\\frac{1}{2}`, `1e3` (a trailing `.`, a leading `+` and `\\!` spacing are dropped)."""
    s = text.strip().replace("\\!", "").replace("\\$", "").replace("$", "").replace("\\%", "").rstrip("%").strip()
    s = s.rstrip(".").removeprefix("+").replace(" ", "")
    m = _THOUSANDS.match(s)
    if m:
        s = m.group(1).replace(",", "") + (m.group(2) or "")
    frac = _FRAC.match(s)
    if frac:
        sign, num, den = frac.groups()
        return _ratio(sign + num, den)
    if "/" in s:
        num, _, den = s.partition("/")
        return _ratio(num, den)
    return Fraction(s) if _PLAIN.fullmatch(s) else None


def _ratio(num: str, den: str) -> Optional[Fraction]:
    n, d = to_number(num), to_number(den)
    return None if n is None or d is None or d == 0 else n / d


def same_answer(gold: str, answer: str) -> bool:
    """Equal as numbers when both are numbers, else equal as texts without spaces."""
    g, a = to_number(gold), to_number(answer)
    if g is not None and a is not None:
        return g == a
    return "".join(gold.split()) == "".join(answer.split())


def _texts(completions: Sequence[Any]) -> list[str]:
    """The completions' texts: plain strings, or TRL's chat form (the last message's content)."""
    return [c[-1]["content"] if isinstance(c, list) else str(c) for c in completions]


def _golds(answer: Optional[list], solution: Optional[list], n: int) -> list:
    """Each row's gold: its `answer` where that is set and not empty, else its `solution`."""
    if answer is None and solution is None:
        raise KeyError("the math rewards read the gold answer from the row's `answer` column (GSM8K's `#### N` "
                       "rationale, or a bare answer) or its `solution` column (MATH's solution with \\boxed{}); "
                       "the data has neither: rename its gold column to one of them")
    for column in (answer, solution):
        if column is not None and len(column) != n:
            raise ValueError(f"{len(column)} gold answers for {n} completions")
    answer, solution = answer or [None] * n, solution or [None] * n
    return [a if a is not None and str(a).strip() else s for a, s in zip(answer, solution)]


def math_answer(prompts: list, completions: list, answer: Optional[list] = None,
                solution: Optional[list] = None, **_: object) -> list[Optional[float]]:
    """1.0 when the completion's final answer equals the gold answer (`same_answer`), 0.0 when
    not or when it has none, None when the gold answer is empty."""
    scores: list[Optional[float]] = []
    for text, gold in zip(_texts(completions), _golds(answer, solution, len(completions))):
        g, a = gold_answer(gold), final_answer(text)
        scores.append(None if g is None else float(a is not None and same_answer(g, a)))
    return scores


def math_verify_reward(timeout_s: Optional[float] = None, workers: Optional[int] = None) -> Callable:
    """A `math_verify` reward whose pairs each get `timeout_s` seconds in `workers` processes
    (defaults: `xray.rewards.symbolic.TIMEOUT_S` and `WORKERS`); name the result in your own
    module (`reward = math_verify_reward(timeout_s=5)`) to change them."""

    def math_verify(prompts: list, completions: list, answer: Optional[list] = None,
                    solution: Optional[list] = None, **_: object) -> list[Optional[float]]:
        """1.0 when the completion's final answer equals the gold answer as numbers or, by
        math-verify, symbolically; 0.0 when not, when it has none, or past the deadline; None
        when the gold answer is empty or math-verify cannot parse it."""
        from xray.rewards import symbolic

        golds = [gold_answer(g) for g in _golds(answer, solution, len(completions))]
        answers = [final_answer(t) for t in _texts(completions)]
        scores: list[Optional[float]] = [None if g is None else 0.0 if a is None else None
                                         for g, a in zip(golds, answers)]
        ask = []
        for i, (g, a) in enumerate(zip(golds, answers)):
            if g is not None and a is not None:
                gn, an = to_number(g), to_number(a)
                if gn is not None and an is not None:
                    scores[i] = float(gn == an)  # plain numbers: settled here, no process needed
                else:
                    ask.append(i)
        found = symbolic.verify_answers([(golds[i], answers[i]) for i in ask],
                                        timeout_s if timeout_s is not None else symbolic.TIMEOUT_S,
                                        workers if workers is not None else symbolic.WORKERS)
        for i, same in zip(ask, found):
            scores[i] = None if same is None else float(same)
        return scores

    math_verify.own_processes = True  # RewardScorer: never sent to reward.workers' processes
    math_verify.__qualname__ = "math_verify"  # the module's default pickles by name
    return math_verify


math_verify = math_verify_reward()
"""The math-verify reward with the default deadline and worker count."""
