"""Weight sync from the actor to the rollout engine, verified after every sync."""
from xray.sync.weights import Staged, SyncReport, WeightSyncError, deliver, stage, sync_weights

__all__ = ["Staged", "SyncReport", "WeightSyncError", "deliver", "stage", "sync_weights"]
