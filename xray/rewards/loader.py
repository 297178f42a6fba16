"""Reward functions named `module:function` in a config, called with TRL's convention.

    fn(prompts=[...], completions=[...], completion_ids=[...], **extra_columns) -> list[float]

`prompts` are the prompt fields as in the data; `completions` the decoded responses (for chat
prompts, TRL's `[{"role": "assistant", "content": text}]`); every other dataset column arrives as a
keyword argument with one value per sample. A function without `**kwargs` receives only the
arguments it names. `None` means "no score" and counts as NaN. A function that raises stops the run
with a `RewardFunctionError` that shows the offending prompt and the original traceback; a NaN or
infinite score is an error, or (with `on_nonfinite="skip"`) drops that sample via a keep-mask.
An `async def` function (a remote judge, a sandbox) is awaited on the caller's event loop instead
of running in a thread: a synchronous step awaits the whole batch at once, so its samples wait
concurrently; an asynchronous run's makers score each prompt's group as soon as it is generated.
`RewardScorer` holds the run's functions (`reward.function`, or `reward.functions` with
`reward.weights`, combined per sample as TRL does: `compose.py`) and, with `reward.workers`,
calls the synchronous ones in worker processes, a chunk of the batch each (`pool.py`).
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from xray.rewards.compose import Tally, combine, function_names
from xray.rewards.pool import ProcessPool

if TYPE_CHECKING:  # torch is imported where scores become tensors: reward.workers' processes never need it
    import torch

RewardFn = Callable[..., Sequence[Optional[float]]]


class RewardSpecError(ValueError):
    """A `module:function` name that does not resolve to a callable; says what to fix."""


class RewardFunctionError(RuntimeError):
    """A reward function raised, or returned something unusable; carries the offending sample."""

    def __init__(self, message: str, row: Optional[int] = None, prompt: Any = None, completion: Any = None,
                 traceback_text: str = ""):
        super().__init__(message)
        self.row, self.prompt, self.completion, self.traceback_text = row, prompt, completion, traceback_text

    def __reduce__(self):  # keep the fields when pickled through Ray
        return (type(self), (self.args[0], self.row, self.prompt, self.completion, self.traceback_text))


def load_reward_function(spec: str) -> RewardFn:
    """The callable named by `spec`: `package.module:function`, or `path/to/file.py:function`."""
    return load_callable(spec, "reward function", "xray.rewards.builtin:exact_answer")


def load_callable(spec: str, kind: str, example: str) -> Callable:
    """The callable (a function or a class) named by `spec`, `package.module:name` or
    `path/to/file.py:name`; a `RewardSpecError` naming `kind` and the fix otherwise."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise RewardSpecError(f"{kind} {spec!r} is not of the form module:function (or module:Class; for example {example})")
    if module_name.endswith(".py"):
        module = _module_from_file(Path(module_name), spec, kind)
    else:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            raise RewardSpecError(f"{kind} {spec!r}: cannot import module {module_name!r} ({e}); "
                                  "put it on PYTHONPATH or name a .py file as path/to/file.py:name") from None
    fn = getattr(module, attr, None)
    if fn is None:
        public = sorted(n for n in vars(module) if not n.startswith("_") and callable(vars(module)[n]))
        raise RewardSpecError(f"{kind} {spec!r}: module {module_name!r} has no attribute {attr!r}; "
                              f"its callables are {public[:20]}")
    if not callable(fn):
        raise RewardSpecError(f"{kind} {spec!r}: {attr!r} is a {type(fn).__name__}, not a function")
    return fn


def _module_from_file(path: Path, spec: str, kind: str = "reward function"):
    if not path.is_file():
        raise RewardSpecError(f"{kind} {spec!r}: no file {path}")
    module_spec = importlib.util.spec_from_file_location(f"xray_reward_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    # registered before it runs, as an import registers it: a dataclass in the file looks its
    # module up in sys.modules (with postponed annotations it fails otherwise)
    sys.modules[module_spec.name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_spec.name, None)
        raise
    return module


def _conversational(prompts: Sequence[Any], completions: Sequence[str]) -> list:
    if prompts and isinstance(prompts[0], list):
        return [[{"role": "assistant", "content": c}] for c in completions]
    return list(completions)


def _accepted(fn: RewardFn, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments `fn` can take (all of them when it has **kwargs)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return kwargs
    names = {p.name for p in params}
    return {k: v for k, v in kwargs.items() if k in names}


def _reward_kwargs(fn: RewardFn, prompts: Sequence[Any], completions: Sequence[str], extras: dict[str, list],
                   completion_ids: Optional[Sequence[list[int]]]) -> dict[str, Any]:
    kwargs = dict(prompts=list(prompts), completions=_conversational(prompts, completions), **extras)
    if completion_ids is not None:
        kwargs["completion_ids"] = [list(c) for c in completion_ids]
    return _accepted(fn, kwargs)


SIGNAL_HINT = ("math-verify (and anything else timed with signal.alarm) works only in a process's main "
               "thread: set reward.workers=1 or more to call the function in worker processes, or score "
               "with xray.rewards.math_answer:math_verify\n")


def _raised(fn: RewardFn, e: Exception, row: int, prompts: Sequence[Any], completions: Sequence[str],
            row_offset: int = 0) -> RewardFunctionError:
    tb = "".join(traceback.format_exception(e))
    hint = SIGNAL_HINT if isinstance(e, ValueError) and "signal" in str(e) and "thread" in str(e) else ""
    return RewardFunctionError(
        f"the reward function {getattr(fn, '__qualname__', fn)!r} raised {type(e).__name__}: {e}\n"
        f"on row {row + row_offset} of the batch, prompt {prompts[row]!r}, completion {completions[row]!r}\n"
        f"{hint}fix the function (or the data) and resume from the last checkpoint\n{tb}",
        row=row + row_offset, prompt=prompts[row], completion=completions[row], traceback_text=tb)


def call_reward_function(fn: RewardFn, prompts: Sequence[Any], completions: Sequence[str],
                         extras: dict[str, list], completion_ids: Optional[Sequence[list[int]]] = None,
                         row_offset: int = 0) -> list:
    """Call `fn` TRL-style on the batch; on an exception raise `RewardFunctionError` naming the
    first row that fails on its own (or the batch's first row) with the original traceback
    (`row_offset`: where this batch starts in the caller's, for a chunk)."""
    kwargs = _reward_kwargs(fn, prompts, completions, extras, completion_ids)
    try:
        return list(fn(**kwargs))
    except Exception as e:  # noqa: BLE001 - any user error is reported with its sample
        row = _first_failing_row(fn, kwargs, len(prompts))
        raise _raised(fn, e, row, prompts, completions, row_offset) from e


_in_worker: dict[str, RewardFn] = {}
"""A worker process's reward functions, loaded once per `module:function` name."""


def call_by_name(spec: str, prompts: list, completions: list, extras: dict[str, list],
                 completion_ids: Optional[list], row_offset: int) -> list:
    """`call_reward_function` on the function named `spec`, in a `reward.workers` process."""
    if spec not in _in_worker:
        _in_worker[spec] = load_reward_function(spec)
    return call_reward_function(_in_worker[spec], prompts, completions, extras, completion_ids, row_offset)


def _spec_of(fn: RewardFn, spec: Optional[str]) -> str:
    """The name a worker process loads `fn` by: its config name, else `module:qualname` when that
    resolves to `fn` itself; else a `RewardSpecError` that says the fix."""
    if spec is not None:
        return spec
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module and module != "__main__" and "<" not in qualname and "." not in qualname:
        try:
            if getattr(importlib.import_module(module), qualname, None) is fn:
                return f"{module}:{qualname}"
        except ImportError:
            pass
    raise RewardSpecError(f"reward.workers calls the reward functions in other processes, which load them by name; "
                          f"{fn!r} has no importable name: define it at the top level of a module (or a .py file "
                          "named as path/to/file.py:function), or set reward.workers=0")


async def acall_reward_function(fn: RewardFn, prompts: Sequence[Any], completions: Sequence[str],
                                extras: dict[str, list], completion_ids: Optional[Sequence[list[int]]] = None) -> list:
    """`call_reward_function` for an `async def` function: awaited, the error names the batch's first row."""
    kwargs = _reward_kwargs(fn, prompts, completions, extras, completion_ids)
    try:
        return list(await fn(**kwargs))
    except Exception as e:  # noqa: BLE001 - any user error is reported with its sample
        raise _raised(fn, e, 0, prompts, completions) from e


def _first_failing_row(fn: RewardFn, kwargs: dict[str, Any], n: int) -> int:
    """The first row on which `fn` raises when called alone; 0 if none does."""
    for i in range(n):
        one = {k: (v[i:i + 1] if isinstance(v, list) and len(v) == n else v) for k, v in kwargs.items()}
        try:
            fn(**one)
        except Exception:  # noqa: BLE001
            return i
    return 0


@dataclass
class Scores:
    """The checked scores of one batch."""

    scores: torch.Tensor
    """[B] float32; 0.0 on dropped rows."""
    keep: torch.Tensor
    """[B] bool; False on rows whose score was NaN or infinite and were skipped."""


def numbers(raw: Sequence[Any], prompts: Sequence[Any], source: str = "the reward function") -> list[float]:
    """A reward function's answer as one float per sample (None: NaN); a `RewardFunctionError`
    naming `source` for a wrong count or a score that is not a number."""
    import torch

    n = len(prompts)
    if len(raw) != n:
        raise RewardFunctionError(f"{source} returned {len(raw)} scores for {n} completions; "
                                  "it must return exactly one score per completion")
    values = []
    for i, s in enumerate(raw):
        if s is not None and not isinstance(s, (int, float)) and not (torch.is_tensor(s) and s.numel() == 1):
            raise RewardFunctionError(f"{source} returned a {type(s).__name__} for row {i} "
                                      f"(prompt {prompts[i]!r}); scores must be numbers", row=i, prompt=prompts[i])
        values.append(math.nan if s is None else float(s))
    return values


def check_scores(raw: Sequence[Any], prompts: Sequence[Any], completions: Sequence[str],
                 on_nonfinite: str = "error", source: str = "the reward function") -> Scores:
    """Turn a reward function's answer into `Scores`: one number per sample; NaN, infinity or None
    raise, or are dropped when `on_nonfinite == "skip"` (`source` names the function in errors)."""
    import torch

    n = len(prompts)
    values = numbers(raw, prompts, source)
    scores = torch.tensor(values, dtype=torch.float32)
    keep = torch.isfinite(scores)
    if not bool(keep.all()):
        bad = int((~keep).nonzero()[0])
        if on_nonfinite != "skip":
            raise RewardFunctionError(
                f"{source} returned {values[bad]} for row {bad} (prompt {prompts[bad]!r}, completion "
                f"{completions[bad]!r}); fix it, or set reward.on_nonfinite=skip to drop such samples",
                row=bad, prompt=prompts[bad], completion=completions[bad])
        if not bool(keep.any()):
            raise RewardFunctionError(f"every one of the {n} scores in the batch is NaN, infinite or None; "
                                      f"nothing is left to train on: fix {source}")
        scores = torch.where(keep, scores, torch.zeros_like(scores))
    return Scores(scores, keep)


def compute_scores(fn: RewardFn, prompts: Sequence[Any], completions: Sequence[str], extras: dict[str, list],
                   on_nonfinite: str = "error", completion_ids: Optional[Sequence[list[int]]] = None) -> Scores:
    """Call the reward function on a batch and check its scores."""
    raw = call_reward_function(fn, prompts, completions, extras, completion_ids)
    return check_scores(raw, prompts, completions, on_nonfinite)


class RewardScorer:
    """The run's reward functions bound to a tokenizer: `(rows, response_ids) -> (scores [B], keep [B])`,
    where `rows` are `PromptSet.rows()` dicts (`prompt`, `prompt_ids`, other columns) and the
    responses are decoded without special tokens before the functions see them. `fn` is one
    function or several (each a callable or a `module:function` name), combined with `weights`
    (default 1 each) by `compose.combine`; each one's mean since the last `take_metrics` is
    `reward/<name>`. `workers > 0`: the synchronous functions run in that many processes, a chunk
    of the batch each (not those with `own_processes`, as `math_verify`). When any function is
    `async def`, score with `acall` (`is_async`)."""

    def __init__(self, fn: RewardFn | str | Sequence[RewardFn | str], tokenizer, on_nonfinite: str = "error",
                 weights: Optional[Sequence[float]] = None, workers: int = 0):
        given = list(fn) if isinstance(fn, (list, tuple)) else [fn]
        if not given:
            raise RewardSpecError("no reward function given; set reward.function or reward.functions")
        self.fns = [load_reward_function(f) if isinstance(f, str) else f for f in given]
        self.weights = [1.0] * len(given) if weights is None else [float(w) for w in weights]
        if len(self.weights) != len(given):
            raise RewardSpecError(f"{len(self.weights)} reward weights for {len(given)} reward functions; "
                                  "give one weight per function")
        self.names = function_names(self.fns)
        self.tokenizer, self.on_nonfinite = tokenizer, on_nonfinite
        self.is_async = any(inspect.iscoroutinefunction(f) for f in self.fns)
        self.pool = ProcessPool(workers) if workers > 0 else None
        self.by_name: list[Optional[str]] = [  # the functions the pool calls, by the name it loads them with
            _spec_of(f, g if isinstance(g, str) else None) if self.pool is not None and not
            inspect.iscoroutinefunction(f) and not getattr(f, "own_processes", False) else None
            for f, g in zip(self.fns, given)]
        self.tally = Tally(self.names)
        self.source = ("the reward function" if len(given) == 1 else
                       f"every one of the reward functions ({', '.join(self.names)})")

    @classmethod
    def from_config(cls, reward, tokenizer) -> "Optional[RewardScorer]":
        """The scorer of a `RewardConfig` (`xray.config.reward`); None when no function is set."""
        specs = reward.specs
        return cls(list(specs), tokenizer, reward.on_nonfinite, reward.weights, reward.workers) if specs else None

    def _inputs(self, rows: Sequence[dict], response_ids: Sequence[list[int]]) -> tuple[list, list[str], dict]:
        if len(rows) != len(response_ids):
            raise ValueError(f"{len(rows)} prompt rows but {len(response_ids)} responses; repeat each row once "
                             "per sample")
        completions = [self.tokenizer.decode(list(r), skip_special_tokens=True) for r in response_ids]
        columns = dict.fromkeys(k for row in rows for k in row if k not in ("prompt", "prompt_ids"))
        extras = {k: [row.get(k) for row in rows] for k in columns}
        return [row["prompt"] for row in rows], completions, extras

    def _call(self, f: int, prompts: list, completions: list[str], extras: dict, ids) -> list:
        """Function `f`'s answer on the batch: in this thread, or in chunks in the workers."""
        spec = self.by_name[f]
        if spec is None:
            return call_reward_function(self.fns[f], prompts, completions, extras, ids)
        n, parts = len(prompts), min(self.pool.workers, len(prompts))
        bounds = [(n * k // parts, n * (k + 1) // parts) for k in range(parts)]
        chunks = [(spec, prompts[a:b], completions[a:b], {k: v[a:b] for k, v in extras.items()},
                   None if ids is None else [list(r) for r in ids[a:b]], a) for a, b in bounds]
        return [s for part in self.pool.call_chunks(call_by_name, chunks) for s in part]

    def _finish(self, raws: list[list], prompts: list, completions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        columns = [numbers(raw, prompts, f"the reward function {name!r}") for raw, name in zip(raws, self.names)]
        self.tally.add(columns)
        s = check_scores(combine(columns, self.weights), prompts, completions, self.on_nonfinite, self.source)
        return s.scores, s.keep

    def __call__(self, rows: Sequence[dict], response_ids: Sequence[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.is_async:
            raise TypeError(f"the reward functions {self.names} include an async one: "
                            "await RewardScorer.acall(rows, response_ids)")
        prompts, completions, extras = self._inputs(rows, response_ids)
        raws = [self._call(f, prompts, completions, extras, response_ids) for f in range(len(self.fns))]
        return self._finish(raws, prompts, completions)

    async def acall(self, rows: Sequence[dict], response_ids: Sequence[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The scores when a function is `async def`: those awaited, the others in worker threads,
        all at once (with no async function, the whole call runs in a worker thread)."""
        import asyncio

        if not self.is_async:
            return await asyncio.to_thread(self, rows, response_ids)
        prompts, completions, extras = self._inputs(rows, response_ids)
        raws = await asyncio.gather(*[
            acall_reward_function(fn, prompts, completions, extras, response_ids) if inspect.iscoroutinefunction(fn)
            else asyncio.to_thread(self._call, f, prompts, completions, extras, response_ids)
            for f, fn in enumerate(self.fns)])
        return self._finish(list(raws), prompts, completions)

    def take_metrics(self) -> dict[str, float]:
        """`reward/<name>`: each function's mean score (unweighted, over the samples it scored)
        since the last call; the run logs them with each step's metrics."""
        return self.tally.take()
