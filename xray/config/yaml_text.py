"""How xray reads YAML (config files, `--a.b=value` overrides, a run's saved `config.yaml`): PyYAML's
safe loader with YAML 1.2's scalars where 1.1 surprises.

PyYAML follows YAML 1.1, where `1:4` is a base-60 integer (64) and `1:30.5` a base-60 float; YAML
1.2 dropped both. xray writes ranges as `MIN:MAX` (`device_groups.nnodes: 1:4`, as torchrun's
`--nnodes`), so such a scalar is read as the string it looks like. Everything else is PyYAML's
safe loading.
"""
from __future__ import annotations

from typing import Any

import yaml


class ConfigLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that reads a base-60 looking scalar (`1:4`) as a string."""


def _int_or_text(loader: ConfigLoader, node: yaml.ScalarNode) -> Any:
    text = loader.construct_scalar(node)
    return text if ":" in text else yaml.SafeLoader.construct_yaml_int(loader, node)


def _float_or_text(loader: ConfigLoader, node: yaml.ScalarNode) -> Any:
    text = loader.construct_scalar(node)
    return text if ":" in text else yaml.SafeLoader.construct_yaml_float(loader, node)


ConfigLoader.add_constructor("tag:yaml.org,2002:int", _int_or_text)
ConfigLoader.add_constructor("tag:yaml.org,2002:float", _float_or_text)


def load_yaml(text: str) -> Any:
    """`yaml.safe_load(text)`, with `1:4` read as the string "1:4"."""
    return yaml.load(text, Loader=ConfigLoader)  # noqa: S506 - a SafeLoader subclass
