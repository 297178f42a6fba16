"""Length-grouped micro-batches through the real engines: a train step in micro-batches of 2
(grouped by length, trimmed where there is no pipeline) reports the loss and gradient norm of
the same step taken as one micro-batch, on Megatron tp=2 and pp=2 (untrimmed: one activation
shape per pipeline) and DeepSpeed ZeRO-3 dp=2. The unit tests (`tests/unit/test_length_groups.py`)
show the arithmetic; these show that the engines run micro-batches of different widths and
accumulate them as the arithmetic assumes. On ZeRO-3 dp=2, a mini-batch carrying its totals
(`with_totals`) takes the same step with its rows as they come and as `balanced_rows` assigns them
to the replicas. A token budget (`max_tokens_per_micro_batch`, micro-batches of 1 to 2 rows, the
ZeRO-3 ranks agreeing on one count) and packed micro-batches (`packing`, rows packed under a budget
of their summed tokens) each take the same step, and their forwards (packed: with and without a
budget) give the padded forward's log-probs (1e-5), on Megatron tp=2 and ZeRO-3 dp=2."""
from __future__ import annotations

import pytest
import torch

from tests.dist_harness import run_distributed
from xray.backends.base import OptimConfig
from xray.builtin.tiny_llama import TinySpec, build_tiny_model
from xray.config.parallel import ParallelDims
from xray.data import columns as C
from xray.data.batch import Batch

pytestmark = pytest.mark.backends

LENGTHS = [24, 9, 17, 5, 24, 12, 7, 20]  # real tokens per row, 24 wide
OPTIM = OptimConfig(lr=1e-5)
BUDGET = 20  # ZeRO-3's slices: (24)(17)(9 5) and (24)(20)(12)(7): the first splits to 4 as well
CUTS = {"budget": {"max_tokens_per_micro_batch": BUDGET},
        # packed, 30 tokens: (24 5)(17 9) and (24)(20 7)(12): the first splits to 3
        "packed": {"max_tokens_per_micro_batch": 30, "packing": True}}


def _forward_gaps(engine, part: Batch, cut: dict) -> dict[str, float]:
    """The largest log-prob gap at real tokens between the engine's forward as `cut` builds it
    (and, packed, without a budget) and the padded forward; {} on a rank that does not collect."""
    runs = {"": dict(cut), "_unbudgeted": {**cut, "max_tokens_per_micro_batch": None}} if cut.get("packing") \
        else {"": dict(cut)}
    runs["padded"] = {"max_tokens_per_micro_batch": None, "packing": False}
    got = {}
    for name, how in runs.items():
        engine.max_tokens, engine.packing = how["max_tokens_per_micro_batch"], how.get("packing", False)
        got[name] = engine.forward(part)
    engine.max_tokens, engine.packing = cut["max_tokens_per_micro_batch"], cut.get("packing", False)
    if got["padded"] is None:  # Megatron: the first rank of the tensor-parallel group collects
        return {}
    real = part[C.ATTENTION_MASK][:, 1:].bool()
    return {name: float((out[C.LOGPROBS] - got["padded"][C.LOGPROBS])[real].abs().max())
            for name, out in got.items() if name != "padded"}


def _batch() -> Batch:
    g = torch.Generator().manual_seed(5)
    n, width = len(LENGTHS), max(LENGTHS)
    attn = torch.zeros(n, width, dtype=torch.long)
    for i, length in enumerate(LENGTHS):
        attn[i, :length] = 1
    loss_mask = attn[:, 1:].clone().float()
    loss_mask[:, :3] = 0
    return Batch({C.INPUT_IDS: torch.randint(3, 200, (n, width), generator=g) * attn, C.ATTENTION_MASK: attn,
                  C.LOSS_MASK: loss_mask, C.ADVANTAGES: torch.randn(n, width - 1, generator=g)})


def _steps(rank, world_size, model_dir, backend, dims):
    from algorithms.core.policy_loss import PolicyLoss

    parallel = ParallelDims(*dims)
    loss = PolicyLoss(on_policy=True)  # the policy gradient, -A grad log p, token-mean over the slice
    from xray.run.minibatches import balanced_rows
    from xray.data.lengths import with_totals

    out = {}
    whole = _batch()
    variants = [(2, whole, False), (None, whole, False)] + [(c, whole, False) for c in CUTS if parallel.pp == 1]
    if parallel.dp > 1:  # the mini-batch's totals, its rows as they come and as balanced over the replicas
        variants += [("totals", whole, True),
                     ("balanced", whole.index(balanced_rows(whole, torch.arange(len(whole)), parallel.dp)), True)]
    for micro, batch, totals in variants:
        budget = CUTS.get(micro, {})
        if backend == "megatron":
            from megatron.core import parallel_state

            from xray.backends.megatron import build_engine
            engine = build_engine(model_dir, parallel, "actor", OPTIM, seed=0, **budget)
        else:
            from xray.backends.deepspeed.engine import build_engine
            engine = build_engine(model_dir, parallel, "actor", OPTIM, seed=0, zero_stage=3, **budget)
        part = (with_totals(batch) if totals else batch).split(parallel.dp)[engine.shard_info().dp_rank]
        if budget:  # the budgeted (packed) forward against the padded one, on the same weights
            out.update({f"{micro}{name}_gap": gap for name, gap in _forward_gaps(engine, part, budget).items()})
        metrics = engine.train_step(part, loss, 2 if totals or budget else micro or len(part))
        out[micro or "whole"] = (metrics["loss"], metrics["grad_norm"])
        if backend == "megatron":
            parallel_state.destroy_model_parallel()
    return out


@pytest.mark.parametrize("backend,dims", [("megatron", (2, 1, 1)), ("megatron", (1, 2, 1)),
                                          ("deepspeed", (1, 1, 2))],
                         ids=["megatron-tp2", "megatron-pp2", "deepspeed-zero3-dp2"])
def test_grouped_micro_batches_take_the_whole_slices_step(tmp_path, backend, dims):
    model_dir = str(build_tiny_model(tmp_path / "m", TinySpec(), seed=0))
    ranks = run_distributed(_steps, 2, model_dir, backend, dims)
    gaps = ["budget_gap", "packed_gap", "packed_unbudgeted_gap"]
    assert dims[1] > 1 or any(all(g in rank for g in gaps) for rank in ranks)
    for rank in ranks:
        (loss, norm), (whole_loss, whole_norm) = rank[2], rank["whole"]
        assert whole_norm > 0 and abs(whole_loss) > 1e-4
        assert loss == pytest.approx(whole_loss, rel=1e-5, abs=1e-7)
        assert norm == pytest.approx(whole_norm, rel=1e-5)
        if dims[1] == 1:  # the token budget and packing: the same step, and the padded forward's log-probs
            for cut in CUTS:
                assert rank[cut][0] == pytest.approx(whole_loss, rel=1e-5, abs=1e-7), cut
                assert rank[cut][1] == pytest.approx(whole_norm, rel=1e-5), cut
            assert all(rank.get(g, 0.0) <= 1e-5 for g in gaps), {g: rank.get(g) for g in gaps}
        if backend == "deepspeed":  # the replicas' tokens differ (55 and 63): with the mini-batch's totals, the
            # step is its mean whichever replica holds which row; each slice's own mean is another step
            (loss_t, norm_t), (loss_b, norm_b) = rank["totals"], rank["balanced"]
            assert loss_b == pytest.approx(loss_t, rel=1e-5, abs=1e-7) and norm_b == pytest.approx(norm_t, rel=1e-5)
            assert abs(norm_t - whole_norm) > 1e-4 * whole_norm  # 10x the parity tolerance above
