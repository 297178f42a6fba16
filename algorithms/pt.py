"""Continued pre-training (`python -m xray.train pt`): next-token loss on plain text, on the same
engine and with the same outputs as `sft` (`algorithms.sft`: the actor WholeModel alone, metrics,
loggers, a Hugging Face directory at `final/actor`).

The text (`xray.data.text`) is packed into chunks of `pt.seq_len` tokens; a chunk trains on every
token after its first (the first has nothing before it to be predicted from), so a chunk is a
(first token, rest) pair to the supervised loop. The held-out documents' loss is measured before
and after training.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from xray.config.plan import Plan
from xray.config.schema import RunConfig
from xray.run.outputs import RunDir

log = logging.getLogger(__name__)
MAX_EVAL_CHUNKS = 256
"""Held-out chunks scored before and after (the first ones), to bound the evaluation's cost."""


@dataclass(frozen=True)
class PTResult:
    model: Path
    chunks: int
    """Training chunks of `pt.seq_len` tokens."""
    loss_first: float
    loss_last: float
    eval_loss_before: float
    """Held-out loss per token before training (NaN when nothing is held out)."""
    eval_loss_after: float


def chunk_pairs(chunks: list[list[int]]) -> list[tuple[list[int], list[int]]]:
    """A chunk as the supervised loop's (prompt, target): its first token, then the rest."""
    return [(c[:1], c[1:]) for c in chunks]


def pt_command(cfg: RunConfig, plan: Plan, output_dir: Path, ray_address: Optional[str]) -> PTResult:
    """Continue pre-training `model.path` (or the built-in tiny Llama, untrained) on `data.path`."""
    from algorithms.sft import run_sft
    from xray.builtin.sources import read_documents
    from xray.builtin.tiny_llama import BUILTIN_MODEL, build_base_model
    from xray.config.typed import to_dict
    from xray.data.text import TextDataError, pack_documents, split_documents
    from xray.run.inputs import load_tokenizer, model_directory

    run = RunDir(output_dir, cfg.trainer.loggers)
    run.write_config(to_dict(cfg))
    with run:  # the loggers close, told whether the job failed
        model_dir = (str(build_base_model(run.path / "base-model", cfg.seed)) if cfg.model.path == BUILTIN_MODEL
                     else model_directory(cfg.model.path))
        tokenizer = load_tokenizer(model_dir)
        docs = read_documents(cfg.data.path, cfg.pt.text_field, run.path / "data", cfg.data.eval_size)
        train_docs, eval_docs = split_documents(docs, cfg.pt.eval_fraction, cfg.seed)
        chunks = pack_documents(train_docs, tokenizer, cfg.pt.seq_len)
        if not chunks:
            raise TextDataError(f"the training text ({len(train_docs)} documents) makes no chunk of "
                                f"pt.seq_len={cfg.pt.seq_len} tokens; lower pt.seq_len or give more text")
        held_out = chunk_pairs(pack_documents(eval_docs, tokenizer, cfg.pt.seq_len)[:MAX_EVAL_CHUNKS])
        log.info("pt: %d training chunks of %d tokens from %d documents, %d held-out chunks", len(chunks),
                 cfg.pt.seq_len, len(train_docs), len(held_out))
        losses: list[float] = []
        evals: dict[str, float] = {}
        final = run_sft(cfg, plan, chunk_pairs(chunks), model_dir, run, tokenizer.pad_token_id or 0, ray_address,
                        losses, held_out, evals)
    return PTResult(final, len(chunks), losses[0], losses[-1], evals.get("before", math.nan),
                    evals.get("after", math.nan))
