"""The DeepSpeed training backend: ZeRO stage 1, 2 or 3 over Hugging Face models.

`load_backend("deepspeed")` imports this package, which imports the `deepspeed` library (absolute
imports: inside this package `import deepspeed` is the library, never this package). Files:
`engine.py` (DeepSpeedEngine, build_engine: the TrainEngine contract), `config.py` (the
DeepSpeed config dict), `model.py` (the modules per role and their outputs), `export.py`
(bucketed full-weight export, gathering ZeRO-3 shards), `checkpoint_weights.py` (a checkpoint's full
tensors from its files alone, through DeepSpeed's `zero_to_fp32`: `python -m xray.export`). Batch arithmetic for elastic world sizes
is in `xray/config/elasticity.py`, its DeepSpeed config keys in `xray/backends/elastic.py`.
"""
from xray.backends.deepspeed.config import ZeroOptions
from xray.backends.deepspeed.engine import DeepSpeedEngine, build_engine

__all__ = ["DeepSpeedEngine", "ZeroOptions", "build_engine", "preload"]


def preload() -> None:
    """Import what a build needs beyond this package (transformers' model classes) ahead of it: a
    standby Workhorse's warm-up (`xray/wholemodel/standby.py`)."""
    import transformers  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401 - the lazy module's model machinery
