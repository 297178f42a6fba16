"""The driver's verdict on the actor's export: what was gathered against what the shards held.

Part of the verified sync (`xray/sync/weights.py`), judged before the rollout's own checks (a
wrong export is the cause of whatever they find after it). The exporting shard's engine reports
its digest check (`TrainEngine.export_check`, `xray/backends/export_digest.py`) in the push's
answer: tensors checked, tensors the gather built otherwise than their shards held, tensors a
data-parallel replica holds otherwise than the exporting one. Any of the last two fails the sync.
"""
from __future__ import annotations

from xray.transport.errors import WeightSyncError


def check_export(version: int, verdict: dict | None) -> int | None:
    """Raise WeightSyncError naming the tensors of an export that failed its digest check;
    else the tensors it checked (None where the engine reported no check: an adapter-only sync,
    an engine without one)."""
    if verdict is None:
        return None
    diverged, mismatched = verdict["diverged"], verdict["mismatched"]
    if diverged:
        raise WeightSyncError(
            f"weight sync to version {version}: the actor's data-parallel replicas disagree before the export: "
            f"{len(diverged)} piece(s), {'; '.join(diverged[:3])}. A replica missed an update or was restored "
            "from another step; restore every replica from one checkpoint (or snapshot) and rerun the step")
    if mismatched:
        raise WeightSyncError(
            f"weight sync to version {version}: the actor's export built {len(mismatched)} tensor(s) otherwise "
            f"than its shards hold: {'; '.join(mismatched[:3])}. The gather across tp/pp/ZeRO or its name "
            "map is wrong (xray/backends/megatron/export.py, xray/backends/deepspeed/export.py)")
    return int(verdict["checked"])
