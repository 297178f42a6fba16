"""The Megatron-core training backend: `load_backend("megatron")` imports this package.

Files, in the order a build goes through them:
    spec.py        HF config.json -> ModelSpec; check_layout (before anything is built)
    rope.py        the config's RoPE: base, Llama 3 scaling (its inverse frequencies)
    convert.py     which HF tensors make each Megatron shard (QKV / gate-up fusion, TP splits)
    hf_weights.py  reading tensors from the directory's safetensors
    model.py       this rank's GPTModel (or critic trunk + ValueHead), filled from HF
    lora.py        LoRA adapters on the parallel linear layers (peft names, TP-sharded)
    logprobs.py    log-probs and entropy from vocabulary-parallel logits
    grads.py       data-parallel mean, tied embeddings, global-norm clipping
    export.py      full HF-named weights streamed to rank 0 in buckets
    checkpoint.py  sharded save / load of the training state
    checkpoint_weights.py  a checkpoint's full HF tensors from its files alone (`python -m xray.export`)
    engine.py      MegatronEngine (TrainEngine) and build_engine
    imports.py     importing megatron-core fast (torch.compile deferred), and preload
CPU adaptations live in `xray/backends/cpu_compat.py`.
"""
from xray.backends.megatron.engine import EngineUsageError, MegatronEngine, build_engine
from xray.backends.megatron.imports import preload
from xray.backends.megatron.spec import ModelSpec, UnsupportedModelError, check_layout, read_spec

__all__ = ["EngineUsageError", "MegatronEngine", "ModelSpec", "UnsupportedModelError",
           "build_engine", "check_layout", "preload", "read_spec"]
