"""The default job's model: the built-in tiny Llama, warm-started by supervised fine-tuning.

`model.path: builtin:tiny-llama` names a seeded tiny Llama (`xray.builtin.tiny_llama`) that this
module fine-tunes on the built-in task's answers, or a tool-use task's demonstrations (`algorithms.sft`,
on the run's own training backend) so that RL starts from a model that is sometimes right. The result is cached under
`~/.cache/xray/builtin/<key>` (or `$XRAY_CACHE`), keyed by everything that shapes it, so later
runs skip the warm start. Every command resolves `model.path` through `model_dir` here.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

from algorithms.specs import command_spec
from xray.builtin.sources import load_prompt_splits
from xray.builtin.tasks import get_task, is_builtin
from xray.builtin.tiny_llama import (BUILTIN_MODEL, TEACHER_MODEL, TinySpec, build_base_model, builtin_spec,
                                     teacher_spec)
from xray.config.env import EnvConfig
from xray.config.plan import Plan, plan_run
from xray.config.schema import RunConfig
from xray.config.typed import to_dict
from xray.data.chat import ChatFormat
from xray.run.inputs import load_tokenizer, model_directory
from xray.run.outputs import RunDir

log = logging.getLogger(__name__)


def cache_root() -> Path:
    return Path(os.environ.get("XRAY_CACHE", Path.home() / ".cache" / "xray"))


def warm_start_key(cfg: RunConfig, train_backend: str, spec: TinySpec | None = None) -> str:
    shaping = {"spec": to_dict(spec or builtin_spec()), "sft": to_dict(cfg.sft), "seed": cfg.seed,
               "data": cfg.data.path, "eval_size": cfg.data.eval_size, "backend": train_backend,
               "actor": {"micro": cfg.actor.micro_batch_size, "tp": cfg.actor.tp, "pp": cfg.actor.pp,
                         "dp": cfg.actor.dp}, "version": 1}
    if not is_builtin(cfg.data.path):  # which rows are held out of a user's data shapes it too
        shaping["data_rows"] = {k: getattr(cfg.data, k) for k in ("split", "eval_path", "eval_split", "eval_seed")}
    task = get_task(cfg.data.path) if is_builtin(cfg.data.path) else None
    if hasattr(task, "demonstrations"):  # what its demonstrations are made of shapes it too
        shaping["task"] = repr(task)
        if ChatFormat.of(cfg.data) != ChatFormat():  # and the chat format they are written in
            shaping["chat"] = repr(ChatFormat.of(cfg.data))
    return hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()[:16]


def model_dir(cfg: RunConfig, plan: Plan, run: RunDir, ray_address: str | None) -> str:
    """The directory a run starts from: `model.path`, or the built-in model warm-started."""
    if cfg.model.path == BUILTIN_MODEL:
        return str(build_builtin_model(cfg, plan, run, ray_address))
    return model_directory(cfg.model.path)


def with_teacher_dir(cfg: RunConfig, plan: Plan, run: RunDir, ray_address: str | None) -> RunConfig:
    """`cfg` with `teacher.model_path` a directory: `builtin:tiny-llama-teacher` is the larger built-in
    model (`teacher_spec`) warm-started as the student is, three times as many steps (cached)."""
    path = cfg.teacher.model_path
    if not path:
        return cfg
    if path == TEACHER_MODEL:
        longer = dataclasses.replace(cfg, sft=dataclasses.replace(cfg.sft, steps=3 * cfg.sft.steps))
        directory = str(build_builtin_model(longer, plan, run, ray_address, teacher_spec(), "tiny-llama-teacher"))
    else:
        directory = model_directory(path)
    return dataclasses.replace(cfg, teacher=dataclasses.replace(cfg.teacher, model_path=directory))


def warm_start_config(cfg: RunConfig) -> RunConfig:
    """The run's config as its warm start trains with it: every weight (no LoRA), at the built-in
    constant rate after its warm-up (the run's own lr schedule is not in the cache key), no
    episodes, on the actor's group at its configured size (the run's `elasticity` blocks size the
    run's batches, not the warm start's `sft.batch_size`), and as a job of seconds, cached: no
    snapshots, checkpoints, standby processes or restarts."""
    constant = dataclasses.replace(cfg.actor.optim, lr_schedule="constant", min_lr=0.0, decay_steps=None)
    quiet = dataclasses.replace(cfg.trainer, save_every=0, memory_snapshots=False, standby_workhorses=0,
                                max_restarts=0)
    fixed = {role: dataclasses.replace(getattr(cfg, role), elasticity=None) for role in ("critic", "reference", "teacher")}
    return dataclasses.replace(cfg, actor=dataclasses.replace(cfg.actor, lora=None, optim=constant, elasticity=None),
                               env=EnvConfig(), trainer=quiet, **fixed)


def build_builtin_model(cfg: RunConfig, plan: Plan, run: RunDir, ray_address: str | None,
                        spec: TinySpec | None = None, name: str = "tiny-llama") -> Path:
    """The warm-started tiny model (`spec`: another than the built-in student; cached)."""
    from algorithms.sft import answer_pairs, run_sft

    train_backend = plan.backend.split("-")[0]
    target = cache_root() / "builtin" / f"{name}-sft-{warm_start_key(cfg, train_backend, spec)}"
    if (target / "model.safetensors").is_file():
        log.info("warm-started model from cache: %s", target)
        return target
    cfg = warm_start_config(cfg)
    base = build_base_model(run.path / ("base-model" if spec is None else f"{name}-base"), cfg.seed, spec)
    tokenizer = load_tokenizer(str(base))
    train, _ = load_prompt_splits(cfg.data, tokenizer, run.path / "data")
    task = get_task(cfg.data.path) if is_builtin(cfg.data.path) else None
    if hasattr(task, "demonstrations"):  # a tool-use task: whole episodes, the model's turns trained
        pairs = task.demonstrations(train.prompts, train.extras, tokenizer, ChatFormat.of(cfg.data))
    else:
        pairs = answer_pairs(train.prompt_ids, train.extras[cfg.data.answer_field], tokenizer)
    log.info("warm start: %d supervised steps on %d prompts", cfg.sft.steps, len(pairs))
    sft_dir = RunDir(run.path / ("warm-start" if spec is None else f"{name}-warm-start"))
    out = run_sft(cfg, plan_run(cfg, plan.backend, command_spec("sft")), pairs, str(base), sft_dir, tokenizer.pad_token_id or 0,
                  ray_address)
    for file in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (base / file).is_file() and not (out / file).is_file():
            shutil.copy(base / file, out / file)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(out, tmp)
    tmp.replace(target)
    return target
