"""A run: the WholeModels of a plan, its output directory, checkpoints, metrics and progress."""
