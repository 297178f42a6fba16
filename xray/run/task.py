"""What a run trains on: the model directory, its tokenizer, the prompts, and the reward.

`model.path: builtin:tiny-llama` is the default job's model: a seeded tiny Llama with the
character tokenizer of `xray.data.tokenizer`, warm-started by supervised fine-tuning on the
built-in task (`algorithms.sft`, on the run's own training backend) so that PPO starts from a
model that is sometimes right. The result is cached under `~/.cache/xray/builtin/<key>` (or
`$XRAY_CACHE`), keyed by everything that shapes it, so later runs skip the warm start.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from xray.config.plan import Plan
from xray.config.schema import RunConfig
from xray.config.typed import to_dict
from xray.data.prompts import PromptSampler, PromptSet, load_prompt_splits
from xray.rewards.loader import RewardScorer
from xray.run.outputs import RunDir

log = logging.getLogger(__name__)
BUILTIN_MODEL = "builtin:tiny-llama"


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
        return [self.tokenizer.eos_token_id]

    @property
    def eval_rows(self) -> list[dict]:
        return self.eval.rows()

    def next_train_rows(self) -> list[dict]:
        return self.train.rows(self.sampler.next_indices())


def cache_root() -> Path:
    return Path(os.environ.get("XRAY_CACHE", Path.home() / ".cache" / "xray"))


def builtin_spec():
    from xray.data.tokenizer import VOCAB_SIZE
    from xray.models.tiny import TinySpec

    return TinySpec(vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_layers=2,
                    num_heads=4, num_kv_heads=2, max_position_embeddings=128)


def warm_start_key(cfg: RunConfig, train_backend: str) -> str:
    shaping = {"spec": to_dict(builtin_spec()), "sft": to_dict(cfg.sft), "seed": cfg.seed,
               "data": cfg.data.path, "eval_size": cfg.data.eval_size, "backend": train_backend,
               "actor": {"micro": cfg.actor.micro_batch_size, "tp": cfg.actor.tp, "pp": cfg.actor.pp,
                         "dp": cfg.actor.dp}, "version": 1}
    return hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()[:16]


def build_builtin_model(cfg: RunConfig, plan: Plan, run: RunDir, ray_address: str | None) -> Path:
    """The warm-started tiny model (cached)."""
    from algorithms.sft import answer_pairs, run_sft
    from xray.config.plan import plan_run

    train_backend = plan.backend.split("-")[0]
    target = cache_root() / "builtin" / f"tiny-llama-sft-{warm_start_key(cfg, train_backend)}"
    if (target / "model.safetensors").is_file():
        log.info("warm-started model from cache: %s", target)
        return target
    base = build_base_model(cfg, run)
    tokenizer = load_tokenizer(str(base))
    train, _ = load_prompt_splits(cfg.data, tokenizer, run.path / "data")
    pairs = answer_pairs(train.prompt_ids, train.extras[cfg.data.answer_field], tokenizer)
    log.info("warm start: %d supervised steps on %d prompts", cfg.sft.steps, len(pairs))
    sft_dir = RunDir(run.path / "warm-start")
    out = run_sft(cfg, plan_run(cfg, plan.backend, "sft"), pairs, str(base), sft_dir, tokenizer.pad_token_id or 0,
                  ray_address)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (base / name).is_file() and not (out / name).is_file():
            shutil.copy(base / name, out / name)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(out, tmp)
    tmp.replace(target)
    return target


def build_base_model(cfg: RunConfig, run: RunDir) -> Path:
    """The seeded tiny Llama with the character tokenizer, before any training."""
    from xray.data.tokenizer import save_char_tokenizer
    from xray.models.tiny import build_tiny_model

    base = run.path / "base-model"
    build_tiny_model(base, builtin_spec(), seed=cfg.seed)
    save_char_tokenizer(base)
    return base


def load_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as exc:
        raise FileNotFoundError(f"no usable tokenizer in {model_dir} ({str(exc).splitlines()[0]}); save the "
                                "model's tokenizer into its directory (tokenizer.save_pretrained(dir))") from None


def prepare(cfg: RunConfig, plan: Plan, run: RunDir, ray_address: str | None) -> RunData:
    """Model directory (warm-started if built in), tokenizer, prompts, sampler and reward."""
    if cfg.model.path == BUILTIN_MODEL:
        model_dir = str(build_builtin_model(cfg, plan, run, ray_address))
    else:
        model_dir = cfg.model.path
        if not Path(model_dir, "config.json").is_file():
            raise FileNotFoundError(f"model.path {model_dir!r} is not a Hugging Face model directory "
                                    f"(no config.json); give a local directory or {BUILTIN_MODEL}")
    tokenizer = load_tokenizer(model_dir)
    train, held_out = load_prompt_splits(cfg.data, tokenizer, run.path / "data")
    reward_fn = cfg.reward.function
    scorer = RewardScorer(reward_fn, tokenizer, cfg.reward.on_nonfinite) if reward_fn else None
    sampler = PromptSampler(len(train), cfg.ppo.rollout_batch_size, cfg.seed)
    return RunData(model_dir, tokenizer, train, held_out, sampler, scorer)
