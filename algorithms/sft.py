"""Supervised fine-tuning on (prompt, answer) token pairs or conversations, on the same engine as PPO.

`python -m xray.train sft` and the built-in model's warm start use it: the actor WholeModel (any
training backend) takes `sft.steps` optimizer steps of next-token loss on the answer tokens (a
conversation's assistant turns: `xray.data.conversation`), then
its full weights are written as a Hugging Face directory that every role (and vLLM) can load.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from tqdm import tqdm

from xray.config.data import DataConfig
from xray.config.optim import OptimConfig
from xray.config.plan import Plan
from xray.config.schema import RunConfig
from xray.data import columns as C
from xray.data.batch import Batch
from xray.data.files import Rows
from xray.data.sequences import pack_sequences
from xray.run.outputs import RunDir
from xray.data.supervised import SFTLoss, target_ids
from xray.run.console import progress_shown
from xray.run.final import export_actor

log = logging.getLogger(__name__)


def sft_rows(pairs: list[tuple[list[int], list[int]]], batch_size: int, step: int, seed: int,
             pad_id: int) -> Batch:
    """A seeded random batch of (prompt ids, target ids) pairs as training tensors; a pair may
    carry a third entry, the target's loss mask (a demonstration's tool answers are not trained)."""
    g = torch.Generator().manual_seed(seed * 1000003 + step)
    rows = torch.randint(len(pairs), (batch_size,), generator=g).tolist()
    masks = [pairs[i][2] for i in rows] if len(pairs[0]) > 2 else None
    return pack_sequences([pairs[i][0] for i in rows], [pairs[i][1] for i in rows], pad_id, response_masks=masks)


def job_optim(optim: OptimConfig, lr: float, steps: int, warmup_steps: int) -> OptimConfig:
    """A supervised job's optimizer: the role's settings at the job's peak `lr` and warm-up, its
    lr schedule decaying over the job's `steps` (unless the role sets `optim.decay_steps`)."""
    return dataclasses.replace(optim, lr=lr, warmup_steps=warmup_steps).for_run(steps)


def job_config(cfg: RunConfig, role: str, lr: float, steps: int, warmup_steps: int = 0) -> RunConfig:
    """`cfg` with `role`'s optimizer at a supervised job's peak `lr`, warmed up over `warmup_steps`
    and following the role's `optim.lr_schedule` over the job's `steps` (unless `optim.decay_steps`
    is set)."""
    section = getattr(cfg, role)
    optim = job_optim(section.optim, lr, steps, warmup_steps)
    return dataclasses.replace(cfg, **{role: dataclasses.replace(section, optim=optim)})


@contextmanager
def started_role(cfg: RunConfig, plan: Plan, role: str, model_dir: str, ray_address: str | None, lr: float,
                 steps: int, warmup_steps: int = 0) -> Iterator:
    """One trained role's WholeModel alone, on its device group, with its optimizer set by
    `job_config`; shut down (and its devices freed) on the way out (reward-model training)."""
    from xray.run.models import start_model
    from xray.wholemodel.cluster import ensure_ray
    from xray.wholemodel.placement import reserve_plan

    ensure_ray(ray_address, num_cpus=plan.nproc_per_node * plan.nnodes)
    bundles = reserve_plan(plan, cfg.threads_per_worker)[role]
    model = start_model(job_config(cfg, role, lr, steps, warmup_steps), plan.nproc_per_node, model_dir,
                        plan.role(role), bundles)
    try:
        yield model
    finally:
        model.shutdown()
        bundles.release()


def held_out_loss(actor, pairs: list[tuple[list[int], list[int]]], pad_id: int) -> float:
    """Mean negative log-likelihood of the target tokens of `pairs` under the actor, no update
    (a pair's third entry, when there is one, is its target's loss mask, as in `sft_rows`)."""
    masks = [p[2] for p in pairs] if len(pairs[0]) > 2 else None
    batch = pack_sequences([p[0] for p in pairs], [p[1] for p in pairs], pad_id, response_masks=masks)
    logp = actor.forward(batch).get()[C.LOGPROBS]
    mask = batch[C.LOSS_MASK].to(logp.dtype)
    return float(-(logp * mask).sum() / mask.sum().clamp(min=1.0))


def run_sft(cfg: RunConfig, plan: Plan, pairs: list[tuple[list[int], list[int]]], model_dir: str,
            run: RunDir, pad_id: int, ray_address: str | None = None, losses: list[float] | None = None,
            held_out: list[tuple[list[int], list[int]]] | None = None, evals: dict[str, float] | None = None,
            resume: bool = False) -> Path:
    """Train the actor on `pairs` (`xray/run/supervised.py`: snapshots, checkpoints, recovery and
    elasticity as in an RL run; `resume`: from `run`'s latest checkpoint); return the Hugging Face
    directory of the result, or with `actor.lora` its `peft` adapter directory
    (`xray/run/final.py`; each step's loss is appended to `losses` when given; with `held_out`
    pairs, their loss before and after training goes into `evals` as `before` and `after`)."""
    from xray.run.supervised import SupervisedData, SupervisedTrainer, supervised_models, train_supervised

    job = job_config(cfg, "actor", cfg.sft.lr, cfg.sft.steps, cfg.sft.warmup_steps)
    models = supervised_models(job, plan, model_dir, ray_address)
    try:
        trainer = SupervisedTrainer(job, models, lambda step, rows: sft_rows(pairs, rows, step, cfg.seed, pad_id),
                                    SFTLoss(), cfg.sft.steps)
        if held_out and evals is not None:
            evals["before"] = held_out_loss(models.actor, held_out, pad_id)
        bar = tqdm(total=cfg.sft.steps, desc="sft", unit="step", mininterval=2.0, disable=not progress_shown())

        def on_step(step: int, metrics: dict) -> None:
            if losses is not None:
                losses.append(metrics["sft_loss"])
            bar.update(step - bar.n)
            bar.set_postfix(loss=f"{metrics['sft_loss']:.3f}", refresh=False)
            if step % cfg.trainer.log_every == 0 or step == cfg.sft.steps:
                run.log_metrics(step, metrics)
        with bar:
            asyncio.run(train_supervised(trainer, run, SupervisedData(model_dir), resume, on_step))
        if held_out and evals is not None:
            evals["after"] = held_out_loss(models.actor, held_out, pad_id)
        return export_actor(models.actor, cfg.actor.lora, model_dir, run.path / "final")
    finally:
        models.shutdown()


def answer_pairs(prompt_ids: list[list[int]], answers: list, tokenizer) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids + EOS) pairs: the model learns the answer and to stop after it."""
    return [(p, target_ids(a, tokenizer)) for p, a in zip(prompt_ids, answers)]


def supervised_pairs(rows: Rows, data: DataConfig, tokenizer) -> list[tuple]:
    """What SFT trains on: conversations' (prompt ids, response ids, loss mask), their assistant
    turns trained (`xray.data.conversation`); else plain rows' (prompt ids, answer ids + EOS)."""
    from xray.data.chat import ChatFormat
    from xray.data.conversation import conversation_pairs
    from xray.data.prompts import load_prompts

    triples = conversation_pairs(rows, tokenizer, data)
    if triples is not None:
        return triples
    prompts = load_prompts(rows, tokenizer, prompt_field=data.prompt_field, max_prompt_tokens=data.max_prompt_tokens,
                           on_long_prompt=data.on_long_prompt, chat=ChatFormat.of(data))
    if data.answer_field not in prompts.extras:
        raise ValueError(f"the data has no {data.answer_field!r} column for supervised targets, nor a "
                         f"{data.messages_field!r} column of conversations; set data.answer_field (or "
                         f"data.messages_field) to one of {sorted(prompts.extras)}")
    return answer_pairs(prompts.prompt_ids, prompts.extras[data.answer_field], tokenizer)


def sft_command(cfg: RunConfig, plan: Plan, output_dir: Path, ray_address: str | None,
                resume: str | None = None) -> Path:
    """`python -m xray.train sft`: fine-tune `model.path` on the data's (prompt, answer) rows or
    conversations (`supervised_pairs`); `--resume [DIR]` goes on from the latest checkpoint of the
    run (`output_dir`, or DIR)."""
    from xray.builtin.sources import load_row_splits
    from xray.builtin.tiny_llama import BUILTIN_MODEL, build_base_model
    from xray.run.inputs import load_tokenizer

    from xray.config.typed import to_dict
    from xray.run.supervised import job_dir

    run = RunDir(job_dir(output_dir, resume), cfg.trainer.loggers)

    run.write_config(to_dict(cfg))
    model_dir = str(build_base_model(run.path / "base-model", cfg.seed)) if cfg.model.path == BUILTIN_MODEL else cfg.model.path
    tokenizer = load_tokenizer(model_dir)
    train, _ = load_row_splits(cfg.data, run.path / "data")
    pairs = supervised_pairs(train, cfg.data, tokenizer)
    with run:  # the loggers close, told whether the job failed
        return run_sft(cfg, plan, pairs, model_dir, run, tokenizer.pad_token_id or 0, ray_address,
                       resume=resume is not None)
