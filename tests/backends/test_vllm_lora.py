"""The vLLM rollout serving the actor's LoRA adapter, synced alone, against Hugging Face + peft.

One LoRA-enabled engine (fp32, CPU, in the pytest process as in a rollout Workhorse) takes two
adapter syncs in place, as `load_weights` + `finish_load` receive them from the actor. Checked:
before any sync it is the base model; after each, its sampled-token and prompt log-probs equal
`peft` on the unsharded model (FACTS.md measured 3e-6), its held A and B equal what was sent bit
for bit, and a second adapter replaces the first (no rebuild). The held check must also be able
to fail: a different A is reported as mismatched.
"""
from __future__ import annotations

import pytest
import torch

from tests.backends.rollout_common import hf_sequence_stats, make_prompts, sequences_of, trained_tiny_model
from xray.backends import load_backend
from xray.backends.held import HeldCheck
from xray.backends.vllm_adapter import AdapterError, _active_loras
from xray.check.reference import load_hf
from xray.config.lora import LoraConfig, peft_names

pytestmark = pytest.mark.backends

LORA = LoraConfig(rank=4, alpha=8.0)
TOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return trained_tiny_model(tmp_path_factory.mktemp("vllm_lora") / "tiny")


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = load_backend("vllm").build_engine(model_dir, dtype="float32", seed=0, max_model_len=256,
                                            kv_cache_gib=1, lora=LORA)
    yield eng
    eng.shutdown()


def _adapter(model_dir, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = load_hf(str(model_dir)).state_dict()
    tensors = {}
    for name, weight in base.items():
        if ".layers." in name and name.split(".")[-2] in LORA.targets() and name.endswith(".weight"):
            a, b = peft_names(name)
            tensors[a] = torch.randn(LORA.rank, weight.shape[1], generator=g) * 0.1
            tensors[b] = torch.randn(weight.shape[0], LORA.rank, generator=g) * 0.1
    return tensors


def _peft_model(model_dir, tensors, tmp_path):
    import peft

    from xray.backends.lora import save_adapter

    save_adapter(tmp_path, tensors, LORA, str(model_dir))
    return peft.PeftModel.from_pretrained(load_hf(str(model_dir)), str(tmp_path)).eval()


def _sync(engine, tensors):
    items = list(tensors.items())
    half = len(items) // 2
    engine.load_weights(items[:half])  # two buckets, as a sync may cut them
    engine.load_weights(items[half:])
    engine.finish_load()
    return engine.held_check()


def _max_logprob_diff(engine, reference) -> float:
    prompts = make_prompts(4, seed=2)
    out = engine.generate(prompts, {"temperature": 1.0, "max_new_tokens": 8, "seed": 1})
    seqs, lens = sequences_of(out)
    expected, _ = hf_sequence_stats(reference, seqs, lens)
    sampled = max(abs(a - b) for row, ref in zip(out["response_logprobs"], expected) for a, b in zip(row, ref))
    scored = engine.logprobs(seqs, lens)  # one prompt per call inside (FACTS.md's LoRA trap)
    return max(sampled, max(abs(a - b) for row, ref in zip(scored, expected) for a, b in zip(row, ref)))


def test_adapter_syncs_in_place_and_matches_peft(engine, model_dir, tmp_path):
    assert engine.takes_adapter()
    assert _max_logprob_diff(engine, load_hf(str(model_dir)).eval()) < TOL  # no adapter yet: the base
    for version, seed in enumerate((1, 2)):
        tensors = _adapter(model_dir, seed)
        held = _sync(engine, tensors)
        assert held["mismatched"] == [] and held["exact"] == len(tensors), held
        assert _max_logprob_diff(engine, _peft_model(model_dir, tensors, tmp_path / f"v{version}")) < TOL


def test_held_check_catches_a_wrong_adapter(engine, model_dir):
    tensors = _adapter(model_dir, 3)
    _sync(engine, tensors)
    wrong = dict(tensors)
    name = next(n for n in wrong if "lora_A" in n)
    wrong[name] = wrong[name] + 1e-3
    held = HeldCheck()
    loras = engine.llm.collective_rpc(_active_loras, args=(engine.adapter.ID,))[0]  # what the kernels read
    a = next(parts[0][0] for parts in loras.values() if parts[0])
    assert a.shape[0] >= LORA.rank and float(a[LORA.rank:].abs().sum()) == 0.0  # the slot, padded to max rank
    engine.adapter._check(loras, wrong, torch.float32, held)
    assert held.mismatched == [f"{name} [held otherwise than sent]"] and held.exact == len(tensors) - 1
    stray = dict(tensors, **{"base_model.model.model.layers.0.mlp.router.lora_A.weight": torch.zeros(4, 4)})
    held = HeldCheck()  # a sent tensor that no LoRA layer of the engine holds: unchecked, the sync fails
    engine.adapter._check(loras, stray, torch.float32, held)
    assert held.unchecked == 1 and held.exact == len(tensors) and held.checked[-1].endswith("router.lora_A.weight")
    held = HeldCheck()  # registered but holding no slot of the kernels (never activated): the base model serves
    engine.adapter._check({}, tensors, torch.float32, held)
    assert held.mismatched and "holds no slot" in held.mismatched[0] and held.exact == 0
    engine.load_weights(list(tensors.items())[:-2])  # an adapter that lost a module on the way
    with pytest.raises(AdapterError, match="other tensors than the first"):
        engine.finish_load()


def test_a_synced_adapter_is_read_once_and_never_served_from_stale_keys(engine, model_dir):
    """vLLM reads an adapter from disk again at every engine step when a request says
    `load_inplace`, and its prefix cache keys blocks by the adapter's name and path, which an
    in-place update keeps: only the engine's first sync may read the adapter from disk (later
    ones replace it from memory), generating never, and a prompt that fills a KV block must not
    reuse keys and values computed with the previous adapter."""
    block = engine.llm.llm_engine.vllm_config.cache_config.block_size
    prompt = [[int(t) for t in torch.randint(1, 64, (block + 8,), generator=torch.Generator().manual_seed(4))]]
    sampling = {"temperature": 1.0, "max_new_tokens": 4, "seed": 1}
    manager = engine.llm.llm_engine.model_executor.driver_worker.worker.model_runner.lora_manager
    reads, load = [], manager._load_adapter
    manager._load_adapter = lambda request: reads.append(request) or load(request)
    first = int(engine.adapter.request is None)
    try:
        _sync(engine, _adapter(model_dir, 5))
        assert len(reads) == first, f"the adapter was read {len(reads)} times in its engine's first sync"
        engine.generate(prompt, sampling)  # its full block is now cached
        _sync(engine, _adapter(model_dir, 6))
        after = engine.generate(prompt, sampling)["response_logprobs"][0]
        assert len(reads) == first, "a later sync or a generation read the adapter from disk"
    finally:
        manager._load_adapter = load
    engine.llm.reset_prefix_cache()
    fresh = engine.generate(prompt, sampling)["response_logprobs"][0]
    assert max(abs(a - b) for a, b in zip(after, fresh)) < TOL, (after, fresh)


def test_a_reload_of_base_weights_keeps_the_last_adapter(engine, model_dir):
    """An in-place reload of base weights makes vLLM drop its adapters and read the adapter's
    directory again, which holds the first version: the last one must come back from memory."""
    from safetensors.torch import load_file

    probe, lens = [list(range(3, 19))], [8]
    for seed in (7, 8):  # the second replaces the first in memory
        _sync(engine, _adapter(model_dir, seed))
    synced = engine.logprobs(probe, lens)[0]
    base = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        base.update(load_file(str(path)))
    engine.reload(list(base.items()))
    assert max(abs(a - b) for a, b in zip(engine.logprobs(probe, lens)[0], synced)) < TOL
