"""Typed config: turn plain YAML data into the dataclasses of `xray.config.schema`, strictly.

Every field of a config dataclass has a type annotation; `build(cls, data, path)` checks each
key against the fields (an unknown key is an error naming its dotted path and the keys allowed
there) and each value against the annotation (ints are accepted where floats are expected,
nothing else is coerced). Nested dataclasses, `list[...]`, `tuple[...]`, `dict[str, ...]`,
`Optional[...]` and `Literal[...]` are understood.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from typing import Any, Literal, Union


_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


class ConfigError(ValueError):
    """A config the user must fix; the message names the key and says how."""


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin is Union:
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _check_scalar(tp: Any, value: Any, path: str) -> Any:
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str) and _FLOAT.match(value):
        return float(value)  # PyYAML reads `3e-4` (no dot) as a string: accept it as the number it is
    if tp in (int, float) and isinstance(value, bool):
        raise ConfigError(f"{path}: expected {tp.__name__}, got a boolean {value!r}")
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"{path}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")


def convert(tp: Any, value: Any, path: str) -> Any:
    """Check `value` against the annotation `tp`; return it (nested dataclasses built)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, path)
    if origin is Union:
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:  # Optional[X]: X's own error names the key inside it
            return convert(options[0], value, path)
        errors = []
        for arg in options:
            try:
                return convert(arg, value, path)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(f"{path}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{path}: must be one of {', '.join(repr(a) for a in args)}, got {value!r}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__} {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{path}: expected {len(args)} items, got {len(value)}")
            return tuple(convert(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
        item = args[0] if args else Any
        items = [convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__} {value!r}")
        vt = args[1] if args else Any
        return {str(k): convert(vt, v, f"{path}.{k}") for k, v in value.items()}
    return _check_scalar(tp, value, path)


def yaml_key(field_name: str) -> str:
    """A field's key in YAML: its name without a trailing underscore (`async_` is `async`)."""
    return field_name.rstrip("_")


def build(cls: type, data: Any, path: str = "") -> Any:
    """Build dataclass `cls` from mapping `data`, naming `path` in every error."""
    where = path or "the config"
    if isinstance(data, cls):
        return data
    if hasattr(cls, "from_config"):  # a section with its own format (device_groups)
        return cls.from_config({} if data is None else data, path)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of keys, got {type(data).__name__} {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {yaml_key(f.name): f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            full = f"{path}.{key}" if path else str(key)
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown key {_first_leaf(full, data[key])!r}: {where} has no key "
                              f"{str(key)!r}{hint}; keys allowed there: {', '.join(fields)}")
    kwargs = {}
    for name, f in fields.items():
        full = f"{path}.{name}" if path else name
        if name in data:
            kwargs[f.name] = convert(hints[f.name], data[name], full)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"missing key {full!r}: it has no default, set it in the YAML or with --{full}=...")
    try:
        return cls(**kwargs)
    except ValueError as exc:  # a section's own checks (ConfigError, LayoutError, ...)
        raise ConfigError(f"{where}: {exc}") from None


def _first_leaf(path: str, value: Any) -> str:
    """`a` with value {b: {c: 1}} -> `a.b.c`: the full dotted key the user wrote."""
    while isinstance(value, dict) and len(value) == 1:
        key, value = next(iter(value.items()))
        path = f"{path}.{key}"
    return path


def to_dict(obj: Any) -> Any:
    """The plain-data form of a config object (what `--dry-run` prints and runs save)."""
    if hasattr(obj, "to_plain"):
        return obj.to_plain()
    if dataclasses.is_dataclass(obj):
        return {yaml_key(f.name): to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj
