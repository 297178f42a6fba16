"""What a run trains on: the model directory, its tokenizer, the prompts, and the reward.

Sits between the config and an algorithm's trainer: `prepare` loads everything a run reads from
`model_dir`. `model.path: builtin:tiny-llama` (`BUILTIN_MODEL`) is resolved to a directory before
this, by `algorithms.warm_start` (a warm start is training, so it belongs to the algorithms layer).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from xray.builtin.sources import load_prompt_splits
from xray.builtin.smollm2 import SMOLLM2_MODEL, smollm2_dir
from xray.builtin.tiny_llama import BUILTIN_MODEL
from xray.config.schema import RunConfig
from xray.data.prompts import PromptSampler, PromptSet
from xray.data.stops import stop_token_ids
from xray.rewards.loader import RewardScorer
from xray.run.outputs import RunDir

log = logging.getLogger(__name__)


@dataclass
class RunData:
    """Model directory, tokenizer, prompt splits, sampler and scorer of a run."""

    model_dir: str
    tokenizer: object
    train: PromptSet
    eval: PromptSet
    sampler: PromptSampler
    score: RewardScorer | None
    """The reward function's scorer; None when a reward model scores (see `xray.rewards.model`)."""

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id or 0

    @property
    def stop_ids(self) -> list[int]:
        """Every EOS id of the tokenizer and of the model's generation_config.json."""
        return stop_token_ids(self.tokenizer, self.model_dir)

    @property
    def facts(self) -> dict[str, int]:
        """What the run's prompts came to, as metrics (`data/...`): the splits' sizes and the long
        prompts left out or truncated (`data.on_long_prompt`)."""
        return {"data/train_prompts": len(self.train), "data/eval_prompts": len(self.eval),
                "data/long_prompts_dropped": self.train.dropped + self.eval.dropped,
                "data/long_prompts_truncated": self.train.truncated + self.eval.truncated}

    @property
    def eval_rows(self) -> list[dict]:
        return self.eval.rows()

    def next_train_rows(self) -> list[dict]:
        return self.train.rows(self.sampler.next_indices())


def load_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as exc:
        raise FileNotFoundError(f"no usable tokenizer in {model_dir} ({str(exc).splitlines()[0]}); save the "
                                "model's tokenizer into its directory (tokenizer.save_pretrained(dir))") from None


def model_directory(path: str) -> str:
    """`model.path` when it is a Hugging Face model directory (`builtin:smollm2-135m-instruct`: the
    real pretrained model built offline, `xray.builtin.smollm2`); else an error that says the fix."""
    if path == SMOLLM2_MODEL:
        return str(smollm2_dir())
    if not Path(path, "config.json").is_file():
        raise FileNotFoundError(f"model.path {path!r} is not a Hugging Face model directory "
                                f"(no config.json); give a local directory, {BUILTIN_MODEL} or {SMOLLM2_MODEL}")
    return path


def prepare(cfg: RunConfig, run: RunDir, model_dir: str) -> RunData:
    """Tokenizer, prompts, sampler and reward of a run on `model_dir` (built-in models are built by
    the algorithms layer first: `algorithms.warm_start`)."""
    tokenizer = load_tokenizer(model_dir)
    train, held_out = load_prompt_splits(cfg.data, tokenizer, run.path / "data")
    scorer = RewardScorer.from_config(cfg.reward, tokenizer)  # None: a reward model scores
    sampler = PromptSampler(len(train), cfg.ppo.rollout_batch_size, cfg.seed)
    data = RunData(model_dir, tokenizer, train, held_out, sampler, scorer)
    log.info("prompts: %s", ", ".join(f"{k.split('/')[1]}={v}" for k, v in data.facts.items()))
    return data
