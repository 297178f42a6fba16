"""A DeepSpeed JSON config, as DeepSpeed and ms-swift users write it, read into a role's settings.

Sits in the config layer, before the typed build (`xray/config/__init__.py`): a trained role's
`deepspeed_config: path/to/zero1.json` puts that file's meaning into the role's own keys, so the
run's one config stays the source of truth. `"auto"` means what it means to ms-swift and the
transformers integration: the value comes from xray's config (the batch keys from the run's
batches, `gradient_clipping` from `optim.grad_clip`, `bf16`/`fp16` from `model.dtype`). A key
xray has no meaning for is an error that names it; keys that only tune DeepSpeed's own buckets
and logging are listed in `TUNING` and leave xray's choices (`xray/backends/deepspeed/config.py`).
Pure Python.
"""
from __future__ import annotations

import json
from pathlib import Path

from xray.config.typed import ConfigError

ROLES = ("actor", "critic", "reference", "teacher")
AUTO = "auto"
TUNING = frozenset({
    "steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer", "communication_data_type",
    "prescale_gradients", "gradient_predivide_factor", "sparse_gradients", "dump_state", "flops_profiler",
    "tensorboard", "wandb", "csv_monitor", "comms_logger",
})
"""Top-level keys about DeepSpeed's logging and communication tuning: accepted, xray's own apply."""
ZERO_TUNING = frozenset({
    "allgather_partitions", "allgather_bucket_size", "overlap_comm", "reduce_scatter", "reduce_bucket_size",
    "contiguous_gradients", "round_robin_gradients", "sub_group_size", "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save", "load_from_fp32_weights", "elastic_checkpoint",
})
"""`zero_optimization` keys that size DeepSpeed's buckets and prefetching: xray sizes them from the model."""


def merge_deepspeed_json(tree: dict) -> dict:
    """`tree` (the run config as read) with each role's `deepspeed_config` file merged into the role."""
    dtype = str((tree.get("model") or {}).get("dtype") or "float32")
    for role in ROLES:
        section = tree.get(role)
        if isinstance(section, dict) and section.get("deepspeed_config"):
            tree = dict(tree, **{role: role_from_json(section, Path(section["deepspeed_config"]), dtype, role)})
    return tree


def role_from_json(section: dict, path: Path, dtype: str, role: str) -> dict:
    """The role's section with the settings of DeepSpeed config `path` (module docstring)."""
    where = f"{role}.deepspeed_config ({path})"
    try:
        ds = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file; give the path of a DeepSpeed JSON config") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not JSON ({exc}); give a DeepSpeed JSON config") from None
    if not isinstance(ds, dict):
        raise ConfigError(f"{where}: a DeepSpeed config is a JSON object")
    out = dict(section)
    known = {"zero_optimization", "bf16", "fp16", "gradient_clipping", "elasticity", "optimizer", "scheduler",
             "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"}
    unknown = sorted(set(ds) - known - TUNING)
    if unknown:
        raise ConfigError(f"{where}: keys xray does not read: {unknown}; remove them (xray's own config sets "
                          "what they would)")
    _zero(ds.get("zero_optimization") or {}, out, where)
    _precision(ds, dtype, where)
    if ds.get("gradient_clipping", AUTO) != AUTO:
        out["optim"] = dict(out.get("optim") or {}, grad_clip=float(ds["gradient_clipping"]))
    for key in ("optimizer", "scheduler"):
        params = (ds.get(key) or {}).get("params") or {}
        if key in ds and any(v != AUTO for v in params.values()):
            raise ConfigError(f"{where}: {key} with values of its own; xray trains with its AdamW and schedule "
                              f"(`{role}.optim`): set them there, or leave the block's params \"auto\"")
    _batch(ds, out, where)
    if "elasticity" in ds:
        out["elasticity"] = ds["elasticity"]
    return out


def _zero(zero: dict, out: dict, where: str) -> None:
    for key in ("offload_optimizer", "offload_param"):
        device = (zero.get(key) or {}).get("device", "none")
        if device not in ("none", None):
            raise ConfigError(f"{where}: zero_optimization.{key}.device={device!r}; xray keeps parameters and "
                              "optimizer state on the device; set it to \"none\"")
    unknown = sorted(set(zero) - ZERO_TUNING - {"stage", "offload_optimizer", "offload_param"})
    if unknown:
        raise ConfigError(f"{where}: zero_optimization keys xray does not read: {unknown}; remove them")
    if "stage" in zero:
        if zero["stage"] not in (1, 2, 3):
            raise ConfigError(f"{where}: zero_optimization.stage={zero['stage']!r}; the deepspeed backend runs "
                              "ZeRO 1, 2 or 3")
        out["zero_stage"] = zero["stage"]


def _precision(ds: dict, dtype: str, where: str) -> None:
    bf16 = (ds.get("bf16") or {}).get("enabled", AUTO)
    fp16 = (ds.get("fp16") or {}).get("enabled", AUTO)
    if fp16 not in (AUTO, False):
        raise ConfigError(f"{where}: fp16.enabled={fp16!r}; xray trains in fp32 or bf16 (`model.dtype`); set it "
                          "to false or \"auto\"")
    if bf16 != AUTO and bool(bf16) != (dtype in ("bfloat16", "bf16")):
        raise ConfigError(f"{where}: bf16.enabled={bf16!r} but model.dtype is {dtype}; set model.dtype to "
                          f"{'bfloat16' if bf16 else 'float32'}, or bf16.enabled to \"auto\"")


def _batch(ds: dict, out: dict, where: str) -> None:
    elastic = ds.get("elasticity") or {}
    ignored = elastic.get("enabled", False) and elastic.get("ignore_non_elastic_batch_info", False)
    micro = ds.get("train_micro_batch_size_per_gpu", AUTO)
    if micro != AUTO and not ignored:
        out["micro_batch_size"] = int(micro)
    for key in ("train_batch_size", "gradient_accumulation_steps"):
        if ds.get(key, AUTO) != AUTO and not ignored:
            raise ConfigError(f"{where}: {key}={ds[key]!r}; xray derives it from the run's batches "
                              "(`ppo.mini_batch_size`, the role's `micro_batch_size`): set \"auto\"")
