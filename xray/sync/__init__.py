"""Weight sync from the actor to the rollout engine, verified after every sync."""
from xray.sync.weights import SyncReport, WeightSyncError, sync_weights

__all__ = ["SyncReport", "WeightSyncError", "sync_weights"]
