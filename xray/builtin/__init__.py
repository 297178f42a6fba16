"""What `builtin:` names in a config: the tiny Llama (`model.path: builtin:tiny-llama`, built
locally and seeded: there is no model hub on our machines, so tests and benchmarks build their
models here too) and the tasks with a verifiable reward (`data.path: builtin:arith`, `arith_small`,
`reverse`). The registry of tasks is `xray.builtin.tasks`; the supervised warm start of the tiny
Llama is an algorithm (`algorithms.warm_start`).
"""
