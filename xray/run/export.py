"""A run's step checkpoint as a Hugging Face directory: what `python -m xray.export` does.

Sits in the run layer, beside the export a run makes at its end (`xray/run/final.py`); the command
line is `xray/export.py`. `export_checkpoint(RUN/checkpoints/step-N, OUT, role)` reads the role's
files of that checkpoint with its training backend's reader, from the files alone (no Ray, no
process group, no GPU): `xray/backends/megatron/checkpoint_weights.py` (one file per rank) or
`xray/backends/deepspeed/checkpoint_weights.py` (DeepSpeed's own checkpoint). Full fine-tuning
writes the weights with the source model's config and tokenizer (`save_hf_model`): the
directory the run's `final/actor` would be after that step, bit for bit. A LoRA run's checkpoint
holds only the adapters: they are written as a `peft` adapter directory, as `final/adapter`.

The source model directory comes from `--model-dir`, else from the checkpoint (`model_dir` in its
`trainer_state.json`, written by `xray.run.resume.save_checkpoint`), else from the run's
`config.yaml` (the role's `model_path`, or `model.path`).
"""
from __future__ import annotations

import contextlib
import logging
import sys
from pathlib import Path

import torch

from xray.backends.hf_dir import save_hf_model
from xray.backends.lora import save_adapter
from xray.builtin.smollm2 import SMOLLM2_MODEL
from xray.config.lora import PEFT_PREFIX, LoraConfig
from xray.config.typed import build
from xray.config.yaml_text import load_yaml
from xray.run.inputs import model_directory
from xray.run.outputs import TRAINER_STATE, read_trainer_state

log = logging.getLogger(__name__)
ROLES = ("actor", "critic")
"""The roles a checkpoint holds (those that train)."""


class ExportError(ValueError):
    """A checkpoint that cannot be exported as asked; the message says the fix."""


def run_config(checkpoint: Path) -> dict:
    """The run's resolved config (`config.yaml` two levels above a step checkpoint), as plain data;
    empty if the checkpoint was moved away from its run."""
    path = checkpoint.parent.parent / "config.yaml"
    return (load_yaml(path.read_text()) or {}) if path.is_file() else {}


def source_model_dir(checkpoint: Path, role: str, config: dict, given: str | None = None) -> str:
    """The model directory the role was built from: its config and tokenizer go with the export."""
    if given:
        return model_directory(given)
    recorded = read_trainer_state(checkpoint).get("model_dir")
    candidates = [(config.get(role) or {}).get("model_path"), recorded, (config.get("model") or {}).get("path")]
    for path in candidates:
        if path and (path == SMOLLM2_MODEL or Path(path, "config.json").is_file()):
            return model_directory(path)
    raise ExportError(f"the model directory {checkpoint} was trained from is not known or gone (tried "
                      f"{[c for c in candidates if c]}); pass it with --model-dir DIR (its config.json and "
                      "tokenizer files are copied into the export)")


def checkpoint_tensors(role_dir: Path) -> dict[str, torch.Tensor]:
    """Hugging Face name -> full tensor of one role's checkpoint, by its backend's reader."""
    from xray.backends.megatron.checkpoint_weights import is_megatron_checkpoint

    if is_megatron_checkpoint(role_dir):
        from xray.backends.megatron.checkpoint_weights import checkpoint_tensors as megatron_tensors

        return megatron_tensors(role_dir)
    if (role_dir / "latest").is_file():
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's logger writes to the stdout it finds at import
            from xray.backends.deepspeed.checkpoint_weights import checkpoint_tensors as deepspeed_tensors

            return deepspeed_tensors(role_dir)
    raise ExportError(f"{role_dir} holds neither a Megatron checkpoint (rank00000.pt) nor a DeepSpeed one "
                      "(latest); give a step directory a run wrote (RUN/checkpoints/step-N)")


def export_checkpoint(checkpoint: str | Path, out: str | Path, role: str = "actor",
                      model_dir: str | None = None) -> Path:
    """Write `role`'s weights at step checkpoint `checkpoint` into `out` as a Hugging Face model
    directory (a `peft` adapter directory for a LoRA run); returns `out`."""
    checkpoint, out = Path(checkpoint), Path(out)
    if not (checkpoint / TRAINER_STATE).is_file():
        raise ExportError(f"{checkpoint} is not a complete checkpoint (no {TRAINER_STATE}); give one of "
                          f"RUN/checkpoints/step-N with that file (an incomplete one was never finished)")
    role_dir = checkpoint / role
    if not role_dir.is_dir():
        held = [r for r in ROLES if (checkpoint / r).is_dir()]
        raise ExportError(f"{checkpoint} holds no {role!r} checkpoint; choose --role among {held}")
    config = run_config(checkpoint)
    source = source_model_dir(checkpoint, role, config, model_dir)
    tensors = checkpoint_tensors(role_dir)
    step = read_trainer_state(checkpoint).get("step")
    if any(name.startswith(PEFT_PREFIX) for name in tensors):
        if role != "actor":
            raise ExportError(f"the {role}'s checkpoint holds LoRA adapters and its head: only an actor's adapters "
                              "export (as a peft directory); export --role actor")
        lora = (config.get(role) or {}).get("lora")
        if lora is None:
            raise ExportError(f"the checkpoint holds LoRA adapters but {checkpoint.parent.parent / 'config.yaml'} "
                              f"has no {role}.lora section; export from inside the run's output directory")
        written = save_adapter(out, tensors, build(LoraConfig, lora, f"{role}.lora"), source)
        log.info("step %s's %s adapters written to %s (peft)", step, role, written)
        return written
    written = save_hf_model(tensors, source, out)
    log.info("step %s's %s written to %s (%d tensors; config and tokenizer from %s)", step, role, written,
             len(tensors), source)
    return written
