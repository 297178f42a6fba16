"""The coverage of a weight sync's held check: no engine tensor counted as checked that was not,
and none the sync wrote left without a verdict. Part of the driver's verified sync (`xray/sync`,
used by `weights.check_exact` after the completeness and exact checks).

Each rollout shard reports, at `finish_sync`, two things its engine keeps apart: the tensors its
loads wrote (`holds`, `GenerationEngine.held_tensors`: recorded as they are written) and the
verdicts of its held check (`held`, `xray/backends/held.py`: counts of tensors found exact,
functionally right or unchecked, and the name of each tensor given a verdict). Per replica,
exact + functional + unchecked must equal the tensors the engine holds of this sync, and the
names must match one for one: a tensor written but never judged, or judged but never written
(counted twice, or under another name), fails the sync naming it. A replica that loaded tensors
but whose engine checked nothing, or does not say what it holds, fails too. Completeness
(`manifest.py`) has already shown that the sync wrote every tensor the engine needs, so a check
that covers what the sync wrote covers everything the engine holds.
"""
from __future__ import annotations

from collections import Counter

from xray.transport.errors import WeightSyncError


def _few(names) -> str:
    names = sorted(names)
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def coverage_problem(replica: dict) -> str | None:
    """What one replica's report (`RolloutWorkhorse.finish_sync`) shows wrong with the coverage
    of its held check, as a phrase; None when exact + functional + unchecked is the tensors its
    engine holds of this sync, one verdict per tensor."""
    held, holds, loaded = replica.get("held") or {}, replica.get("holds"), replica.get("loaded", [])
    counted = held.get("exact", 0) + held.get("functional", 0) + held.get("unchecked", 0)
    if loaded and not counted and not held.get("mismatched"):
        return (f"the engine loaded {len(loaded)} tensor(s) and its held check returned nothing: the backend "
                "must check what it holds (GenerationEngine.held_check, xray/backends/held.py), or run with "
                "sync.verify=false")
    if holds is None:
        return ("the engine does not say which tensors its loads wrote, so its checks cannot be counted against "
                "them: implement GenerationEngine.held_tensors for this backend, or run with sync.verify=false")
    written, judged = Counter(holds), Counter(held.get("checked", []))
    uncovered, extra = written - judged, judged - written
    if uncovered:
        return (f"{sum(uncovered.values())} engine tensor(s) written by the sync were never checked "
                f"({_few(uncovered)}): the held check skipped them; teach it their layout (xray/backends/held.py)")
    if extra:
        return (f"{sum(extra.values())} check(s) counted for tensor(s) the sync did not write or wrote once "
                f"({_few(extra)}): the held check counts a tensor twice or under another name; fix its names")
    if counted != len(holds):
        return (f"exact {held.get('exact', 0)} + functional {held.get('functional', 0)} + unchecked "
                f"{held.get('unchecked', 0)} = {counted}, but the engine holds {len(holds)} tensor(s) of this sync: "
                "its held check counts without naming what it checked; fix its counts (HeldCheck.passed)")
    return None


def check_coverage(version: int, replicas: list[dict]) -> None:
    """Raise `WeightSyncError` naming the first replica whose held check does not cover exactly
    the tensors its engine holds of the sync to `version` (`coverage_problem`)."""
    for replica in replicas:
        problem = coverage_problem(replica)
        if problem:
            raise WeightSyncError(f"weight sync to version {version}: the held check of rollout replica "
                                  f"{replica.get('rank', '?')} does not cover what it holds: {problem}")
