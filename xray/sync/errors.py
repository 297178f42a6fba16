"""The error of a weight sync that failed verification, below both the completeness check
(`xray/sync/manifest.py`) and the driver's sync (`xray/sync/weights.py`), which raise it."""


class WeightSyncError(RuntimeError):
    """The rollout engine does not agree with the actor after a sync."""
