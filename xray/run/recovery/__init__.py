"""Recovery: the run goes on after Workhorses die, devices leave or join, or a drain notice comes.

`policy` (the one fault policy: which deaths are recovered, and the one restart budget every
recovery of the run draws on, synchronous or asynchronous), `dead` (finding the dead Workhorses),
`recover` (replacing models and restoring the newest snapshot or checkpoint), `elastic` (device
groups that follow the cluster between a minimum and a maximum).
"""
