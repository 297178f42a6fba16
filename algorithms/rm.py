"""Reward-model training on pairwise preferences (`python -m xray.train rm`): Bradley-Terry.

The `critic` role (a transformer trunk with a scalar head, on either training backend) scores each
prompt + response at its last real token, and learns `loss = -log sigmoid(r_chosen - r_rejected)`
over `rm.batch_size` pairs a step. The pairs travel interleaved (chosen, rejected, chosen, ...),
so every micro-batch holds whole pairs. Data: any prompt file with `rm.chosen_field` and
`rm.rejected_field` columns; a built-in task makes its pairs itself (the right answer over a
seeded wrong one). The result is written as a Hugging Face `LlamaForSequenceClassification`
directory with one label and the tokenizer's pad id: the `reward` role (`reward.model`) loads it
as it is and scores the last real token the same way.
"""
from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from tqdm import tqdm

from xray.backends.hf_dir import save_hf_model
from xray.builtin.tasks import is_builtin
from xray.config.plan import Plan
from xray.config.schema import RunConfig
from xray.data import columns as C
from xray.data.batch import Batch
from xray.data.sequences import pack_sequences
from xray.run.outputs import RunDir
from xray.data.supervised import target_ids
from xray.run.console import progress_shown

log = logging.getLogger(__name__)
LAST = "last_index"
"""[B] long: the position of each row's last real token (its score is the value there)."""
Pair = tuple[list[int], list[int], list[int]]
"""(prompt ids, chosen ids + EOS, rejected ids + EOS)."""


def last_values(values: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """Each row's value at its last real token: `[B, T-1]`, `[B]` -> `[B]`."""
    return values.gather(1, last.long()[:, None]).squeeze(1)


@dataclass(frozen=True)
class PairwiseLoss:
    """The reward model's `LossFn` (Bradley-Terry): rows 2i and 2i+1 are a chosen and a rejected
    response. Reports the loss, the share of pairs ranked right and the mean margin."""

    reads: ClassVar[tuple[str, ...]] = (LAST,)

    def __call__(self, outputs: dict[str, torch.Tensor], batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        scores = last_values(outputs[C.VALUES], batch[LAST])
        margin = scores[0::2] - scores[1::2]
        loss = -F.logsigmoid(margin).mean()
        return loss, {"rm_loss": float(loss.detach()), "rm_accuracy": float((margin > 0).float().mean()),
                      "rm_margin": float(margin.mean().detach())}


def pair_batch(pairs: list[Pair], pad_id: int) -> Batch:
    """The pairs as interleaved rows with one column of padding more than the longest (VALUES
    stop one position short of the last), and LAST."""
    prompts = [p for p, _, _ in pairs for _ in range(2)]
    responses = [r for _, chosen, rejected in pairs for r in (chosen, rejected)]
    packed = pack_sequences(prompts, responses, pad_id)
    ids, attn = packed[C.INPUT_IDS], packed[C.ATTENTION_MASK]
    ids = torch.cat([ids, torch.full((len(ids), 1), pad_id, dtype=ids.dtype)], dim=1)
    attn = torch.cat([attn, torch.zeros(len(attn), 1, dtype=attn.dtype)], dim=1)
    return Batch({C.INPUT_IDS: ids, C.ATTENTION_MASK: attn, LAST: attn.sum(1) - 1})


def builtin_pairs(prompt_ids: list[list[int]], answers: list, tokenizer, seed: int) -> list[Pair]:
    """A built-in task's pairs: its answer over a seeded wrong one (off by 1 to 9, or with its
    digits swapped), so the model must read the prompt to rank them."""
    rng, pairs = random.Random(seed), []
    for p, a in zip(prompt_ids, answers):
        right = int(a)
        wrong = right + rng.choice([d for d in range(-9, 10) if d and right + d >= 0])
        if rng.random() < 0.3 and len(str(right)) > 1 and str(right)[::-1] != str(right):
            wrong = int(str(right)[::-1])
        pairs.append((p, target_ids(right, tokenizer), target_ids(wrong, tokenizer)))
    return pairs


def preference_pairs(cfg: RunConfig, prompts, tokenizer) -> list[Pair]:
    """The pairs of a prompt set: its chosen/rejected columns, or a built-in task's own."""
    f = cfg.rm
    if f.chosen_field in prompts.extras and f.rejected_field in prompts.extras:
        return [(p, target_ids(c, tokenizer), target_ids(r, tokenizer))
                for p, c, r in zip(prompts.prompt_ids, prompts.extras[f.chosen_field],
                                   prompts.extras[f.rejected_field])]
    if is_builtin(cfg.data.path):
        return builtin_pairs(prompts.prompt_ids, prompts.extras[cfg.data.answer_field], tokenizer, cfg.seed)
    raise ValueError(f"{cfg.data.path} has no {f.chosen_field!r} and {f.rejected_field!r} columns (it has "
                     f"{sorted(prompts.extras)}); set rm.chosen_field and rm.rejected_field")


def accuracy(critic, pairs: list[Pair], pad_id: int) -> float:
    """Share of `pairs` whose chosen response the model scores above the rejected one."""
    batch = pair_batch(pairs, pad_id)
    scores = last_values(critic.forward(batch).get()[C.VALUES], batch[LAST])
    return float((scores[0::2] > scores[1::2]).float().mean())


def export_reward_model(state: dict[str, torch.Tensor], model_dir: str, target: Path, pad_id: int) -> Path:
    """Write the trained critic as a `LlamaForSequenceClassification` directory (one label). The
    DeepSpeed critic's head is `value_head` with a bias; Bradley-Terry never moves the bias (it
    cancels in every margin), so it stays 0 and the head is `score.weight` alone, as Megatron's."""
    state = dict(state)
    if "value_head.weight" in state:
        bias = state.pop("value_head.bias")
        if float(bias.abs().max()) > 1e-6:
            raise ValueError(f"the value head's bias is {float(bias.flatten()[0])}; a reward model export has none")
        state["score.weight"] = state.pop("value_head.weight")
    out = save_hf_model(state, model_dir, target)
    config = json.loads((out / "config.json").read_text())
    config.update(architectures=["LlamaForSequenceClassification"], num_labels=1, pad_token_id=pad_id,
                  id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    config.pop("tie_word_embeddings", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def run_rm(cfg: RunConfig, plan: Plan, train: list[Pair], held_out: list[Pair], model_dir: str, run: RunDir,
           pad_id: int, ray_address: str | None) -> tuple[Path, float, float]:
    """Train the critic role on `train`; (export directory, held-out accuracy before, after)."""
    from algorithms.sft import started_role

    with started_role(cfg, plan, "critic", model_dir, ray_address, cfg.rm.lr, cfg.rm.steps) as critic:
        before = accuracy(critic, held_out, pad_id)
        bar = tqdm(range(1, cfg.rm.steps + 1), desc="rm", unit="step", mininterval=2.0, disable=not progress_shown())
        for step in bar:
            t0 = time.perf_counter()
            g = random.Random(cfg.seed * 1000003 + step)
            batch = pair_batch([train[g.randrange(len(train))] for _ in range(cfg.rm.batch_size)], pad_id)
            metrics = critic.train_step(batch, PairwiseLoss(), cfg.critic.micro_batch_size).get()
            metrics["time/step_s"] = time.perf_counter() - t0
            bar.set_postfix(loss=f"{metrics['rm_loss']:.3f}", acc=f"{metrics['rm_accuracy']:.2f}", refresh=False)
            if step % cfg.trainer.log_every == 0 or step == cfg.rm.steps:
                run.log_metrics(step, metrics)
        after = accuracy(critic, held_out, pad_id)
        state = critic.state_dict().get()
    return export_reward_model(state, model_dir, run.path / "final" / "reward_model", pad_id), before, after


def rm_command(cfg: RunConfig, plan: Plan, output_dir: Path, ray_address: str | None) -> tuple[Path, float, float]:
    """`python -m xray.train rm`: train a reward model from `model.path` on the data's pairs."""
    from xray.builtin.sources import load_prompt_splits
    from xray.config.typed import to_dict
    from algorithms.warm_start import model_dir as resolve_model
    from xray.run.inputs import load_tokenizer

    run = RunDir(output_dir, cfg.trainer.loggers)
    run.write_config(to_dict(cfg))
    with run:  # the loggers close, told whether the job failed
        model_dir = resolve_model(cfg, plan, run, ray_address)
        tokenizer = load_tokenizer(model_dir)
        train, held_out = load_prompt_splits(cfg.data, tokenizer, run.path / "data")
        pad_id = tokenizer.pad_token_id or 0
        out, before, after = run_rm(cfg, plan, preference_pairs(cfg, train, tokenizer),
                                    preference_pairs(cfg, held_out, tokenizer), model_dir, run, pad_id, ray_address)
        log.info("reward model: held-out pair accuracy %.3f -> %.3f; written to %s", before, after, out)
        return out, before, after
