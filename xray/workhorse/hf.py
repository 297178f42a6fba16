"""HFWorkhorse: a plain Hugging Face model on one device, data parallel over gloo/NCCL.

The smallest real model behind the Workhorse contract: each shard holds a full copy of a
`transformers` causal LM (no tensor or pipeline parallelism); `forward` gives per-token
log-probabilities of its slice of the batch, and `train_step` averages gradients over the
data-parallel group before one AdamW step. Notebooks and runtime tests use it; it needs no
Megatron or DeepSpeed. On a GPU the model lives on it: each (micro-)batch moves to the model's
device and the answers come back to host memory, as every Workhorse's answers do.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from xray.backends.base import LossFn, apply_loss
from xray.backends.optim import build_optimizer, build_scheduler
from xray.backends.hf_logprobs import hf_logprobs, load_hf
from xray.config.optim import OptimConfig
from xray.data import columns as C
from xray.data.batch import Batch
from xray.data.lengths import train_micro_batches
from xray.protocol import fanout
from xray.workhorse.base import Workhorse, train_step_columns


def _mean_metrics(layout, results: list[dict]) -> dict:
    """Average each metric over data-parallel replicas (one result per shard, all replicas)."""
    keys = results[0].keys()
    return {k: sum(r[k] for r in results) / len(results) for k in keys}


class HFWorkhorse(Workhorse):
    """A data-parallel replica of a Hugging Face causal LM."""

    def setup(self) -> None:
        if self.parallel.tp != 1 or self.parallel.pp != 1:
            raise ValueError("HFWorkhorse is data parallel only; use tp=1 and pp=1, or the megatron backend")
        self.model = load_hf(self.config["model_dir"]).to(self.torch_device)
        self.optim_cfg = self.config.get("optim") or OptimConfig()
        self.optimizer = build_optimizer(self.model.parameters(), self.optim_cfg)
        self.scheduler = build_scheduler(self.optimizer, self.optim_cfg)

    @fanout(dispatch="slice", collect="flatten", reads=C.MODEL_INPUTS)
    def forward(self, batch: Batch) -> Batch:
        """LOGPROBS [b, T-1] of this shard's slice."""
        with torch.no_grad():
            logp = hf_logprobs(self.model, batch.to(self.model_device))
        return Batch({C.LOGPROBS: logp.cpu()})

    @fanout(dispatch="slice", collect=_mean_metrics, reads=train_step_columns)
    def train_step(self, batch: Batch, loss_fn: LossFn, micro_batch_size: int | None = None) -> dict:
        """One optimizer step on this replica's slice (in micro-batches of `micro_batch_size` rows;
        default: the whole slice); gradients averaged over replicas."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        micro = train_micro_batches(batch, loss_fn, micro_batch_size or len(batch))
        total = 0.0
        for mb in micro:
            mb = mb.to(self.model_device)
            loss, _ = apply_loss(loss_fn, {C.LOGPROBS: hf_logprobs(self.model, mb)}, mb)
            (loss / len(micro)).backward()
            total += float(loss.detach()) / len(micro)
        if dist.is_initialized() and self.parallel.dp > 1:
            for p in self.model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= self.parallel.dp
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                              self.optim_cfg.grad_clip or float("inf"))
        self.optimizer.step()
        self.scheduler.step()
        return {"loss": total, "grad_norm": float(norm), "lr": self.scheduler.get_last_lr()[0]}

    @fanout(dispatch="all", collect=lambda layout, results: results[0])
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full weights with Hugging Face names (from rank 0)."""
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    @fanout(dispatch="all", execute="first")
    def save_pretrained(self, directory: str) -> str:
        """Write the model as a Hugging Face directory (with the source's config and tokenizer)."""
        from xray.backends.hf_dir import save_hf_model

        state = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}  # tied: apart
        return str(save_hf_model(state, self.config["model_dir"], directory))
