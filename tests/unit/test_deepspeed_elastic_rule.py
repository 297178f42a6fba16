"""xray's elastic batches against DeepSpeed's own `compute_elastic_config`, block by block and world
size by world size.

DeepSpeed 0.19.8 (the pinned one) removed its `elasticity` package, so the reference is the
package of the last release that shipped it (0.18.0): its source distribution is fetched from
PyPI once (pip's cache, then `~/.cache/xray`), and its three modules (`config`, `constants`,
`elasticity`) are imported as they are, under a parent package that gives the two names they take
from DeepSpeed's root (its version string and a logger). The function compared is DeepSpeed's own.
"""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from xray.config.elasticity import ElasticityConfig, ElasticityError, elastic_batch, valid_world_sizes

pytestmark = pytest.mark.unit
REFERENCE = "0.18.0"
"""The last DeepSpeed release with `deepspeed/elasticity`."""

SEED_BLOCK = {"ignore_non_elastic_batch_info": True, "enabled": True, "max_train_batch_size": 8,
              "micro_batch_sizes": [4, 2], "min_gpus": 1, "max_gpus": 4, "min_time": 20, "version": 0.1}
"""The seed's block, verbatim: ms-swift's elastic SFT with DLRover (docs/source_en/BestPractices/Elastic.md)."""
BLOCKS = {
    "seed": SEED_BLOCK,
    # DeepSpeed's documented example (v0.1): the batch with the most valid sizes below 2000
    "deepspeed_doc": {"enabled": True, "max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6],
                      "min_gpus": 1, "max_gpus": 10000, "min_time": 20, "version": 0.1},
    # the smaller batch between candidates allowing as many sizes; bounds that cut the list
    "smaller_batch": {"enabled": True, "max_train_batch_size": 100, "micro_batch_sizes": [3, 5],
                      "min_gpus": 2, "max_gpus": 8, "prefer_larger_batch": False, "version": 0.1},
    # v0.2 by default (no version): sizes outside the list get a batch of their own
    "v02_default": {"enabled": True, "max_train_batch_size": 6, "micro_batch_sizes": [2],
                    "min_gpus": 1, "max_gpus": 2},
    # v0.2 per node of two devices
    "v02_nodes": {"enabled": True, "max_train_batch_size": 96, "micro_batch_sizes": [2, 4], "min_gpus": 2,
                  "max_gpus": 16, "num_gpus_per_node": 2, "version": 0.2},
}


def _sdist(cache: Path) -> Path:
    found = sorted(cache.glob(f"deepspeed-{REFERENCE}.tar.gz"))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    p = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q",
                        f"deepspeed=={REFERENCE}", "-d", str(cache)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return cache / f"deepspeed-{REFERENCE}.tar.gz"


@pytest.fixture(scope="module")
def deepspeed_rule(tmp_path_factory):
    """DeepSpeed 0.18.0's `compute_elastic_config`, its modules unchanged."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "xray" / "deepspeed-elasticity"
    root = tmp_path_factory.mktemp("dsref")
    package = root / "deepspeed_reference"
    (package / "elasticity").mkdir(parents=True)
    with tarfile.open(_sdist(cache)) as tar:
        for name in ("config", "constants", "elasticity"):
            member = tar.extractfile(f"deepspeed-{REFERENCE}/deepspeed/elasticity/{name}.py")
            (package / "elasticity" / f"{name}.py").write_bytes(member.read())
    (package / "__init__.py").write_text("")
    (package / "elasticity" / "__init__.py").write_text("")
    (package / "git_version_info.py").write_text(f"version = {REFERENCE!r}\n")
    (package / "utils.py").write_text("import logging\nlogger = logging.getLogger('deepspeed_reference')\n")
    sys.path.insert(0, str(root))
    try:
        return importlib.import_module("deepspeed_reference.elasticity.elasticity").compute_elastic_config
    finally:
        sys.path.remove(str(root))


def deepspeeds(rule, block: dict, world: int):
    """(batch, valid sizes, micro-batch) DeepSpeed gives, or None where it refuses the world size or
    gives it a batch of 0 (v0.2 when not one micro-batch per replica fits: DeepSpeed's runtime then
    stops on `train_batch_size` 0)."""
    try:
        batch, valid, micro = rule({"elasticity": block}, REFERENCE, world_size=world)
    except Exception as exc:  # noqa: BLE001 - DeepSpeed's ElasticityIncompatibleWorldSize and its kin
        assert "ElasticityIncompatibleWorldSize" in type(exc).__name__, exc
        return None
    return (batch, list(valid), micro) if batch > 0 else None


def xrays(block: dict, world: int):
    cfg = ElasticityConfig.from_dict(block)
    try:
        b = elastic_batch(cfg, world)
    except ElasticityError as exc:
        assert "valid sizes" in str(exc) or "no valid batch" in str(exc), exc  # the refusal says the fix
        return None
    assert b.train_batch_size == b.micro_batch_size * b.gradient_accumulation_steps * world
    return b.train_batch_size, list(valid_world_sizes(cfg, world)), b.micro_batch_size


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_batches_and_valid_sizes_equal_deepspeeds_at_every_size_to_8(deepspeed_rule, name):
    block = BLOCKS[name]
    for world in range(1, 9):
        assert xrays(block, world) == deepspeeds(deepspeed_rule, block, world), (name, world)


def test_the_seeds_block_keeps_one_batch_and_refuses_3_devices(deepspeed_rule):
    """The seed's block: a global batch of 8 at 1, 2 and 4 replicas (4x2, 4x1, 2x1 per replica); 3
    replicas refused (xray's old arithmetic trained them at a batch of 6)."""
    cfg = ElasticityConfig.from_dict(SEED_BLOCK)
    assert [(b.micro_batch_size, b.gradient_accumulation_steps) for b in map(lambda w: elastic_batch(cfg, w), (1, 2, 4))] \
        == [(4, 2), (4, 1), (2, 1)]
    with pytest.raises(ElasticityError, match=r"world size 3 .* valid sizes \[1, 2, 4\]"):
        elastic_batch(cfg, 3)
    assert deepspeeds(deepspeed_rule, SEED_BLOCK, 3) is None
