"""Reward functions: Python callables following TRL's convention, named `module:function` in a config."""
