"""The sample job (`python -m xray.train sample`): best-of-N candidates, scored, written as a dataset.

ms-swift's sampling, with its roles placed by `device_groups` (`configs/sample_tiny_cpu.yaml` is
its example: `sample_group` holds the `sampler`, `rm_group` the `prm` and `orm`):
1. the `sampler`, a generation WholeModel (vLLM or DeepSpeed-Inference, laid out and sampling as
   the `rollout` section says), draws `rollout.n_samples` responses to each prompt;
2. the `orm` scores each whole response (the reward model `reward.model`, or the function
   `reward.function` run in a process on the orm's devices), and the optional `prm`
   (`sample.prm_model`) scores each step of each (`algorithms/best_of_n.py` finds the steps);
3. `best_of_n.rank_candidates` ranks one prompt's candidates and keeps the best (or all, scored);
4. the rows are appended to `sample.output_file`.
While one batch of prompts is scored, the sampler already generates the next.

Columns written: the prompt row's own (the prompt under `data.prompt_field`, the others as they
were), then `response`, `score`, `orm_score`, `prm_score` (the weakest step's), `prm_steps`,
`candidate` (its index among the N); with `keep: best` also `rejected` and `rejected_score`, with
`keep: all` `rank` and `passed`. `python -m xray.train distill` fine-tunes on the file.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch
from tqdm import tqdm

from algorithms.best_of_n import StepSplitter, padded_ends, rank_candidates, weakest_step
from algorithms.specs import command_spec
from xray.config.plan import Plan, plan_run
from xray.config.schema import RunConfig
from xray.data import columns as C
from xray.data.batch import Batch
from xray.data.records import RecordWriter
from xray.data.stops import stop_token_ids
from xray.run.outputs import RunDir
from xray.run.console import progress_shown

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SampleSummary:
    """What a sample run wrote, and what best-of-N bought."""

    path: Path
    prompts: int
    candidates: int
    rows: int
    prompts_passed: int
    """Prompts with at least one candidate that passed the thresholds."""
    orm_mean: float
    """Mean outcome reward over every candidate (NaN without an orm)."""
    orm_kept: float
    """Mean outcome reward of the rows written (with `keep: best`, the chosen ones)."""


def sampler_model(cfg: RunConfig, plan: Plan, run: RunDir, ray_address: Optional[str]) -> str:
    """The sampler's model directory: `model.path`, or the built-in model warm-started (once, then
    cached) on the sampler's first device before the sampler starts there."""
    from xray.config.placement import DeviceGroup
    from algorithms.warm_start import build_builtin_model
    from xray.run.inputs import BUILTIN_MODEL, model_directory

    if cfg.model.path != BUILTIN_MODEL:
        return model_directory(cfg.model.path)
    first = plan.role("sampler")
    group = DeviceGroup("warm_start", first.device, first.ranks[:1], ("actor",), first.resources)
    warm = dataclasses.replace(cfg, device_groups=dataclasses.replace(cfg.device_groups, groups=(group,)),
                               actor=dataclasses.replace(cfg.actor, tp=1, pp=1, dp=1))
    return str(build_builtin_model(warm, plan_run(warm, plan.backend, command_spec("sft")), run, ray_address))


@contextmanager
def started_models(cfg: RunConfig, plan: Plan, model_dir: str, ray_address: Optional[str]) -> Iterator[dict]:
    """The plan's WholeModels (sampler, prm, orm), started concurrently on their device groups;
    all shut down and their devices freed on the way out, also when one fails to start."""
    from xray.run.models import check_layouts, start_model
    from xray.wholemodel.cluster import ensure_ray
    from xray.wholemodel.placement import release_all, reserve_plan

    check_layouts(cfg, plan, model_dir)
    ensure_ray(ray_address, num_cpus=plan.nproc_per_node * plan.nnodes * cfg.threads_per_worker)
    bundles = reserve_plan(plan, cfg.threads_per_worker)

    def start(r):
        return start_model(cfg, plan.nproc_per_node, model_dir, r, bundles[r.role])

    models, failure = {}, None
    try:
        with ThreadPoolExecutor(max_workers=len(plan.roles)) as pool:
            futures = {r.role: pool.submit(start, r) for r in plan.roles}
        for role, future in futures.items():
            try:
                models[role] = future.result()
            except Exception as exc:  # noqa: BLE001 - the others are shut down below, then it is raised
                failure = failure or exc
        if failure is not None:
            raise failure
        yield models
    finally:
        for model in models.values():
            model.shutdown()
        release_all(list(bundles.values()))


def fitted(model, rows: int):
    """`model`, or its first replica alone when `rows` do not split evenly over all of them."""
    return model.replica(0) if rows % model.parallel.dp else model


class Sampling:
    """Steps 1-4 over the prompt rows, batch by batch."""

    def __init__(self, cfg: RunConfig, models: dict, tokenizer, run: RunDir):
        self.cfg, self.models, self.tokenizer, self.run = cfg, models, tokenizer, run
        self.n, self.pad_id = cfg.rollout.n_samples, tokenizer.pad_token_id or 0
        self.stop_ids = stop_token_ids(tokenizer)  # the tokenizer's directory: the sampler's model
        self.splitter = StepSplitter(tokenizer, cfg.sample.step_separator, self.stop_ids)

    def generate(self, rows: list[dict], call: int):
        from xray.run.phases import rollout_sampling

        sampling = rollout_sampling(self.cfg, self.stop_ids, call)
        return fitted(self.models["sampler"], len(rows)).generate([row["prompt_ids"] for row in rows], sampling,
                                                                   pad_id=self.pad_id)

    def scores(self, rows: list[dict], exp: Batch) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Outcome scores [B] and step scores [B, S] of the candidates (None for an absent role)."""
        from xray.workhorse.function_reward import ROWS
        from xray.workhorse.reward import STEP_ENDS

        responses = [list(r) for r in exp[C.RESPONSE_IDS]]
        model_inputs = {C.INPUT_IDS: exp[C.INPUT_IDS], C.ATTENTION_MASK: exp[C.ATTENTION_MASK]}
        orm = prm = None
        if "orm" in self.models:
            if self.cfg.reward.model:
                batch = Batch(dict(model_inputs))
            else:
                plain = [{k: v for k, v in rows[i // self.n].items() if k != "prompt_ids"} for i in range(len(exp))]
                batch = Batch.from_columns({ROWS: plain, C.RESPONSE_IDS: responses})
            orm = fitted(self.models["orm"], len(batch)).score(batch)
        if "prm" in self.models:
            ends = [self.splitter.ends(len(p), r) for p, r in zip(exp[C.PROMPT_IDS], responses)]
            steps = Batch({**model_inputs, STEP_ENDS: padded_ends(ends)})
            prm = fitted(self.models["prm"], len(steps)).score_steps(steps)
        return (orm.get() if orm is not None else None), (prm.get() if prm is not None else None)

    def records(self, rows: list[dict], exp: Batch, orm, steps) -> tuple[list[dict], list[float], int]:
        """The rows to write for these prompts, the outcome scores of those rows, and how many of
        the prompts had a candidate that passed."""
        s, n = self.cfg.sample, self.n
        texts = self.tokenizer.batch_decode([list(r) for r in exp[C.RESPONSE_IDS]], skip_special_tokens=True)
        prm = weakest_step(steps) if steps is not None else None
        out, kept_orm, passed = [], [], 0
        for p, row in enumerate(rows):
            lo = p * n
            ranking = rank_candidates(None if orm is None else orm[lo:lo + n], None if prm is None else prm[lo:lo + n],
                                      s.orm_weight, s.orm_threshold, s.prm_threshold)
            passed += bool(ranking.passed.any())
            base = {k: v for k, v in row.items() if k not in ("prompt", "prompt_ids")}
            base[self.cfg.data.prompt_field] = row["prompt"]

            def candidate(i: int) -> dict:
                step_scores = [] if steps is None else [float(x) for x in steps[lo + i] if not math.isnan(float(x))]
                return {"response": texts[lo + i], "score": float(ranking.score[i]),
                        "orm_score": None if orm is None else float(orm[lo + i]),
                        "prm_score": None if prm is None else float(prm[lo + i]), "prm_steps": step_scores,
                        "candidate": i}

            if s.keep == "best":
                for chosen, rejected in ranking.best(s.n_best):
                    out.append({**base, **candidate(chosen),
                                "rejected": None if rejected is None else texts[lo + rejected],
                                "rejected_score": None if rejected is None else float(ranking.score[rejected])})
                    kept_orm.append(math.nan if orm is None else float(orm[lo + chosen]))
            else:
                for rank, i in enumerate(ranking.order):
                    out.append({**base, **candidate(i), "rank": rank, "passed": bool(ranking.passed[i])})
                    kept_orm.append(math.nan if orm is None else float(orm[lo + i]))
        return out, kept_orm, passed

    def run_all(self, rows: list[dict]) -> SampleSummary:
        s = self.cfg.sample
        path = Path(s.output_file) if Path(s.output_file).is_absolute() else self.run.path / s.output_file
        chunks = [rows[i:i + s.batch_prompts] for i in range(0, len(rows), s.batch_prompts)]
        writer, all_orm, kept_orm, passed = RecordWriter(path), [], [], 0
        bar = tqdm(total=len(rows), desc="sample", unit="prompt", mininterval=2.0, disable=not progress_shown())
        try:
            pending = self.generate(chunks[0], 0)
            for k, chunk in enumerate(chunks):
                t0 = time.perf_counter()
                exp = pending.get()
                generate_s = time.perf_counter() - t0
                pending = self.generate(chunks[k + 1], k + 1) if k + 1 < len(chunks) else None
                orm, steps = self.scores(chunk, exp)
                records, kept, chunk_passed = self.records(chunk, exp, orm, steps)
                writer.write(records)
                passed += chunk_passed
                if orm is not None:
                    all_orm += [float(x) for x in orm]
                kept_orm += kept
                self.run.log_metrics(k + 1, {"sample/rows": len(records), "sample/orm_mean": _mean(orm),
                                             "sample/orm_kept": _mean(torch.tensor(kept)),
                                             "time/wait_generate_s": generate_s,
                                             "time/score_s": time.perf_counter() - t0 - generate_s})
                bar.update(len(chunk))
            out = writer.close()
        except BaseException:
            writer.abandon()
            raise
        finally:
            bar.close()
        return SampleSummary(out, len(rows), len(rows) * self.n, writer.rows, passed,
                             _mean(torch.tensor(all_orm)), _mean(torch.tensor(kept_orm)))


def _mean(values: Optional[torch.Tensor]) -> float:
    if values is None or not len(values):
        return math.nan
    finite = values[torch.isfinite(values)]
    return float(finite.mean()) if len(finite) else math.nan


def sample_command(cfg: RunConfig, plan: Plan, output_dir: Path, ray_address: Optional[str]) -> SampleSummary:
    """`python -m xray.train sample`: sample, score and choose over the data's training prompts."""
    from xray.builtin.sources import load_prompt_splits
    from xray.config.typed import to_dict
    from xray.run.inputs import load_tokenizer

    run = RunDir(output_dir, cfg.trainer.loggers)
    run.write_config(to_dict(cfg))
    with run:  # the loggers close, told whether the job failed
        model_dir = sampler_model(cfg, plan, run, ray_address)
        tokenizer = load_tokenizer(model_dir)
        train, _ = load_prompt_splits(cfg.data, tokenizer, run.path / "data")
        rows = train.rows()[:cfg.sample.num_prompts or None]
        log.info("sampling %d candidates for each of %d prompts", cfg.rollout.n_samples, len(rows))
        with started_models(cfg, plan, model_dir, ray_address) as models:
            return Sampling(cfg, models, tokenizer, run).run_all(rows)
