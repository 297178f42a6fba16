"""LoRA on the Megatron engine vs `peft` on the unsharded Hugging Face model.

One spawn of two processes goes through the layouts tp=2, pp=2, dp=2 and (bf16) tp=2, then a
critic, dropout, and adapters on some parts of the fused layers only. Both sides hold the same
adapter: `peft.get_peft_model` on the tiny Llama with every B randomised (a fresh B is zero and
would hide A's gradient), loaded into the engine with `load_adapter`. Per layout: log-probs with
and without the adapters, the merged export vs `merge_and_unload`, one AdamW step (loss, gradient
norm, the adapters' gradients and values after it), the frozen base bitwise unchanged, the
optimizer holding only adapters; the exported adapter written with `save_adapter` reloads in
`peft.PeftModel.from_pretrained`. At tp=2 a checkpoint resumes bitwise, and it reshards into pp=2.
The dp=2 layout trains with activation checkpointing (each decoder layer runs again in the
backward): adapters behind the frozen embedding must still get peft's gradients.

Tolerances (fp32): log-probs 1e-4 as the base parity tests (tp splits the matmuls and the
vocabulary softmax, so sums run in another order; measured <= 5e-7); gradients, losses and grad
norms 1e-5 relative, merged weights 1e-6 (the same arithmetic up to summation order; measured
<= 1e-6 and 0). The adapters after the step: AdamW of exactly the engine's gradients (1e-6), and
within 2 lr of peft's, not tighter: AdamW's first step moves each element by about +-lr whatever
the size of its gradient, so where a gradient is near zero a 1e-6 difference in it moves the
step by up to lr. bf16 gets coarse bounds (FACTS.md, "bf16 on CPU": bf16 log-probs differ from
fp32 by >= 0.016 on a near-uniform model; measured here 5e-3, gradients 2e-2 relative).
"""
from __future__ import annotations

import copy
import functools

import pytest
import torch

from tests.dist_harness import run_distributed
from xray.backends.base import OptimConfig
from xray.builtin.tiny_llama import TinySpec, build_tiny_model
from xray.check import reference as R
from xray.config.lora import LoraConfig
from xray.config.parallel import ParallelDims
from xray.data import columns as C

pytestmark = pytest.mark.backends

BATCH, SEQ, MICRO, SEED = 4, 16, 2, 0
OPTIM = OptimConfig(lr=1e-3, weight_decay=0.01)
LORA = LoraConfig(rank=4, alpha=8.0)  # all-linear; dropout 0 so that both sides are deterministic
PARTIAL = LoraConfig(rank=4, alpha=8.0, target_modules=("k_proj", "up_proj", "down_proj"))  # parts of fused layers
LAYOUTS = [((2, 1, 1), "float32"), ((1, 2, 1), "float32"), ((1, 1, 2), "float32"), ((2, 1, 1), "bfloat16")]
CRITIC = (1, 2, 1)
RECOMPUTED = (1, 1, 2)  # the layout trained with activation checkpointing


def _numpy(tensors):
    return None if tensors is None else {k: v.float().numpy() for k, v in tensors.items()}


def _torch(arrays):
    return {k: torch.from_numpy(v) for k, v in arrays.items()}


def _batch():
    return R.random_batch(BATCH, SEQ, TinySpec().vocab_size, seed=1)


def value_loss(outputs, mb):
    mask = mb[C.LOSS_MASK]
    return ((outputs[C.VALUES] - mb["weight"]) ** 2 * mask).sum() / mask.sum()


# ---- the engine side (spawned ranks) ------------------------------------------------------------
def _worker(rank, world_size, model_dir, adapter, ckpt, partial):
    from megatron.core import parallel_state

    results = {}
    for dims, dtype in LAYOUTS:
        saves = dtype == "float32" and dims[0] == 2  # the tp=2 checkpoint that `_reshard` loads at pp=2
        results[(dims, dtype)] = _actor(model_dir, dims, dtype, _torch(adapter), ckpt if saves else None)
        parallel_state.destroy_model_parallel()
    results["resharded"] = _reshard(model_dir, ckpt)
    parallel_state.destroy_model_parallel()
    results["critic"] = _critic(model_dir)
    parallel_state.destroy_model_parallel()
    results["dropout"] = _dropout(model_dir, _torch(adapter))
    parallel_state.destroy_model_parallel()
    results["partial"] = _partial(model_dir, _torch(partial))
    parallel_state.destroy_model_parallel()
    return results


def _frozen(engine):
    return {n: p.detach().clone() for n, p in engine.model.named_parameters() if not p.requires_grad}


def _actor(model_dir, dims, dtype, adapter, ckpt):
    from xray.backends.megatron import build_engine

    parallel = ParallelDims(*dims)
    engine = build_engine(model_dir, parallel, "actor", OPTIM, seed=SEED, dtype=dtype, lora=LORA,
                          activation_checkpointing=dims == RECOMPUTED)
    fresh = engine.export_adapter()
    engine.load_adapter(adapter)
    batch = _batch()
    out = {"fresh": _numpy(fresh), "logprobs": _numpy(engine.forward(batch)),
           "base_logprobs": _numpy(engine.forward(batch, adapters=False)),
           "merged": _numpy({n: t for b in engine.export_weights() for n, t in b})}
    frozen = _frozen(engine)
    trained = sum(len(g["params"]) for g in engine.optimizer.param_groups)
    calls = [0]  # forwards of the first decoder layer in the step
    counting = engine.model.decoder.layers[0].register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    out["metrics"] = engine.train_step(batch.split(parallel.dp)[engine.shard_info().dp_rank], R.policy_loss, MICRO)
    counting.remove()
    out["layer_calls"] = calls[0]
    out["grads"] = _numpy(engine.adapter_grads())
    out["after"] = _numpy(engine.export_adapter())
    out["base_unchanged"] = all(torch.equal(p, frozen[n]) for n, p in _frozen(engine).items())
    out["optimizer_holds_only_adapters"] = trained == len(engine._adapters) and \
        all(".lora." in n for n, p in engine.model.named_parameters() if p.requires_grad)
    out["after_logprobs"] = _numpy(engine.forward(batch))
    if ckpt is not None:  # save, one more step; a fresh engine loads and takes the same step
        engine.save(ckpt)
        out["next"] = engine.train_step(_batch(), R.policy_loss, MICRO)
        again = build_engine(model_dir, parallel, "actor", OPTIM, seed=SEED, lora=LORA)
        again.load(ckpt)
        out["next_resumed"] = again.train_step(_batch(), R.policy_loss, MICRO)
        out["after_resumed"] = _numpy(again.export_adapter())
        out["after_next"] = _numpy(engine.export_adapter())
    return out


def _reshard(model_dir, ckpt):
    """The tp=2 checkpoint loaded at pp=2: the same adapters, and the same next step."""
    from xray.backends.megatron import build_engine

    engine = build_engine(model_dir, ParallelDims(1, 2, 1), "actor", OPTIM, seed=SEED, lora=LORA)
    engine.load(ckpt)
    return {"next": engine.train_step(_batch(), R.policy_loss, MICRO), "after_next": _numpy(engine.export_adapter())}


def _critic(model_dir):
    from xray.backends.megatron import build_engine

    engine = build_engine(model_dir, ParallelDims(*CRITIC), "critic", OPTIM, seed=SEED, lora=LORA)
    named = dict(engine.model.named_parameters())
    head = named["output_layer.weight"].detach().clone() if "output_layer.weight" in named else None
    frozen = _frozen(engine)
    engine.train_step(_batch(), value_loss, MICRO)
    return {"trains_head": head is None or not torch.equal(head, named["output_layer.weight"]),
            "base_unchanged": all(torch.equal(p, frozen[n]) for n, p in _frozen(engine).items()),
            "b_moved": _b_moved(engine.export_adapter())}


def _dropout(model_dir, adapter):
    """tp=2 with dropout: forward (eval) ignores it; after a training step the tensors every tp
    rank holds whole are still bitwise equal (their masks are drawn alike on every rank)."""
    from xray.backends.megatron import build_engine
    from xray.backends.megatron.convert import Kind

    lora = LoraConfig(rank=LORA.rank, alpha=LORA.alpha, dropout=0.3)
    engine = build_engine(model_dir, ParallelDims(2, 1, 1), "actor", OPTIM, seed=SEED, lora=lora)
    engine.load_adapter(adapter)
    out = {"logprobs": _numpy(engine.forward(_batch()))}
    out["metrics"] = engine.train_step(_batch(), R.policy_loss, MICRO)
    named = dict(engine.model.named_parameters())
    out["whole"] = _numpy({e.megatron_name: named[e.megatron_name].detach() for e in engine._adapters
                           if e.kind is Kind.REPLICATED})
    return out


def _partial(model_dir, adapter):
    """tp=2 with adapters on some parts of the fused layers only: log-probs and the merged export."""
    from xray.backends.megatron import build_engine

    engine = build_engine(model_dir, ParallelDims(2, 1, 1), "actor", OPTIM, seed=SEED, lora=PARTIAL)
    engine.load_adapter(adapter)
    return {"logprobs": _numpy(engine.forward(_batch())),
            "merged": _numpy({n: t for b in engine.export_weights() for n, t in b})}


def _b_moved(adapter):
    """The largest |B| of an exported adapter (B starts at zero); None off the exporting rank."""
    return None if adapter is None else max(float(t.abs().max()) for n, t in adapter.items() if ".lora_B." in n)


# ---- the peft side (this process) ---------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def model_dir() -> str:
    import tempfile

    return str(build_tiny_model(tempfile.mkdtemp(prefix="xray-mt-lora-"), TinySpec(), seed=0))


def _peft_model(lora: LoraConfig = LORA):
    import peft

    torch.manual_seed(2)  # peft draws A from the global generator
    model = peft.get_peft_model(R.load_hf(model_dir()), peft.LoraConfig(**lora.peft_config()))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def _state(model, grads=False):
    """{peft name: tensor} of the adapters (or of their gradients)."""
    return {n.replace(".default", ""): (p.grad if grads else p).detach().clone()
            for n, p in model.named_parameters() if ".lora_" in n}


@functools.lru_cache(maxsize=None)
def reference() -> dict:
    model = _peft_model()
    batch = _batch()
    out = {"adapter": _state(model)}
    with torch.no_grad():
        out["logprobs"] = R.hf_logprobs(model, batch)
        with model.disable_adapter():
            out["base_logprobs"] = R.hf_logprobs(model, batch)
        out["merged"] = {k: v.clone() for k, v in copy.deepcopy(model).merge_and_unload().state_dict().items()}
    micro = batch.chunks(MICRO)
    for mb in micro:  # the gradient norm before clipping
        (R.policy_loss({C.LOGPROBS: R.hf_logprobs(model, mb)}, mb)[0] / len(micro)).backward()
    out["grad_norm"] = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]))
    # the same AdamW (`build_optimizer`) and clipping; frozen parameters get no gradient, so
    # AdamW and the clipping touch only the adapters, as `peft` trains them
    out["loss"] = R.reference_train_step(model, batch, R.policy_loss, OPTIM, MICRO)[0]
    out["grads"], out["after"] = _state(model, grads=True), _state(model)
    with torch.no_grad():
        out["after_logprobs"] = R.hf_logprobs(model, batch)
    return out


@functools.lru_cache(maxsize=None)
def partial_reference() -> dict:
    model = _peft_model(PARTIAL)
    with torch.no_grad():
        return {"adapter": _state(model), "logprobs": R.hf_logprobs(model, _batch()),
                "merged": copy.deepcopy(model).merge_and_unload().state_dict()}


@functools.lru_cache(maxsize=None)
def run(ckpt: str) -> list[dict]:
    adapter = {k: v.numpy() for k, v in reference()["adapter"].items()}
    partial = {k: v.numpy() for k, v in partial_reference()["adapter"].items()}
    return run_distributed(_worker, 2, model_dir(), adapter, ckpt, partial)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run(str(tmp_path_factory.mktemp("lora-ckpt")))


def _exporter(per_rank: list[dict], key) -> dict:
    (out,) = [r[key] for r in per_rank if r[key]["after"] is not None]
    return out


def _adamw_step(before: dict, grads: dict) -> dict:
    """`before` after one step of the engines' AdamW (`build_optimizer`) with gradients `grads`."""
    from xray.backends.optim import build_optimizer

    params = {k: torch.nn.Parameter(v.clone()) for k, v in before.items()}
    for k, p in params.items():
        p.grad = grads[k].clone()
    build_optimizer(params.values(), OPTIM).step()
    return {k: p.detach() for k, p in params.items()}


@pytest.mark.parametrize("dims,dtype", LAYOUTS, ids=[f"tp{d[0]}pp{d[1]}dp{d[2]}-{t}" for d, t in LAYOUTS])
def test_adapter_parity(results, dims, dtype):
    ref, key = reference(), (dims, dtype)
    out = _exporter(results, key)
    bf16 = dtype == "bfloat16"
    collect = [r[key] for r in results if r[key]["logprobs"] is not None]
    for r in collect:  # (a) log-probs with the adapters, (d) without them: the base model
        assert (_torch(r["logprobs"])[C.LOGPROBS] - ref["logprobs"]).abs().max() <= (5e-2 if bf16 else 1e-4)
        assert (_torch(r["base_logprobs"])[C.LOGPROBS] - ref["base_logprobs"]).abs().max() <= (5e-2 if bf16 else 1e-4)
        assert (ref["logprobs"] - ref["base_logprobs"]).abs().max() > 1e-2, "the adapter changes nothing"
    # (e) the merged export is peft's merge_and_unload
    assert R.max_rel_diff(_torch(out["merged"]), ref["merged"]) <= (1e-2 if bf16 else 1e-6)
    # (b) one step: the same loss, gradient norm and adapter gradients
    for r in results:
        assert r[key]["metrics"]["loss"] == pytest.approx(ref["loss"], rel=1e-3 if bf16 else 1e-5)
        assert r[key]["metrics"]["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-2 if bf16 else 1e-5)
        # (c) only the adapters train: the frozen base is bitwise unchanged, the optimizer holds adapters only
        assert r[key]["base_unchanged"] and r[key]["optimizer_holds_only_adapters"]
        assert r[key]["layer_calls"] == BATCH // dims[2] // MICRO * (2 if dims == RECOMPUTED else 1)
    grads, after = _torch(out["grads"]), _torch(out["after"])
    assert R.max_rel_diff(grads, ref["grads"]) <= (5e-2 if bf16 else 1e-5)
    # ... and the adapters after the step: AdamW of exactly those gradients (fp32), and within the
    # step's size of peft's (AdamW's first step moves an element by about lr whatever its gradient,
    # so where a gradient is near zero, a difference of 1e-6 in it can flip the step's sign)
    if not bf16:
        assert R.max_rel_diff(after, _adamw_step(ref["adapter"], grads)) <= 1e-6
    rounding = 2.0 ** -8 if bf16 else 0.0
    for name, value in after.items():
        bound = 2 * OPTIM.lr + rounding * float(ref["after"][name].abs().max())
        assert (value - ref["after"][name]).abs().max() <= bound, name
    assert R.max_rel_diff(after, ref["adapter"]) > 1e-3, "the step did not move the adapters"


def test_fresh_adapter_is_seeded(results):
    """Before `load_adapter`: A as `initial_a` of its HF weight, B zero, on every layout."""
    from xray.backends.lora import initial_a
    from xray.backends.megatron.lora import hf_weight_of

    fresh = _torch(_exporter(results, LAYOUTS[0])["fresh"])
    assert sorted(fresh) == sorted(reference()["adapter"])
    for name, t in fresh.items():
        if ".lora_A." in name:
            assert torch.equal(t, initial_a(hf_weight_of(name), t.shape[1], LORA.rank, SEED)), name
        else:
            assert not t.any(), name
    assert sorted(_exporter(results, LAYOUTS[1])["fresh"]) == sorted(fresh)


def test_exported_adapter_loads_in_peft(results, tmp_path):
    import peft

    from xray.backends.lora import save_adapter

    out = _exporter(results, LAYOUTS[0])
    directory = save_adapter(tmp_path / "adapter", _torch(out["after"]), LORA, model_dir())
    model = peft.PeftModel.from_pretrained(R.load_hf(model_dir()), str(directory))
    with torch.no_grad():
        logprobs = R.hf_logprobs(model, _batch())
    assert (logprobs - reference()["after_logprobs"]).abs().max() <= 1e-4
    engine_after = [r[LAYOUTS[0]]["after_logprobs"] for r in results if r[LAYOUTS[0]]["after_logprobs"] is not None]
    assert (logprobs - _torch(engine_after[0])[C.LOGPROBS]).abs().max() <= 1e-4


def test_checkpoint_resumes_and_reshards(results):
    key = LAYOUTS[0]
    for r in results:  # the same processes resumed into a fresh engine: bitwise
        assert r[key]["next_resumed"] == r[key]["next"]
    out = _exporter(results, key)
    resumed, straight = _torch(out["after_resumed"]), _torch(out["after_next"])
    assert sorted(resumed) == sorted(straight) and all(torch.equal(resumed[k], straight[k]) for k in straight)
    (resharded,) = [r["resharded"]["after_next"] for r in results if r["resharded"]["after_next"] is not None]
    assert R.max_rel_diff(_torch(resharded), _torch(out["after_next"])) <= 1e-5
    for r in results:
        assert r["resharded"]["next"]["loss"] == pytest.approx(out["next"]["loss"], rel=1e-5)


def test_critic_trains_head_and_adapters_only(results):
    for r in results:
        assert r["critic"]["trains_head"] and r["critic"]["base_unchanged"]
    assert [r["critic"]["b_moved"] for r in results if r["critic"]["b_moved"] is not None][0] > 0


def test_dropout_keeps_tensor_parallel_copies_equal(results):
    first, second = (r["dropout"] for r in results)
    assert first["whole"] and sorted(first["whole"]) == sorted(second["whole"])
    for name, value in first["whole"].items():
        assert (value == second["whole"][name]).all(), f"{name} differs between the tp ranks"
    assert (_torch(first["logprobs"])[C.LOGPROBS] - reference()["logprobs"]).abs().max() <= 1e-4
    assert first["metrics"]["loss"] != pytest.approx(reference()["loss"], rel=1e-5), "dropout did not act"


def test_adapters_on_some_fused_parts(results):
    """Adapters on k_proj and up_proj only: the other parts' rows of the fused layers get nothing."""
    ref = partial_reference()
    assert sorted(ref["adapter"]) and not any("q_proj" in n or "gate_proj" in n for n in ref["adapter"])
    collect = [r["partial"] for r in results if r["partial"]["logprobs"] is not None]
    assert (_torch(collect[0]["logprobs"])[C.LOGPROBS] - ref["logprobs"]).abs().max() <= 1e-4
    (merged,) = [r["partial"]["merged"] for r in results if r["partial"]["merged"]]
    assert R.max_rel_diff(_torch(merged), ref["merged"]) <= 1e-6
