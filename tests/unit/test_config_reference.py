"""The config reference `docs/config.md` is generated from the schema's docstrings
(`xray.config.reference`): it must be current, and every field of every section must carry a
docstring and appear in it with its type and default."""
import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Literal, Optional

import pytest

from xray.config import reference
from xray.config.placement import DeviceGroup, DeviceGroups
from xray.config.schema import RunConfig
from xray.config.typed import yaml_key

pytestmark = pytest.mark.unit

REGENERATE = f"regenerate it with `.venv/bin/{reference.COMMAND}` (or `python -m xray.config.reference > docs/config.md`)"


def test_docs_config_md_is_current():
    assert reference.DOC_PATH.is_file(), f"docs/config.md is missing; {REGENERATE}"
    assert reference.DOC_PATH.read_text() == reference.render(), f"docs/config.md is stale; {REGENERATE}"


def test_every_config_field_has_a_docstring():
    missing = reference.missing_docstrings()
    assert not missing, ("config fields without a docstring (write a short, true one as a string literal right "
                         f"after the field, then {REGENERATE}): {', '.join(missing)}")


def _blocks(text: str) -> dict[str, str]:
    """Each heading's text up to the next heading, by heading."""
    out, title = {}, None
    for line in text.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip()
            out[title] = ""
        elif title is not None:
            out[title] += line + "\n"
    return out


def test_every_field_of_every_section_appears_with_type_and_default():
    text = reference.render()
    blocks = _blocks(text)
    hints = typing.get_type_hints(RunConfig)
    sections = [c for c in reference.sections() if c not in (RunConfig, DeviceGroups, DeviceGroup)]
    assert len(sections) >= 14, f"sections found: {[c.__name__ for c in sections]}"
    for cls in reference.sections():
        for f in reference.config_fields(cls):
            if (cls, f.name) in ((DeviceGroups, "groups"), (DeviceGroup, "name")):
                continue  # written as the group's key, NAME
            if (cls, f.name) == (DeviceGroups, "min_nnodes"):  # written as nnodes: MIN:MAX
                assert "- **`nnodes`** (int or `MIN:MAX`, default `1`)" in text
                continue
            doc = reference.one_paragraph(reference.field_docs(cls)[f.name])
            if cls is RunConfig and reference._section_type(hints[f.name]) is not None:
                assert f"`{yaml_key(f.name)}`: {doc}" in text, f"RunConfig.{f.name} is not in the reference"
                continue
            lines = [line for body in blocks.values() for line in body.splitlines()
                     if line.startswith(f"- **`{yaml_key(f.name)}`** (") and line.endswith(doc)]
            assert lines, f"{cls.__name__}.{f.name} is not in the reference with its docstring"
            assert any("default `" in line or "required" in line or "section (below)" in line for line in lines)
    for name, f in {f.name: f for f in dataclasses.fields(RunConfig)}.items():
        if reference._section_type(hints[name]) is not None:
            assert any(yaml_key(name) in title.split(", ") for title in blocks), f"no section for {name}"
    assert "- **`kl_coef`** (float, default `0.05`): " in blocks["ppo"]
    assert "- **`dtype`** (`float32` or `bfloat16` or null, default `null`): " in blocks["rollout"]
    assert "- **`feeds`** (mapping of str to list of str, default `{}`): " in blocks["async"]
    assert "- **`max_train_batch_size`** (int, required): " in text
    assert "- **`device`** (str, default `CPU`): " in blocks["device_groups.NAME"]


def test_type_and_value_text():
    assert reference.type_text(Optional[float]) == "float or null"
    assert reference.type_text(tuple[float, float]) == "[float, float]"
    assert reference.type_text(tuple[int, ...]) == "list of int"
    assert reference.type_text(tuple[Literal["a", "b"], ...]) == "list of `a`, `b`"
    assert reference.value_text("\n") == '"\\n"'
    assert reference.value_text("builtin:tiny-llama") == "builtin:tiny-llama"
    assert reference.value_text((0.9, 0.95)) == "[0.9, 0.95]"
    assert reference.value_text(None) == "null" and reference.value_text(False) == "false"


@dataclass(frozen=True)
class _Inner:
    """A nested section."""

    depth: int = 2
    """How deep."""


@dataclass(frozen=True)
class _Undocumented:
    """A section with one field left bare."""

    documented: int = 1
    """Has a docstring."""
    bare: float = 0.5
    inner: _Inner = field(default_factory=_Inner)
    """A nested section."""


def test_a_field_without_docstring_stops_the_generation():
    assert reference.missing_docstrings(_Undocumented) == [f"{__name__}._Undocumented.bare"]
    with pytest.raises(reference.MissingDocstring, match="_Undocumented.bare"):
        reference.render(_Undocumented)


def test_check_mode_reports_a_stale_file(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "config.md"
    stale.write_text("# Config reference\n")
    monkeypatch.setattr(reference, "DOC_PATH", stale)
    assert reference.main(["--check"]) == 1
    assert reference.COMMAND in capsys.readouterr().err
    assert reference.main(["--write"]) == 0
    assert reference.main(["--check"]) == 0
    assert stale.read_text() == reference.render()
