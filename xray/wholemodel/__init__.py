"""WholeModel: one whole sharded model as a Ray actor, and the fan-out protocol it speaks.

`protocol` (dispatch / execute / collect, pure functions), `actor` (the WholeModel Ray actor that
owns the Workhorses), `handle` (the `WholeModel` object users hold), `placement` (devices as
Ray placement groups), `cluster` (joining or starting Ray), `errors`.
Importing this package does not import Ray; creating a WholeModel does.
"""
from xray.wholemodel.handle import Bundles, Pending, WholeModel
from xray.wholemodel.protocol import fanout

__all__ = ["WholeModel", "Pending", "Bundles", "fanout"]
