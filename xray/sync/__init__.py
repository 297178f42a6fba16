"""The driver's verified weight sync, actor -> rollout (DESIGN.md, Layers: above the WholeModel):
complete (`manifest`: every tensor sent, loaded once, as the manifest lists it), exact (`weights`,
with `coverage`: one verdict of the engine's held check per tensor it holds) and end to end
(`end_to_end`: the rollout's log-probs of its samples against the actor's), the probe policy and
the report. How the bytes travel, sender and receiver with their checksum family, is
`xray/transport`'s (which also holds `WeightSyncError`, re-exported here)."""
from xray.transport.errors import WeightSyncError
from xray.sync.weights import Staged, SyncReport, deliver, stage, sync_to, sync_weights

__all__ = ["Staged", "SyncReport", "WeightSyncError", "deliver", "stage", "sync_to", "sync_weights"]
