"""The Hugging Face tensors of a DeepSpeed checkpoint, read from its files alone.

Used by `python -m xray.export` (`xray/run/export.py`): no process group, no engine, no GPU. A
checkpoint is DeepSpeed's own (`DeepSpeedEngine.snapshot`): a `latest` file naming the tag, and
under it the module's states and every data-parallel rank's ZeRO partition of the optimizer's fp32
weights. DeepSpeed's `zero_to_fp32` merges those partitions, of any stage and data-parallel size,
into full fp32 tensors; each is cast back to the dtype the module held (bf16 weights are the
rounding of their fp32 main copies, so the cast gives them back bit for bit), and the module's
buffers and tied aliases are left out, as the engine's export leaves them. A LoRA checkpoint's
adapters come out alone, under their `peft` names.
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch

from xray.backends.deepspeed.lora import is_adapter, peft_name


def is_deepspeed_checkpoint(directory: str | Path) -> bool:
    return (Path(directory) / "latest").is_file()


def _module_states(directory: Path, tag: str) -> dict:
    """The module's states file of the checkpoint (ZeRO-3 writes one per rank: rank 0's)."""
    found = sorted((directory / tag).glob("*model_states.pt"))
    if not found:
        raise FileNotFoundError(f"{directory / tag} holds no *model_states.pt: the DeepSpeed checkpoint is "
                                "incomplete; export another step")
    return torch.load(found[0], map_location="cpu", weights_only=False, mmap=True)


def checkpoint_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """Hugging Face name -> full tensor, of the checkpoint of one role in `directory` (the role's
    folder of a step checkpoint, holding `latest`): every parameter in the module's dtype, or with
    LoRA the adapters alone (`peft` names)."""
    directory = Path(directory)
    tag = (directory / "latest").read_text().strip()
    states = _module_states(directory, tag)
    module = states["module"]
    if any((directory / tag).glob("*optim_states.pt")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with contextlib.redirect_stdout(sys.stderr):  # its progress lines are not the command's output
            full = get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=tag, exclude_frozen_parameters=False)
    else:  # no ZeRO partitions: the module's states are whole
        full = dict(module)
    left_out = set(states.get("buffer_names") or ()) | set(states.get("shared_params") or {})
    out = {name: t.to(module[name].dtype if name in module else t.dtype).clone()
           for name, t in full.items() if name not in left_out}
    if any(is_adapter(name) for name in out):
        return {peft_name(name): t for name, t in out.items() if is_adapter(name)}
    return out
