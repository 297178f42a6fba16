"""A run's final export of its trained actor: what `RUN_DIR/final/` holds at the end.

Sits in the run layer; the algorithms call `export_actor` after their last step. Full
fine-tuning writes a Hugging Face directory (`final/actor`). A LoRA run writes the adapters as a
`peft` directory (`final/adapter`, loaded by `peft.PeftModel.from_pretrained` on the base model,
or by vLLM's LoRA support), and also the merged model as `final/actor` when
`actor.lora.export_merged` asks for it.
"""
from __future__ import annotations

import logging
from pathlib import Path

from xray.backends.hf_dir import save_hf_model
from xray.config.lora import LoraConfig

log = logging.getLogger(__name__)


def export_actor(actor, lora: LoraConfig | None, model_dir: str, final: Path) -> Path:
    """Export the trained actor (a WholeModel) under `final`, blocking (an event loop runs it in a
    thread: `asyncio.to_thread`); returns the directory a user loads next: `final/actor` (full
    weights), or with LoRA `final/adapter`."""
    if lora is None:
        return save_hf_model(actor.state_dict().get(), model_dir, final / "actor")
    adapter = Path(actor.save_adapter(str(final / "adapter")).get())
    log.info("LoRA adapters written to %s (peft)", adapter)
    if lora.export_merged:
        merged = save_hf_model(actor.state_dict().get(), model_dir, final / "actor")
        log.info("merged model written to %s", merged)
    return adapter
