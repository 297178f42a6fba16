"""The distill job (`python -m xray.train distill`): supervised fine-tuning on a sampled dataset.

ms-swift's distillation is sampling (a strong sampler's best responses, `algorithms/sample.py`)
followed by fine-tuning a model on them. Here the second half: the rows of `distill.dataset` (the
file `xray.train sample` wrote; any JSONL/Parquet with a prompt and a response column) become
(prompt ids, response ids + EOS) pairs, and the actor role learns them with the SFT path
(`algorithms/sft.py`: `sft.steps` steps of `sft.batch_size` pairs at `sft.lr`) on either
training backend, starting from `model.path` (the built-in model: its warm start, which is what a
default sample run sampled from: rejection-sampling fine-tuning). The result is
`final/actor`, a Hugging Face directory every role loads.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from algorithms.specs import command_spec
from xray.config.plan import Plan, plan_run
from xray.config.schema import RunConfig
from xray.config.typed import ConfigError
from xray.run.outputs import RunDir


@dataclass(frozen=True)
class DistillResult:
    model: Path
    rows: int
    loss_first: float
    """The first step's loss."""
    loss_last: float
    """The mean loss of the last 10% of the steps."""


def check_dataset(cfg: RunConfig) -> None:
    """`distill.dataset` names a file (checked before any model is built)."""
    if not cfg.distill.dataset:
        raise ConfigError("distill.dataset is not set; pass --distill.dataset=FILE, the dataset "
                          "`python -m xray.train sample` wrote (sample.output_file in its output directory)")
    if not Path(cfg.distill.dataset).exists():
        raise FileNotFoundError(f"distill.dataset {cfg.distill.dataset!r} does not exist; run `python -m xray.train "
                                "sample` first, or give the path of its sample.output_file")


def distill_pairs(cfg: RunConfig, tokenizer) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids + EOS) of every row of `distill.dataset` with a response."""
    from xray.data.chat import ChatFormat
    from xray.data.prompts import PromptDataError, load_prompts
    from xray.data.supervised import target_ids

    d = cfg.distill
    rows = load_prompts(d.dataset, tokenizer, cfg.data.prompt_field, cfg.data.max_prompt_tokens,
                        cfg.data.on_long_prompt, ChatFormat.of(cfg.data))
    if d.response_field not in rows.extras:
        raise PromptDataError(f"{d.dataset} has no {d.response_field!r} column (it has {sorted(rows.extras)}); "
                              "set distill.response_field")
    pairs = [(p, target_ids(r, tokenizer)) for p, r in zip(rows.prompt_ids, rows.extras[d.response_field])
             if r is not None]
    if not pairs:
        raise PromptDataError(f"{d.dataset} has no row with a {d.response_field!r} to learn from")
    return pairs


def distill_command(cfg: RunConfig, plan: Plan, output_dir: Path, ray_address: Optional[str]) -> DistillResult:
    """Fine-tune `model.path` on `distill.dataset`."""
    from algorithms.sft import run_sft
    from xray.config.typed import to_dict
    from algorithms.warm_start import model_dir as resolve_model
    from xray.run.inputs import load_tokenizer

    check_dataset(cfg)
    run = RunDir(output_dir, cfg.trainer.loggers)
    run.write_config(to_dict(cfg))
    with run:  # the loggers close, told whether the job failed
        model_dir = resolve_model(cfg, plan, run, ray_address)
        tokenizer = load_tokenizer(model_dir)
        pairs = distill_pairs(cfg, tokenizer)
        losses: list[float] = []
        final = run_sft(cfg, plan_run(cfg, plan.backend, command_spec("sft")), pairs, model_dir, run, tokenizer.pad_token_id or 0,
                        ray_address, losses)
        tail = losses[-max(1, len(losses) // 10):]
        return DistillResult(final, len(pairs), losses[0], sum(tail) / len(tail))
