"""The error of a weight sync that failed verification, at the bottom of the weight-sync stack
(`xray/transport`, below the Workhorses): a receiver raises it for a checksum family it cannot
compute or that is not its transport's (`xray/transport/wire.py`), and the driver's verified sync
(`xray/sync`, which re-exports it as `xray.sync.WeightSyncError`) for everything it judges."""


class WeightSyncError(RuntimeError):
    """The rollout engine does not agree with the actor after a sync."""
