"""Run configuration: YAML files in `configs/` plus dotted overrides, typed and checked.

`load_config(path, overrides)` reads the YAML, applies `--a.b=value` overrides, and builds the
typed `RunConfig` (unknown keys and wrong types are errors naming the key). `plan_run` then does
the cross-field checks and returns the placement plan.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from xray.config.deepspeed_json import merge_deepspeed_json
from xray.config.overrides import apply_overrides, parse_overrides
from xray.config.parallel import LayoutError, ParallelDims
from xray.config.schema import RunConfig
from xray.config.typed import ConfigError, build, to_dict
from xray.config.yaml_text import load_yaml

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
"""The shipped configs; each command's spec names its default there (`xray.config.job.JobSpec.config`)."""



def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist; pass an existing YAML with --config")
    try:
        data = load_yaml(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections at the top level")
    return data


def load_config(path: str | Path, overrides: list[str] | list[tuple[str, Any]] = ()) -> RunConfig:
    """Read `path`, apply overrides (`["--a.b=1"]` or `[("a.b", 1)]`), return the typed config."""
    pairs = parse_overrides(list(overrides)) if overrides and isinstance(overrides[0], str) else list(overrides)
    tree = merge_deepspeed_json(apply_overrides(read_yaml(path), pairs))
    return build(RunConfig, tree, "")


__all__ = ["ConfigError", "LayoutError", "ParallelDims", "RunConfig", "load_config", "to_dict",
           "CONFIG_DIR", "read_yaml"]
