"""WholeModel as a notebook user meets it: mistakes caught before anything starts and nothing leaked,
several models of one role side by side, save_pretrained, sync_to (`xray.sync`) and text prompts."""
import time
from pathlib import Path

import pytest
import ray
import torch

from xray.data import columns as C
from xray.sync import sync_to
from xray.wholemodel import WholeModel
from xray.wholemodel.pretrained import PretrainedError

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def model_dir(local_ray, tmp_path_factory):
    """The built-in tiny Llama (4 heads, 2 layers) with its character tokenizer, untrained."""
    from xray.data.tokenizer import save_char_tokenizer
    from xray.builtin.tiny_llama import build_tiny_model
    from xray.builtin.tiny_llama import builtin_spec

    directory = build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", builtin_spec(), seed=0)
    save_char_tokenizer(directory)
    return Path(directory)


def cluster_state() -> tuple[int, int]:
    """Alive actors and placement groups not removed, as Ray's global state reports them."""
    from ray._private.state import actors

    alive = sum(1 for a in actors().values() if a["State"] != "DEAD")
    groups = sum(1 for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED")
    return alive, groups


def settled_state(before: tuple[int, int], timeout_s: float = 10.0) -> tuple[int, int]:
    """The cluster state once killed actors are reported dead (or the timeout)."""
    deadline = time.monotonic() + timeout_s
    state = cluster_state()
    while state != before and time.monotonic() < deadline:
        time.sleep(0.2)
        state = cluster_state()
    return state


@pytest.mark.parametrize("options, fix", [
    (dict(backend="megatron", lr=1e-3), "optim={'lr'"),
    (dict(backend="megatron", dtype="bfloat16"), "pass dtype='float32'"),
    (dict(backend="megatron", tp=3), "tp=3"),
    (dict(backend="hf", role="rollout"), "serves roles actor, reference"),
    (dict(backend="hf", optim={"learning_rate": 1e-3}), "its fields are lr"),
])
def test_mistakes_fail_before_anything_starts(model_dir, options, fix):
    before = cluster_state()
    t0 = time.perf_counter()
    with pytest.raises(PretrainedError, match=fix.replace("(", r"\(").replace("[", r"\[")):
        WholeModel.from_pretrained(model_dir, **options)
    assert time.perf_counter() - t0 < 3.0
    assert cluster_state() == before


def test_missing_config_says_what_the_directory_needs(local_ray, tmp_path):
    before = cluster_state()
    t0 = time.perf_counter()
    with pytest.raises(PretrainedError, match="no config.json; pass the directory a Hugging Face model"):
        WholeModel.from_pretrained(tmp_path, backend="megatron", tp=2)
    assert time.perf_counter() - t0 < 3.0
    assert cluster_state() == before


def test_a_failed_setup_leaves_nothing_behind(model_dir, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in model_dir.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    before = cluster_state()
    with pytest.raises(Exception) as info:
        WholeModel.from_pretrained(broken, backend="hf", dp=2)
    text = str(info.value)
    assert text.startswith("actor.start failed on 2 of 2 shards") and "header" in text.lower()
    assert settled_state(before) == before
    again = WholeModel.from_pretrained(model_dir, backend="hf", dp=2)  # the same cell, fixed, runs
    again.shutdown()


def test_two_models_of_one_role_side_by_side_and_a_discoverable_api(model_dir):
    a = WholeModel.from_pretrained(model_dir, backend="hf")
    b = WholeModel.from_pretrained(model_dir, backend="hf")
    try:
        assert a.role == b.role == "actor"
        assert {"forward", "train_step", "state_dict"} <= set(dir(a))
        assert "loss_fn" in str(a.train_step.__signature__) and "LOGPROBS" in a.forward.__doc__
        ids = torch.randint(0, 40, (4, 10))
        columns = {C.INPUT_IDS: ids, C.ATTENTION_MASK: torch.ones_like(ids)}
        pending = a.forward(columns)  # a plain dict of tensors
        assert "actor.forward" in repr(pending)
        logp_a, logp_b = pending.get()[C.LOGPROBS], b.forward(columns).get()[C.LOGPROBS]
        assert torch.equal(logp_a, logp_b)

        def loss(outputs, batch):  # a bare tensor is a loss
            return -outputs[C.LOGPROBS].mean()

        metrics = a.train_step(columns, loss).get()  # micro_batch_size defaults to the slice
        assert metrics["loss"] == pytest.approx(-float(logp_a.mean()), rel=1e-5)
    finally:
        a.shutdown()
        b.shutdown()


@pytest.mark.parametrize("backend, layout", [("megatron", dict(tp=2)), ("deepspeed", dict(dp=2))])
def test_save_pretrained_loads_in_transformers_with_equal_logprobs(model_dir, tmp_path, backend, layout):
    from transformers import AutoModelForCausalLM

    from xray.check.reference import hf_logprobs
    from xray.data.batch import Batch

    actor = WholeModel.from_pretrained(model_dir, backend=backend, **layout)
    try:
        ids = torch.randint(0, 40, (4, 12), generator=torch.Generator().manual_seed(0))
        batch = Batch({C.INPUT_IDS: ids, C.ATTENTION_MASK: torch.ones_like(ids)})
        actor.train_step(batch, lambda outputs, b: -outputs[C.LOGPROBS].mean()).get()  # moved off the base
        ours = actor.forward(batch).get()[C.LOGPROBS]
        saved = actor.save_pretrained(str(tmp_path / "out")).get()
    finally:
        actor.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
    assert (Path(saved) / "tokenizer_config.json").is_file() or (Path(saved) / "tokenizer.json").is_file()
    theirs = hf_logprobs(hf, batch)
    assert float((ours - theirs.detach()).abs().max()) <= 1e-5


def test_vllm_rollout_with_defaults_text_prompts_and_sync_to(model_dir):
    actor = WholeModel.from_pretrained(model_dir, backend="megatron", optim={"lr": 1e-3})
    rollout = WholeModel.from_pretrained(model_dir, backend="vllm")  # role, max_model_len: defaults
    try:
        assert rollout.role == "rollout"
        greedy = {"temperature": 0.0, "max_new_tokens": 6}
        out = rollout.generate(["12+7=", "3+4="], greedy).get()
        assert len(out["completion"]) == 2 and all(isinstance(t, str) for t in out["completion"])
        ids = torch.randint(0, 40, (8, 12), generator=torch.Generator().manual_seed(1))
        batch = {C.INPUT_IDS: ids, C.ATTENTION_MASK: torch.ones_like(ids)}
        for _ in range(3):
            actor.train_step(batch, lambda outputs, b: -outputs[C.LOGPROBS].mean()).get()
        first = sync_to(actor, rollout)
        second = sync_to(actor, rollout)
        assert (first["version"], second["version"]) == (1, 2)
        assert first["max_abs_logprob_diff"] <= 1e-4 and first["bytes"] > 0
        assert rollout.weight_version().get() == [2]
    finally:
        rollout.shutdown()
        actor.shutdown()
