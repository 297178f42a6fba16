"""The config reference, generated from the typed schema: `docs/config.md`.

Sits beside `xray.config.schema`, whose dataclasses (and those they hold: `OptimConfig`,
`ElasticityConfig`, the device groups of `xray.config.placement`) document each field with the
string literal written right after it. That literal is not kept by Python at run time, so it is
read here from the class's source with `ast`. Every field of every section is written with its
YAML key, type, default and docstring; a field without a docstring stops the generation.

    python -m xray.config.reference            # the reference, on stdout
    python -m xray.config.reference --write    # rewrite docs/config.md
    python -m xray.config.reference --check    # exit 1 when docs/config.md is stale

`tests/unit/test_config_reference.py` fails when the file differs from what this module writes.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import json
import re
import sys
import textwrap
import typing
from pathlib import Path
from typing import Any, Literal, Union

from xray.config.placement import DeviceGroup, DeviceGroups
from xray.config.schema import RunConfig
from xray.config.typed import yaml_key

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "config.md"
"""Where the reference lives in the repository."""
COMMAND = "python -m xray.config.reference --write"
"""The command that regenerates it (run from the repository root, with the project's Python)."""

HEADER = f"""<!-- Generated from xray/config/schema.py by `{COMMAND}`. Do not edit by hand. -->
# Config reference

A run's config is a YAML file (`configs/*.yaml`) read into the typed sections below. Any key can
be overridden on the command line with its dotted path: `kl_coef` in section `ppo` is
`--ppo.kl_coef=0.1`, `lr` in `actor.optim` is `--actor.optim.lr=1e-5`. Values are read as YAML
(`true`, `null`, `[0, 1]`). An unknown key, or a value of the wrong type, stops the command with a
message that names the key; the checks across sections (device counts, batch sizes) run before
anything starts (`--dry-run` runs them and prints the resolved config and the placement plan).
A key left out takes the default shown.

Each section lists its keys relative to it, as `key` (type, default): what it means.
"""


class MissingDocstring(ValueError):
    """A config field without a docstring; the message names the fields."""


@functools.lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal after its annotation), by field name."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for stmt, after in zip(body, body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[stmt.target.id] = after.value.value
    return docs


def one_paragraph(text: str) -> str:
    """A docstring as one line of Markdown (its whitespace collapsed)."""
    return " ".join(inspect.cleandoc(text).split())


def config_fields(cls: type) -> list[dataclasses.Field]:
    """The fields a YAML file may set (those the constructor takes)."""
    return [f for f in dataclasses.fields(cls) if f.init]


def _section_type(tp: Any) -> type | None:
    """The dataclass a field holds (also inside Optional), else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) is Union:
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(inner) == 1 and dataclasses.is_dataclass(inner[0]):
            return inner[0]
    return None


def sections(cls: type = RunConfig) -> list[type]:
    """Every dataclass reachable from `cls` (itself first), each once."""
    seen: list[type] = []

    def visit(c: type) -> None:
        if c in seen:
            return
        seen.append(c)
        for tp in typing.get_type_hints(c).values():
            inner = _section_type(tp)
            if inner is not None:
                visit(inner)
        if c is DeviceGroups:
            visit(DeviceGroup)

    visit(cls)
    return seen


def missing_docstrings(cls: type = RunConfig) -> list[str]:
    """`Class.field` of every field (reachable from `cls`) that has no docstring."""
    return [f"{c.__module__}.{c.__name__}.{f.name}" for c in sections(cls)
            for f in config_fields(c) if not field_docs(c).get(f.name, "").strip()]


def type_text(tp: Any) -> str:
    """A field's type as a reader writes it in YAML."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " or ".join(f"`{value_text(a)}`" for a in args)
    if origin is Union:
        return " or ".join(type_text(a) for a in args)
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "section"
    if origin in (list, tuple) and (origin is list or args[-1:] == (Ellipsis,)):
        if args and typing.get_origin(args[0]) is Literal:  # a list of choices: any of them
            return "list of " + ", ".join(f"`{value_text(a)}`" for a in typing.get_args(args[0]))
        return f"list of {type_text(args[0])}" if args else "list"
    if origin is tuple:
        return "[" + ", ".join(type_text(a) for a in args) + "]"
    if origin is dict:
        return f"mapping of {type_text(args[0])} to {type_text(args[1])}"
    return getattr(tp, "__name__", str(tp))


_PLAIN = re.compile(r"^[A-Za-z_][\w:.\-/]*$")


def value_text(value: Any) -> str:
    """A default value as it would be written in YAML."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if _PLAIN.match(value) and value not in ("null", "true", "false") else json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(value_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {value_text(v)}" for k, v in value.items()) + "}"
    return repr(value)


def default_text(f: dataclasses.Field) -> str:
    """`default \`x\``, or `required` for a field without a default."""
    if f.default is not dataclasses.MISSING:
        return f"default `{value_text(f.default)}`"
    if f.default_factory is not dataclasses.MISSING:
        return f"default `{value_text(f.default_factory())}`"
    return "required"


def field_line(cls: type, f: dataclasses.Field, yaml_form: tuple[str, str] | None = None) -> str:
    """One key of a section: `- **\`key\`** (type, default): docstring.` `yaml_form` (type,
    default) replaces what the annotation and the dataclass default say, for a section with a
    format of its own."""
    tp = typing.get_type_hints(cls)[f.name]
    doc = one_paragraph(field_docs(cls)[f.name])
    inner = _section_type(tp)
    if inner is not None:
        what = "section (below)" if inner is tp else f"section (below) or null, default `{value_text(f.default)}`"
        return f"- **`{yaml_key(f.name)}`** ({what}): {doc}"
    kind, default = yaml_form or (type_text(tp), default_text(f))
    return f"- **`{yaml_key(f.name)}`** ({kind}, {default}): {doc}"


def anchor(title: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def section_block(keys: list[str], cls: type, level: int = 2, intro: str = "") -> list[str]:
    """A section's heading, docstrings and keys, then its nested sections one level deeper."""
    title = ", ".join(keys)
    lines = [f"{'#' * level} {title}", "", one_paragraph(cls.__doc__ or "")]
    if intro:
        lines += ["", intro]
    lines.append("")
    nested = []
    for f in config_fields(cls):
        lines.append(field_line(cls, f))
        inner = _section_type(typing.get_type_hints(cls)[f.name])
        if inner is not None:
            nested.append((f, inner))
    for f, inner in nested:
        lines += [""] + section_block([f"{k}.{yaml_key(f.name)}" for k in keys], inner, level + 1)
    return lines


def device_groups_block(key: str, doc: str) -> list[str]:
    """`device_groups`, which has a format of its own (`DeviceGroups.from_config`): two counts,
    then one group per other key, written as `xray.config.placement` reads it."""
    lines = [f"## {key}", "", one_paragraph(DeviceGroups.__doc__), "", f"`{key}`: {doc}", ""]
    forms = {"nnodes": ("int or `MIN:MAX`", "default `1`")}  # MIN is kept as min_nnodes, not a key
    lines += [field_line(DeviceGroups, f, forms.get(f.name)) for f in config_fields(DeviceGroups)
              if f.name not in ("groups", "min_nnodes")]
    lines += [f"- **`NAME`** (section (below), one per group): {one_paragraph(field_docs(DeviceGroups)['groups'])}",
              "", f"### {key}.NAME", "", one_paragraph(DeviceGroup.__doc__), "",
              f"`NAME`: {one_paragraph(field_docs(DeviceGroup)['name'])}", ""]
    hints = typing.get_type_hints(DeviceGroup)
    for f in config_fields(DeviceGroup):
        if f.name == "name":
            continue
        kind, default = type_text(hints[f.name]), default_text(f)
        if f.name in DeviceGroup.YAML_DEFAULTS:
            default = f"default `{value_text(DeviceGroup.YAML_DEFAULTS[f.name])}`"
        if f.name == "resources":  # held as sorted (name, amount) pairs, written as a mapping
            kind, default = "mapping of str to float", "default `{}`"
        lines.append(field_line(DeviceGroup, f, (kind, default)))
    return lines


def render(root: type = RunConfig) -> str:
    """The whole reference as Markdown; MissingDocstring if any field lacks its docstring."""
    missing = missing_docstrings(root)
    if missing:
        raise MissingDocstring("config fields without a docstring (write one as a string literal right after "
                               "the field): " + ", ".join(missing))
    hints, docs = typing.get_type_hints(root), field_docs(root)
    top = [f for f in config_fields(root) if _section_type(hints[f.name]) is None]
    shared: dict[type, list[str]] = {}
    for f in config_fields(root):
        inner = _section_type(hints[f.name])
        if inner is not None:
            shared.setdefault(inner, []).append(f.name)
    blocks = [["## Top-level keys", "", one_paragraph(root.__doc__), ""] + [field_line(root, f) for f in top]]
    for cls, names in shared.items():
        keys = [yaml_key(n) for n in names]
        if cls is DeviceGroups:
            blocks.append(device_groups_block(keys[0], one_paragraph(docs[names[0]])))
            continue
        intro = " ".join(f"`{yaml_key(n)}`: {one_paragraph(docs[n])}" for n in names)
        blocks.append(section_block(keys, cls, intro=intro))
    toc = ["Sections: " + ", ".join(f"[{b[0][3:]}](#{anchor(b[0][3:])})" for b in blocks) + ".", ""]
    return "\n".join([HEADER, *toc, *("\n".join(b) + "\n" for b in blocks)]).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m xray.config.reference",
                                description="Write the config reference generated from the schema's docstrings.")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"rewrite {DOC_PATH.name} in docs/")
    mode.add_argument("--check", action="store_true", help="exit 1 when docs/config.md is stale")
    args = p.parse_args(argv)
    text = render()
    if args.write:
        DOC_PATH.parent.mkdir(parents=True, exist_ok=True)
        DOC_PATH.write_text(text)
        return 0
    if args.check:
        current = DOC_PATH.read_text() if DOC_PATH.is_file() else ""
        if current != text:
            sys.stderr.write(f"docs/config.md is stale; regenerate it with `{COMMAND}`\n")
            return 1
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
