"""The fingerprint of a model directory's weights (`xray/backends/base_fingerprint.py`) and the check
a LoRA run makes with it before its first adapter sync (`SyncVerification.check_base`): the rollout
keeps the base weights it started from, which no adapter sync sends."""
import asyncio
import types

import pytest
import torch
from safetensors.torch import save_file

from xray.backends.base_fingerprint import fingerprint
from xray.run.verify import SyncVerification
from xray.sync import WeightSyncError

pytestmark = pytest.mark.unit


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(300, 8, generator=g),
            "model.layers.0.mlp.down_proj.weight": torch.randn(8, 16, generator=g).bfloat16(),
            "model.norm.weight": torch.ones(8)}


def test_the_fingerprint_names_the_weights_not_the_files(tmp_path):
    w = _weights(0)
    save_file(w, str(tmp_path / "model.safetensors"))
    (tmp_path / "sharded").mkdir()  # the same tensors in two files
    save_file({k: w[k] for k in list(w)[:1]}, str(tmp_path / "sharded" / "model-00001-of-00002.safetensors"))
    save_file({k: w[k] for k in list(w)[1:]}, str(tmp_path / "sharded" / "model-00002-of-00002.safetensors"))
    assert fingerprint(tmp_path) == fingerprint(tmp_path / "sharded")
    tuned = dict(w, **{"model.embed_tokens.weight": w["model.embed_tokens.weight"] + 1e-3})  # a fine-tuned copy
    (tmp_path / "tuned").mkdir()
    save_file(tuned, str(tmp_path / "tuned" / "model.safetensors"))
    assert fingerprint(tmp_path / "tuned") != fingerprint(tmp_path)
    (tmp_path / "empty").mkdir()
    assert fingerprint(tmp_path / "empty") is None


def test_a_rollout_started_from_another_base_fails_before_the_first_adapter_sync():
    def model(*prints):
        async def base_fingerprint():
            return list(prints)
        return types.SimpleNamespace(base_fingerprint=base_fingerprint)

    owner = types.SimpleNamespace(models=types.SimpleNamespace(actor=model("a", "a"), rollout=model("a", "a")))
    asyncio.run(SyncVerification.check_base(owner))  # the same base on every shard
    owner.models.rollout = model("a", "b")  # one replica on another base
    with pytest.raises(WeightSyncError, match=r"the rollout's base model is not the actor's .*\['a', 'b'\]"):
        asyncio.run(SyncVerification.check_base(owner))
    owner.models.rollout = model(None)  # weights in another format: nothing to compare
    asyncio.run(SyncVerification.check_base(owner))
