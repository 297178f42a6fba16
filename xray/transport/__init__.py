"""How a weight sync's bytes travel from the actor's exporting shard to the rollout shards
(DESIGN.md, Layers: above the backends, below the Workhorses that send and receive). `wire` holds
the two forms a bucket takes (the wire form in host memory, the flat form of a device buffer), the
checksum families both ends compute and the manifest of a push (the object-store transport is the
wire form itself); each other transport is one file holding both halves and naming its checksum
family, which the sender names in every checksum it sends and the receiver checks: `shm`
(shared-memory slots, one CPU node: "xxh3"), `ipc` (CUDA IPC, one GPU: "pw64"), `pg` (a
torch.distributed process group: "pw64" over NCCL, "xxh3" over gloo). `errors` holds
`WeightSyncError`; `faults` breaks a push on purpose, for the tests of the verification. The
driver's verified sync is `xray/sync`'s.
"""
