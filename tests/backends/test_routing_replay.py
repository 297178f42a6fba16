"""Routing replay on a tiny Qwen3-MoE (fp32, CPU): the rollout reports the experts it chose, the
training engines route as told.

- DeepSpeed-Inference, generating with `report_routing`, reports for every fed token of every
  sample the experts Hugging Face's model picks for it when it reads the whole sequence at once
  (teacher-forced), layer by layer.
- Megatron (tp=1, also with the experts split over two replicas, ep=2) and DeepSpeed ZeRO-3, given
  ROUTED_EXPERTS: replaying HF's own routing gives HF's log-probs (1e-5); replaying another
  routing (each token's experts moved to the next ones) gives what HF computes when forced to it
  (`hf_routing.replayed` on the HF model), log-probs within 1e-5 and the train step's gradient
  norm within 1e-5 relative, and differs from the model's own choice.
"""
from __future__ import annotations

import functools
import tempfile

import pytest
import torch

from tests.backends.rollout_common import make_prompts
from tests.dist_harness import run_distributed
from xray.backends import load_backend
from xray.backends.base import OptimConfig
from xray.backends.hf_routing import RoutingRecorder, replayed
from xray.backends.sampling import ROUTED_EXPERTS_ROWS
from xray.builtin.tiny_llama import TinySpec, build_tiny_model
from xray.check import reference as R
from xray.data import columns as C
from xray.data.batch import Batch
from xray.data.sequences import pack_sequences

pytestmark = pytest.mark.backends

SPEC = TinySpec(arch="qwen3_moe")


@functools.lru_cache(maxsize=None)
def model_dir() -> str:
    return str(build_tiny_model(tempfile.mkdtemp(prefix="xray-replay-"), SPEC, seed=0))


def hf_routing(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """HF's own routing of a right-padded batch, [B, T, L, K]."""
    with torch.no_grad(), RoutingRecorder(model) as rec:
        model(input_ids=ids, attention_mask=mask)
    return torch.stack(rec.calls[0], dim=1).view(*ids.shape, SPEC.num_layers, SPEC.experts_per_token)


def test_dsinfer_reports_the_routing_hf_computes():
    engine = load_backend("dsinfer").build_engine(model_dir(), dtype="float32", seed=0, max_model_len=256,
                                                  report_routing=True)
    out = engine.generate(make_prompts(6, seed=3), {"temperature": 1.0, "max_new_tokens": 8, "n": 2, "seed": 5})
    reported = out.lists[ROUTED_EXPERTS_ROWS]
    packed = pack_sequences(out[C.PROMPT_IDS], out[C.RESPONSE_IDS], 0, routed_experts=reported)
    ours = hf_routing(R.load_hf(model_dir()), packed[C.INPUT_IDS], packed[C.ATTENTION_MASK])
    for i, rows in enumerate(reported):
        n = len(out[C.PROMPT_IDS][i]) + len(out[C.RESPONSE_IDS][i])
        assert rows.shape == (n - 1, SPEC.num_layers, SPEC.experts_per_token)
        assert torch.equal(rows.sort(-1).values, ours[i, :n - 1].sort(-1).values), i
        assert torch.equal(packed[C.ROUTED_EXPERTS][i, :n - 1], rows)


def _batch(directory: str) -> tuple:
    batch = R.random_batch(8, 20, SPEC.vocab_size, seed=2)
    own = hf_routing(R.load_hf(directory), batch[C.INPUT_IDS], batch[C.ATTENTION_MASK])
    moved = (own + 1) % SPEC.num_experts  # each token's experts moved on: other experts, still distinct
    return batch, own, moved


def _engine_runs(rank, world, backend, dims, directory):
    from xray.config.moe import MoeConfig
    from xray.config.parallel import ParallelDims

    parallel = ParallelDims(*dims)
    if backend == "megatron":
        from xray.backends.megatron import build_engine

        engine = build_engine(directory, parallel, "actor", seed=0, moe=MoeConfig(routing_replay=True))
    else:
        from xray.backends.deepspeed import build_engine

        engine = build_engine(directory, parallel, "actor", OptimConfig(), 0, 3)
    batch, own, moved = _batch(directory)
    out = {}
    for name, routing in (("own", own), ("moved", moved), ("plain", None)):
        res = engine.forward(batch if routing is None else _with(batch, routing))
        out[name] = None if res is None else res[C.LOGPROBS].numpy()
    mine = _with(batch, moved).split(parallel.dp)[engine.shard_info().dp_rank]
    out["grad_norm"] = engine.train_step(mine, R.policy_loss, 8 // parallel.dp)["grad_norm"]
    return out


def _with(batch: Batch, routing: torch.Tensor) -> Batch:
    return Batch({**batch.tensors, C.ROUTED_EXPERTS: routing.to(torch.int16)}, dict(batch.lists), dict(batch.meta))


@functools.lru_cache(maxsize=None)
def reference(parts: int) -> dict:
    """HF's log-probs, plain and forced to each routing, and the gradient norm of the loss under the
    moved routing, as `parts` data-parallel replicas take it: the mean of their slices' losses."""
    batch, own, moved = _batch(model_dir())
    model = R.load_hf(model_dir())
    with torch.no_grad():
        plain = R.hf_logprobs(model, batch)
        with replayed(model, own, batch[C.ATTENTION_MASK]):
            with_own = R.hf_logprobs(model, batch)
        with replayed(model, moved, batch[C.ATTENTION_MASK]):
            with_moved = R.hf_logprobs(model, batch)
    for part, routing in zip(batch.split(parts), moved.chunk(parts)):
        with replayed(model, routing, part[C.ATTENTION_MASK]):
            loss, _ = R.policy_loss({C.LOGPROBS: R.hf_logprobs(model, part)}, part)
            (loss / parts).backward()
    norm = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]))
    return {"plain": plain, "own": with_own, "moved": with_moved, "grad_norm": norm}


@pytest.mark.parametrize("backend,dims", [("megatron", (1, 1, 1)), ("megatron", (1, 1, 2, 2)),
                                          ("deepspeed", (1, 1, 2))], ids=["megatron", "megatron-dp2ep2", "zero3-dp2"])
def test_training_engines_route_as_told(backend, dims):
    world = dims[0] * dims[1] * dims[2]
    results = run_distributed(_engine_runs, world, backend, dims, model_dir())
    ref = reference(dims[2])
    mask = _batch(model_dir())[0][C.ATTENTION_MASK][:, 1:].bool()
    assert float((ref["own"] - ref["plain"])[mask].abs().max()) <= 1e-5  # replaying its own routing changes nothing
    assert float((ref["moved"] - ref["plain"])[mask].abs().max()) > 1e-2  # other experts, other log-probs
    for r in results:
        if r["own"] is None:
            continue
        for name in ("own", "moved", "plain"):
            diff = float((torch.from_numpy(r[name]) - ref[name])[mask].abs().max())
            assert diff <= 1e-5, (name, diff)
        assert r["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
