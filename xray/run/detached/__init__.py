"""Detached asynchronous runs (`trainer.mode: async`), ColossalChat's design on WholeModels: the
driver's `supervisor` (starts the parts, streams metrics, orders checkpoints, replaces lost
makers), the `buffer` (prompts, admission control, scored groups), experience makers (`maker` for
single completions, `episode_maker` for episodes) and the `trainer`, each a Ray actor with its own
loop.
"""
