"""The complete part of a weight sync's verification: was every tensor sent, loaded once, and
written where the engine needs it?

The actor's exporting shard lists every tensor it sends (`xray.transport.wire.manifest_of`: name,
dtype, shape, byte count) and returns that manifest with its push (`TrainWorkhorse.push_weights`,
`stage_weights`). Each rollout replica reports, at `finish_sync`, the names it loaded in order,
the names its engine needs written by a full sync and can take (`GenerationEngine.weight_names`,
with the other names that write some of them: an MoE block's experts sent fused where the
checkpoint has one tensor per expert), and what it still holds back (vLLM: a fused layer whose
parts did not all arrive). `check_complete` compares them and fails the sync naming what is
missing, extra, loaded twice or not reloaded. Each replica also lists every tensor as it arrived
(`received`: dtype, shape and byte count of the tensor it built from the bytes and the layout sent
with them), and `check_received` compares those with the manifest's entry of the same name: a
tensor whose metadata changed on its way (bytes reinterpreted as another dtype, reshaped,
truncated), which no checksum of the bytes can see, fails the sync naming it. Used by
`xray/sync/weights.py` before the exact checks.
"""
from __future__ import annotations

from collections import Counter

from xray.transport.errors import WeightSyncError
from xray.transport.wire import Manifest


def _named(what: str, names) -> str:
    names = sorted(names)
    return f"{len(names)} {what} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"


def incomplete(manifest: Manifest | None, replica: dict, adapter: bool = False) -> list[str]:
    """What one replica's report (`RolloutWorkhorse.finish_sync`) shows missing against the
    `manifest` and its engine's needs, each as a phrase; empty when the sync is complete. An
    adapter sync (`adapter`) is compared with its manifest only (the engine's base weights stay)."""
    loaded = Counter(replica.get("loaded", []))
    problems = []
    twice = [n for n, k in loaded.items() if k > 1]
    if twice:
        problems.append(_named("tensor(s) loaded more than once", twice))
    if manifest is not None:
        sent = {name for name, *_ in manifest}
        if sent - loaded.keys():
            problems.append(_named("tensor(s) sent but never loaded", sent - loaded.keys()))
        if loaded.keys() - sent:
            problems.append(_named("tensor(s) loaded but not in the manifest", loaded.keys() - sent))
    names = None if adapter else replica.get("names")
    if names is not None:  # a name of `aliases` (an MoE block's fused experts) writes the names it stands for
        aliases = names.get("aliases", {})
        written = {n for name in loaded for n in aliases.get(name, [name])}
        if set(names["needs"]) - written:
            problems.append(_named("tensor(s) the engine needs were not sent", set(names["needs"]) - written))
        if loaded.keys() - set(names["takes"]) - aliases.keys():
            problems.append(_named("tensor(s) the engine has no place for",
                                   loaded.keys() - set(names["takes"]) - aliases.keys()))
    if replica.get("not_reloaded") and not adapter:
        problems.append(_named("engine parameter(s) no reload of this sync wrote (vLLM's own account)",
                               replica["not_reloaded"]))
    if replica.get("waiting"):
        problems.append(_named("tensor(s) held back, never reloaded (their fused layer is incomplete)",
                               replica["waiting"]))
    return problems


def check_complete(version: int, manifest: Manifest | None, replicas: list[dict], adapter: bool = False) -> None:
    """Raise `WeightSyncError` naming the first replica whose sync to `version` is incomplete."""
    for replica in replicas:
        problems = incomplete(manifest, replica, adapter)
        if problems:
            raise WeightSyncError(
                f"weight sync to version {version} is incomplete on rollout replica {replica.get('rank', '?')}: "
                f"{'; '.join(problems)}. The actor's export and the engine disagree on the model's tensors "
                "(a name mapping, a tied or untied head, a filter on the export): fix the mapping")


def misreceived(manifest: Manifest, replica: dict) -> list[str]:
    """The tensors of one replica's report that arrived with another dtype, shape or byte count
    than the `manifest` lists for them, each as `name (sent ..., received ...)`."""
    sent = {name: (dtype, tuple(shape), nbytes) for name, dtype, shape, nbytes in manifest}
    wrong = []
    for name, dtype, shape, nbytes in replica.get("received", []):
        if name in sent and sent[name] != (dtype, tuple(shape), nbytes):
            (d, s, n) = sent[name]
            wrong.append(f"{name} (sent {d} {list(s)} {n} bytes, received {dtype} {list(shape)} {nbytes} bytes)")
    return wrong


def check_received(version: int, manifest: Manifest | None, replicas: list[dict]) -> None:
    """Raise `WeightSyncError` naming the tensors the first replica received otherwise than the
    sender's `manifest` lists them (`misreceived`); nothing without a manifest."""
    if manifest is None:
        return
    for replica in replicas:
        wrong = misreceived(manifest, replica)
        if wrong:
            raise WeightSyncError(
                f"weight sync to version {version}: rollout replica {replica.get('rank', '?')} received {len(wrong)} "
                f"tensor(s) otherwise than the actor's manifest lists them: {'; '.join(wrong[:3])}. The layout sent "
                "with the bytes does not describe them as the sender exported them: fix the sender's layout "
                "(xray/transport)")
