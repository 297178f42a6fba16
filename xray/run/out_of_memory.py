"""What a run says when its node ran out of host memory: the processes that held it and the settings that lower it.

Ray's memory monitor kills processes when a node's memory passes its threshold (95%) and fails
their calls with `ray.exceptions.OutOfMemoryError`, whose text is some 60 lines of Ray's lease and
object-store accounting. A recovery cannot help (the replacement runs the same step in the same
memory), so the run ends, and `xray/train.py` writes `explain` instead of a traceback: the node's
figures and its largest processes, from Ray's text, and this run's settings that lower a training
or generation process's memory, each as the override that changes it. The error is found in the
exception itself or anywhere in its chain (a WholeModel's error carries a shard's as text).
"""
from __future__ import annotations

import re
from typing import Any

SIGNATURE = "killed due to the node running low on memory"
"""Words of every OutOfMemoryError Ray raises (Ray 2.x), also where another error quotes it as text."""
TOP_USERS = 6
"""The largest processes named."""


def ray_oom_text(exc: BaseException) -> str | None:
    """Ray's out-of-memory text, if `exc` or any exception in its chain is (or quotes) one."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc)
        if type(exc).__name__ == "OutOfMemoryError" or SIGNATURE in text:
            return text
        exc = exc.__cause__ or exc.__context__
    return None


def _node_line(text: str) -> str | None:
    found = re.search(r"was ([\d.]+)GB used / ([\d.]+)GB limit", text)
    return f"{found.group(1)} GB used of {found.group(2)} GB" if found else None


def _top_users(text: str) -> list[str]:
    """'<GB> GB <process>' for the largest processes of Ray's 'Top 10 memory users' table."""
    _, _, table = text.partition("Top 10 memory users:")
    rows = []
    for line in table.splitlines()[1:]:
        found = re.match(r"\s*(\d+)\s+([\d.]+)\s+(\S+)", line)
        if not found:
            break
        command = found.group(3)  # a Ray actor's class, or a program's name
        command = command[5:].split(".")[0] if command.startswith("ray::") else command.rsplit("/", 1)[-1]
        rows.append(f"{found.group(2)} GB {command} (pid {found.group(1)})")
    return rows[:TOP_USERS]


def _trained_roles(plan: Any) -> list[str]:
    names = [r.role for r in getattr(plan, "roles", ())]
    return [r for r in ("actor", "critic") if r in names] or ["actor"]


def advice(cfg: Any, plan: Any) -> list[str]:
    """The settings of this run that lower its processes' memory, each as the override that changes
    it, the largest effect first (measured on SmolLM2-135M in fp32, docs/runs.md "Host memory": the
    activations, then the snapshots in the object store, then the rest)."""
    roles = [(role, getattr(cfg, role)) for role in _trained_roles(plan)]
    lines = [f"--{role}.activation_checkpointing=true (keeps one decoder layer's activations in a train step "
             "instead of all; about one more forward's compute)"
             for role, rc in roles if not rc.activation_checkpointing]
    if cfg.trainer.memory_snapshots:
        lines.append("--trainer.memory_snapshots=false (the trained models' state is copied into the object store "
                     "after every step; off, a recovery goes back to the latest checkpoint)")
    lines += [f"--{role}.micro_batch_size={rc.micro_batch_size // 2} (now {rc.micro_batch_size}; a train step's "
              "activations grow with its rows x their length)"
              for role, rc in roles if rc.max_tokens_per_micro_batch is None and rc.micro_batch_size > 1]
    if cfg.model.dtype == "float32":
        lines.append("--model.dtype=bfloat16 (half the weights' and activations' memory)")
    lines.append(f"--rollout.kv_cache_gib (now {cfg.rollout.kv_cache_gib:g}, per generation replica on the CPU)")
    return lines


def explain(exc: BaseException, cfg: Any, plan: Any) -> str | None:
    """The message for a run that failed because its node ran out of memory; None for another failure."""
    text = ray_oom_text(exc)
    if text is None:
        return None
    node = _node_line(text)
    lines = ["the node ran out of memory" + (f" ({node})" if node else "")
             + ": Ray's memory monitor killed the run's processes, and a recovery would run the same step again."]
    if users := _top_users(text):
        lines.append("Largest processes: " + "; ".join(users) + ".")
    lines.append("Lower the memory with any of:")
    lines += [f"  {line}" for line in advice(cfg, plan)]
    return "\n".join(lines)
