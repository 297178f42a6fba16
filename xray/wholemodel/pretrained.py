"""What `WholeModel.from_pretrained` checks and fills in on the caller's side, before any process starts.

A notebook user names a Hugging Face directory, a backend, a role, a layout and engine options.
Each mistake a person makes there (a keyword the engine does not take, a missing `config.json`,
a tp that does not divide the heads, a role the backend does not serve, a dtype it cannot train in)
is caught here in milliseconds, with a message that names the fix, instead of after the
Workhorses started. Defaults that fit together are filled in: the role from the backend, vLLM's
`max_model_len` from the model's positions, ZeRO-3 for DeepSpeed, `optim` from a plain dict.
What each backend serves and takes is its row of the engine registry (`xray/config/engines.py`).
Only `json` and the config dataclasses are read here: no backend library is imported.
"""
from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from xray.config.engines import Engine, EngineError, engine, names
from xray.config.optim import OptimConfig
from xray.config.parallel import LayoutError, ParallelDims


class PretrainedError(ValueError):
    """A `from_pretrained` call that cannot work as written; the message says the fix."""


def model_config(model_dir: str | Path) -> dict[str, Any]:
    """The model's `config.json`, or an error that says what the directory must hold."""
    path = Path(model_dir)
    if not path.is_dir():
        raise PretrainedError(f"{model_dir} is not a directory; pass a local Hugging Face model directory "
                              "(one written by save_pretrained, with config.json and the weights)")
    if not (path / "config.json").is_file():
        raise PretrainedError(f"{model_dir} has no config.json; pass the directory a Hugging Face model was "
                              "saved to (model.save_pretrained(dir) writes it)")
    return json.loads((path / "config.json").read_text())


def _check_layout(backend: str, row: Engine, config: dict, parallel: ParallelDims) -> None:
    if not row.tensor_parallel and (parallel.tp, parallel.pp) != (1, 1):
        model_parallel = " or ".join(map(repr, names("train", "pipeline_parallel")))
        raise PretrainedError(f"backend {backend!r} is data-parallel only (tp=1, pp=1), got tp={parallel.tp} "
                              f"pp={parallel.pp}; use dp=, or backend={model_parallel} for tensor/pipeline parallelism")
    if parallel.ep > 1 and not row.expert_parallel:
        raise PretrainedError(f"ep={parallel.ep}: expert parallelism runs on backend="
                              f"{' or '.join(map(repr, names('train', 'expert_parallel')))}; use ep=1 here")
    heads = int(config.get("num_attention_heads", 1))
    kv_heads = int(config.get("num_key_value_heads", heads))
    layers = int(config.get("num_hidden_layers", parallel.pp))
    try:
        parallel.check_model(layers, heads, kv_heads)
    except LayoutError as exc:
        raise PretrainedError(str(exc)) from None


def _options(backend: str, row: Engine, role: str, config: dict, options: dict) -> dict:
    dtype = options.get("dtype", "float32")
    if dtype not in row.dtypes:
        raise PretrainedError(f"backend {backend!r} runs in {' or '.join(row.dtypes)}, not dtype={dtype!r}; "
                              f"pass dtype={row.dtypes[0]!r} or leave dtype out")
    unknown = sorted(set(options) - set(row.options) - {"dtype"})
    if unknown:
        hint = " (the learning rate goes in optim={'lr': ...})" if {"lr", "learning_rate"} & set(unknown) else ""
        raise PretrainedError(f"backend {backend!r} takes no option {', '.join(map(repr, unknown))}{hint}; "
                              f"it accepts: {', '.join(row.options) or 'none'}")
    out = {k: v for k, v in options.items() if k in row.options}
    if "optim" in row.options:
        out["optim"] = _optim(out.get("optim"))
    if row.zero:
        out.setdefault("zero_stage", 3)
        if out["zero_stage"] not in (1, 2, 3):
            raise PretrainedError(f"zero_stage={out['zero_stage']!r}; choose 1, 2 or 3")
    if role == "rollout":
        positions = int(config.get("max_position_embeddings", 1024))
        out.setdefault("max_model_len", positions)
        if out["max_model_len"] > positions:
            raise PretrainedError(f"max_model_len={out['max_model_len']} exceeds the model's {positions} "
                                  f"positions (max_position_embeddings); pass at most {positions}")
    return out


def _optim(value: Any) -> OptimConfig:
    if value is None or isinstance(value, OptimConfig):
        return value or OptimConfig()
    if not isinstance(value, dict):
        raise PretrainedError(f"optim={value!r}; pass a dict such as {{'lr': 1e-5}} or an OptimConfig")
    known = [f.name for f in fields(OptimConfig)]
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise PretrainedError(f"optim has no field {', '.join(map(repr, unknown))}; its fields are {', '.join(known)}")
    return OptimConfig(**value)


def prepare(model_dir: str | Path, backend: str, role: str | None, parallel: ParallelDims,
            options: dict) -> tuple[str, dict]:
    """The role and the Workhorse init kwargs for this call, or a PretrainedError naming the fix."""
    try:
        row = engine(backend)
    except EngineError:
        row = None
    if row is None or not row.pretrained_roles:
        offered = ", ".join(names(having="pretrained_roles"))
        raise PretrainedError(f"unknown backend {backend!r}; choose one of {offered}")
    role = role or row.pretrained_roles[0]
    if role not in row.pretrained_roles:
        raise PretrainedError(f"backend {backend!r} serves roles {', '.join(row.pretrained_roles)}, not {role!r}; "
                              f"pass role= one of those (or another backend)")
    config = model_config(model_dir)
    _check_layout(backend, row, config, parallel)
    return role, dict(model_dir=str(model_dir), backend=backend, **_options(backend, row, role, config, options))
