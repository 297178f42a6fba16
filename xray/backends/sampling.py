"""Sampling parameters and the rollout Batch: what both generation backends (vllm, dsinfer) share.

`GenerationEngine.generate(prompts, sampling)` takes a plain dict so that it crosses a Ray call
as it is; `SamplingSpec.from_dict` checks it once, with errors that name the key, and both
engines read the same typed fields. `rollout_batch` builds the one Batch layout both return:
n rows per prompt, in prompt order.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping, Sequence

from xray.data import columns as C
from xray.data.batch import Batch

RESPONSE_LOGPROBS = "response_logprobs"  # list of B lists of float: log p of each response token
ROUTED_EXPERTS_ROWS = "routed_experts_rows"  # list of B int16 tensors [prompt + response - 1, L, K]: the experts
                                             # each fed token went to (an engine that reports its routing)
FINISH_REASON = "finish_reason"          # list of B str: "stop" (eos, a stop token or string) or "length"
WEIGHT_VERSION = "weight_version"        # int, where the caller knows it: the weight version that generated


class SamplingError(ValueError):
    """A sampling dict with an unknown key or a value out of range; the text says the fix."""


@dataclass(frozen=True)
class SamplingSpec:
    """Sampling settings of one `generate` call."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (1 = off)."""
    top_k: int = 0
    """Keep the k most likely tokens (0 or -1 = off)."""
    max_new_tokens: int = 128
    """Most tokens generated per response."""
    n: int = 1
    """Responses per prompt; they come back as consecutive rows."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a response (in addition to the model's eos); the stop token is kept."""
    stop: tuple[str, ...] = ()
    """Strings that end a response: it ends with the token that completes the first of them, which
    is kept, so the completion holds the stop string (`xray.data.stops.stop_string_end`). The
    engine must be built with `stop_strings=True` (it needs the model directory's tokenizer)."""
    seed: int | None = None
    """Seed of this call: the same seed, prompts and weights give the same samples. None: the
    engine derives one from its own seed and a call counter (still reproducible per run)."""

    @classmethod
    def from_dict(cls, sampling: Mapping[str, Any] | None) -> "SamplingSpec":
        """Check `sampling` and return the typed spec; unknown keys and bad values raise."""
        sampling = dict(sampling or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(sampling) - known)
        if unknown:
            raise SamplingError(f"unknown sampling keys {unknown}; the keys are {sorted(known)}")
        if "stop_token_ids" in sampling:
            sampling["stop_token_ids"] = tuple(int(t) for t in sampling["stop_token_ids"] or ())
        if "stop" in sampling:
            stop = sampling["stop"] or ()
            sampling["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)
        spec = cls(**sampling)
        spec._check()
        return spec

    def _check(self) -> None:
        if self.temperature < 0:
            raise SamplingError(f"temperature={self.temperature} is negative; use 0 for greedy or > 0")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p={self.top_p} must be in (0, 1]; use 1.0 to turn it off")
        if self.top_k < -1:
            raise SamplingError(f"top_k={self.top_k} must be >= 1, or 0 / -1 to turn it off")
        if self.n < 1 or self.max_new_tokens < 1:
            raise SamplingError(f"n={self.n} and max_new_tokens={self.max_new_tokens} must be >= 1")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise SamplingError(f"stop={list(self.stop)}: stop strings must be non-empty strings; remove the others")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def top_k_or_none(self) -> int | None:
        """top_k as an active cut-off, or None when it is off."""
        return self.top_k if self.top_k > 0 else None


def call_seed(spec: SamplingSpec, engine_seed: int, call_index: int) -> int:
    """The seed of one generate call: the caller's, or one derived from the engine's seed."""
    if spec.seed is not None:
        return int(spec.seed)
    return (engine_seed * 1_000_003 + call_index * 7_919) % (2**31 - 1)


def rollout_batch(prompts: Sequence[Sequence[int]], n: int, responses: Sequence[Sequence[int]],
                  logprobs: Sequence[Sequence[float]], finish_reasons: Sequence[str]) -> Batch:
    """The rollout Batch: row p*n + j is response j of prompt p."""
    if not len(responses) == len(logprobs) == len(finish_reasons) == len(prompts) * n:
        raise AssertionError("one response, log-prob list and finish reason per prompt and sample")
    for ids, lps in zip(responses, logprobs):
        assert len(ids) == len(lps), "one log-prob per response token"
    prompt_rows = [list(p) for p in prompts for _ in range(n)]
    return Batch.from_columns({
        C.PROMPT_IDS: prompt_rows,
        C.RESPONSE_IDS: [list(r) for r in responses],
        RESPONSE_LOGPROBS: [list(map(float, lp)) for lp in logprobs],
        FINISH_REASON: list(finish_reasons),
    })
