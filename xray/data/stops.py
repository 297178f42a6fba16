"""What ends a response: the model's end-of-sequence token ids, and the token that completes a stop string.

`stop_token_ids(tokenizer, model_dir)` gathers every EOS id a model may end with: the tokenizer's
and those of the model directory's generation_config.json (often a list: a chat model ends its turn
with its own token). The run (`xray/run/inputs.py`), the sampling job and the rollout Workhorse's
text prompts pass them to both engines as `stop_token_ids`.

`stop_string_end(decode, ids, stops)` says where a response ends when the run gives stop strings
(`rollout.stop`): with the token that completes the first of them in the response's text, as vLLM's
detokenizer decides it. That token is kept, and so the completion holds the stop string (with any
characters that token adds after it): the ids and log-probs are exactly the ones the engine sampled,
which training needs. vLLM stops there itself (`stop` with `include_stop_str_in_output`,
`xray/backends/vllm.py`); the DeepSpeed-Inference engine (`xray/backends/dsinfer.py`) cuts with this.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

log = logging.getLogger(__name__)


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def generation_eos_ids(model_dir: str | Path) -> list[int]:
    """The `eos_token_id` (an int or a list) of `model_dir`'s generation_config.json; without that
    file, config.json's (what `transformers` and vLLM derive the generation config from)."""
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir, name)
        if path.is_file():
            return _as_ids(json.loads(path.read_text()).get("eos_token_id"))
    return []


def stop_token_ids(tokenizer, model_dir: Optional[str | Path] = None) -> list[int]:
    """Every end-of-sequence id of the tokenizer and of the model directory (`model_dir`, else the
    directory the tokenizer was loaded from), the tokenizer's first, without repeats."""
    directory = model_dir or getattr(tokenizer, "name_or_path", None)
    found = _as_ids(getattr(tokenizer, "eos_token_id", None))
    if directory and Path(directory).is_dir():
        found += generation_eos_ids(directory)
    ids = list(dict.fromkeys(found))
    if not ids:
        log.warning("the tokenizer and %s name no end-of-sequence id: responses run to max_new_tokens unless "
                    "rollout.stop ends them; set eos_token_id in generation_config.json", directory)
    return ids


def stop_string_end(decode: Callable[[list[int]], str], ids: Sequence[int], stops: Sequence[str]) -> Optional[int]:
    """How many of the response `ids` to keep: up to the token whose text completes the first of
    `stops` (None when none occurs). `decode` turns ids into text (special tokens skipped, as vLLM's
    detokenizer does); the text of a prefix of ids is a prefix of the text, so a bisection finds it."""
    ids = list(ids)
    if not stops or not ids or not any(s in decode(ids) for s in stops):
        return None
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in decode(ids[:mid]) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    return lo


def text_decoder(tokenizer) -> Callable[[list[int]], str]:
    """`decode` for `stop_string_end`: the tokenizer's, special tokens skipped."""
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
