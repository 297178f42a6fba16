"""How a weight sync's bytes travel from the actor's exporting shard to the rollout shards
(DESIGN.md, Layers: above the backends, below the Workhorses that send and receive). `wire` is the
wire form, the checksums both ends compute and the manifest of a push (the object-store
transport is the wire form itself); each other transport is one file holding both halves and
naming its checksum family: `shm` (shared-memory slots, one CPU node), `ipc` (CUDA IPC, one GPU),
`pg` (a torch.distributed process group: gloo, NCCL). `faults` breaks a push on purpose, for the
tests of the verification. The driver's verified sync is `xray/sync`'s.
"""
