"""The driver's verified weight sync, actor -> rollout (DESIGN.md, Layers: above the WholeModel):
complete (`manifest`), exact and end to end (`weights`; `end_to_end`: the rollout's log-probs of its
samples against the actor's), the probe policy and the report. How the bytes travel, sender and
receiver, is `xray/transport`'s."""
from xray.sync.errors import WeightSyncError
from xray.sync.weights import Staged, SyncReport, deliver, stage, sync_to, sync_weights

__all__ = ["Staged", "SyncReport", "WeightSyncError", "deliver", "stage", "sync_to", "sync_weights"]
