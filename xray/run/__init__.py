"""A run: the WholeModels of a plan, its output directory and metric loggers, checkpoints, the
progress line and the console."""
