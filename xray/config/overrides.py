"""Dotted command-line overrides: `--ppo.kl_coef=0.05` sets `ppo: {kl_coef: 0.05}` in the YAML tree.

Values are read as YAML scalars or flow collections (`0.05`, `true`, `[0, 1]`, `null`), so an
override has the same types as the file. Applied to the plain tree before typing, so an unknown
key fails in the same place, with the same message, as one written in the file.
"""
from __future__ import annotations

from typing import Any

import yaml

from xray.config.typed import ConfigError
from xray.config.yaml_text import load_yaml


def parse_overrides(args: list[str]) -> list[tuple[str, Any]]:
    """`["--a.b=1", "--c", "x"]` -> `[("a.b", 1), ("c", "x")]`."""
    out: list[tuple[str, Any]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"cannot read argument {arg!r}; overrides look like --section.key=value")
        body = arg[2:]
        if "=" in body:
            key, raw = body.split("=", 1)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            key, raw = body, args[i + 1]
            i += 1
        else:
            raise ConfigError(f"override {arg!r} has no value; write --{body}=VALUE")
        try:
            value = load_yaml(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        out.append((key, value))
        i += 1
    return out


def apply_overrides(tree: dict, overrides: list[tuple[str, Any]]) -> dict:
    """Set each dotted key in a copy of `tree`, creating intermediate mappings."""
    import copy

    tree = copy.deepcopy(tree)
    for key, value in overrides:
        parts = key.split(".")
        if not all(parts):
            raise ConfigError(f"override key {key!r} has an empty part; write --section.key=value")
        node = tree
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {key!r}: {'.'.join(parts[:depth + 1])!r} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return tree
