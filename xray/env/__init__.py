"""Environments and tools for multi-turn rollouts: what a model acts on between its turns.

    base.py     the `Env` shape (async reset / step), `ChatObservation` (text that is also chat
                messages), `Guarded` (a failure or a timeout ends the episode with a reason),
                `load_env`, the built-in `ToolEnv` and `GuessEnv`
    tools.py    tool calls (Hermes' JSON format by default, or compact), `ToolRegistry` (with the
                tools' schemas for the prompt), the built-in calculator and Python tools
    tasks.py    built-in tool-use tasks: `builtin:calculator` (seeded arithmetic prompts, the
                environment, tool-use demonstrations for a warm start)
    sandbox.py  the Python sandbox (runs and watches a call; how it ended becomes the observation)
    isolation.py  how the kernel isolates a call: namespaces, a new root, an unprivileged uid, limits
    remote_sandbox.py  the same tool on a remote execution service (SandboxFusion's HTTP API)
"""
