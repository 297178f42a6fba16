"""WholeModel: one whole sharded model as a Ray actor, above its Workhorses (DESIGN.md, Layers).

`actor` (the WholeModel Ray actor that owns the Workhorses), `handle` (the `WholeModel` object
users hold), `pending` (a call's answer), `placement` (devices as Ray placement groups), `cluster`
(joining or starting Ray), `standby`, `pretrained`, `errors`. It speaks the fan-out protocol of
`xray/protocol` (dispatch / execute / collect, pure functions).
Importing this package does not import Ray; creating a WholeModel does.
"""
from xray.wholemodel.handle import Pending, WholeModel
from xray.wholemodel.placement import Bundles

__all__ = ["WholeModel", "Pending", "Bundles"]
