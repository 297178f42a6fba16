"""The fan-out protocol: how one call on a WholeModel becomes calls on its shards, and back.

It sits between the backends and the Workhorses (DESIGN.md, Layers): the Workhorses mark their
methods with it, the WholeModel (`xray/wholemodel`) speaks it. `mark` (the decorator), `scatter`
(dispatch), `gather` (collect), `refs` (arguments passed by reference).

A Workhorse method is marked with `@fanout(dispatch=..., execute=..., collect=...)`; the
decorator only attaches metadata, so the Workhorse stays a plain class. Dispatch and collect are
pure functions (no Ray), unit-tested:

- dispatch `all`: every shard gets the same arguments. `slice`: batch-like arguments (Batch,
  tensor, list, tuple) are split into `dp_size` equal parts in order; the shards of one
  data-parallel replica (its TP/PP peers) get the same part. A callable
  `(layout, args, kwargs) -> [(args, kwargs) per shard]` decides freely.
- execute `all`, or `first` (rank 0 alone; never for a method that enters a collective).
- collect `none`: the results of the collector shard of each replica (tp_rank 0 on the last
  pipeline stage), in dp order. `flatten`: those results concatenated (sequence columns of
  Batches right-padded to the widest part). A callable `(layout, results_of_every_shard) ->
  answer` decides freely.
- reads: the Batch columns the method reads (a tuple, or a callable of the call's `(args,
  kwargs)`); only those are shipped. None ships every column.

An argument may also be the answer of another `flatten` call still in the object store, as its
parts (object refs of equal-sized parts in order): `remote_slices` says which parts and rows each
replica takes, as a `PartsSlice` that the receiving Workhorse fetches and `assemble`s itself.
"""
from xray.protocol.gather import collect, collectors, concat
from xray.protocol.mark import ATTR, Collect, Dispatch, DispatchError, FanOut, Reads, fanout, fanout_methods
from xray.protocol.refs import PartsSlice, assemble, remote_slices
from xray.protocol.scatter import dispatch, is_sliceable, part_of_shard, select_columns, slice_parts, split_one

__all__ = ["ATTR", "Collect", "Dispatch", "DispatchError", "FanOut", "PartsSlice", "Reads", "assemble", "collect",
           "collectors", "concat", "dispatch", "fanout", "fanout_methods", "is_sliceable", "part_of_shard",
           "remote_slices", "select_columns", "slice_parts", "split_one"]
