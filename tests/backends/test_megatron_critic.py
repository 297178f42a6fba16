"""The Megatron engine as a critic: HF trunk + seeded scalar head, vs a single-process reference.

One spawn at tp=2, pp=2: values vs the HF trunk times the same seeded head, one train step on a
value loss vs the same step in plain torch, and the export (trunk names + `score.weight`).
"""
from __future__ import annotations

import pytest
import torch

from tests.dist_harness import run_distributed
from xray.backends.base import OptimConfig
from xray.backends.optim import build_optimizer
from xray.check import reference as R
from xray.config.parallel import ParallelDims
from xray.data import columns as C
from xray.builtin.tiny_llama import TinySpec, build_tiny_model

pytestmark = pytest.mark.backends

DIMS, SEED, MICRO = (2, 2, 1), 7, 2
OPTIM = OptimConfig()


def _batch():
    batch = R.random_batch(4, 16, TinySpec().vocab_size, seed=5)
    batch[C.RETURNS] = torch.randn(4, 15, generator=torch.Generator().manual_seed(6))
    return batch


def value_loss(outputs, mb):
    mask = mb[C.LOSS_MASK]
    loss = ((outputs[C.VALUES] - mb[C.RETURNS]) ** 2 * mask).sum() / mask.sum()
    return loss, {"value_loss": float(loss.detach())}


def _worker(rank, world_size, model_dir):
    from xray.backends.megatron import build_engine

    engine = build_engine(model_dir, ParallelDims(*DIMS), "critic", OPTIM, seed=SEED)
    out = engine.forward(_batch())
    metrics = engine.train_step(_batch(), value_loss, MICRO)
    after = {n: t.numpy() for b in engine.export_weights() for n, t in b}
    return (None if out is None else out[C.VALUES].numpy()), metrics, after


class RefCritic(torch.nn.Module):
    def __init__(self, model_dir: str, head: torch.Tensor):
        super().__init__()
        self.model = R.load_hf(model_dir).model
        self.score = torch.nn.Linear(head.shape[1], 1, bias=False)
        self.score.weight.data.copy_(head)

    def forward(self, mb) -> torch.Tensor:
        hidden = self.model(input_ids=mb[C.INPUT_IDS], attention_mask=mb[C.ATTENTION_MASK]).last_hidden_state
        return self.score(hidden)[:, :-1, 0]


def test_critic_matches_reference(tmp_path):
    from xray.backends.megatron.model import init_value_head

    model_dir = str(build_tiny_model(tmp_path, TinySpec(), seed=0))
    results = run_distributed(_worker, 4, model_dir)
    head = init_value_head(torch.empty(1, TinySpec().hidden_size), SEED)
    ref = RefCritic(model_dir, head)
    batch = _batch()
    with torch.no_grad():
        values = ref(batch)
    collector = [r for r in results if r[0] is not None]
    assert len(collector) == 1
    got = torch.from_numpy(collector[0][0])
    assert (got - values).abs().max() <= 1e-4 * values.abs().max()

    optimizer = build_optimizer(ref.parameters(), OPTIM)  # warm-up 0: the schedule is constant
    micro = batch.chunks(MICRO)
    total = 0.0
    for mb in micro:
        loss, _ = value_loss({C.VALUES: ref(mb)}, mb)
        (loss / len(micro)).backward()
        total += float(loss) / len(micro)
    norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), OPTIM.grad_clip))
    optimizer.step()
    for _, metrics, _ in results:
        assert metrics["loss"] == pytest.approx(total, rel=1e-5)
        assert metrics["grad_norm"] == pytest.approx(norm, rel=1e-5)
    after = {k: torch.from_numpy(v) for k, v in results[0][2].items()}
    expected = {k: v.detach() for k, v in ref.state_dict().items()}
    assert sorted(after) == sorted(expected)  # trunk with HF names, score.weight, no lm_head
    assert R.max_rel_diff(after, expected) <= 1e-5
    assert not torch.equal(after["score.weight"], head)
