"""bf16 training of a Megatron shard through Megatron-core's own mixed-precision machinery.

Used by `xray.backends.megatron.engine` when the engine's dtype is bfloat16 (the fp32 path keeps
the plain torch AdamW of `xray/backends/optim.py`, step for step equal to the single-process
reference). Here the GPTModel holds bf16 parameters and is wrapped as Megatron trains it:
`Float16Module` (floating inputs to bf16, the last stage's output back to fp32), then Megatron's
`DistributedDataParallel` (fp32 gradient buffers, `grad_reduce_in_fp32`: gradients accumulate
over micro-batches and reduce over data-parallel replicas in fp32), and Megatron's optimizer
(`Float16OptimizerWithFloat16Params` inside a `ChainedOptimizer`: fp32 main weights, the
gradient norm over the model-parallel group, clipping, AdamW on the main weights, bf16 copies
written back). The same weight decay applies to every parameter, as in the fp32 path. On CPU the
engine opens `cpu_compat.on_cpu()` around all of it (Megatron checks `param.type()` for CUDA
names there).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from xray.backends.base import OptimConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a config's dtype name; ValueError naming the choices otherwise."""
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r} is not supported; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


@dataclass
class Mixed:
    """A bf16 shard's wrappers: `runner` is what the pipeline schedule calls, `optimizer` is
    Megatron's (None for a reference), `scheduler` the shared warm-up on its fp32 param groups."""

    runner: torch.nn.Module
    optimizer: object | None
    scheduler: torch.optim.lr_scheduler.LambdaLR | None

    def zero_grad(self) -> None:
        self.runner.zero_grad_buffer()
        self.optimizer.zero_grad()

    def finish_grads(self) -> None:
        """Data-parallel reduction (fp32 buffers) and the tied-embedding sum across stages."""
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.runner])

    def step(self) -> float:
        """Clip, step AdamW on the fp32 main weights, copy them back to bf16; the global grad norm."""
        ok, norm, _ = self.optimizer.step()
        if not ok:
            raise FloatingPointError("Megatron's optimizer refused the step (a non-finite gradient); "
                                     "lower the learning rate or check the loss")
        return float(norm)


def wrap(model: torch.nn.Module, optim: OptimConfig | None) -> Mixed:
    """Wrap a bf16 GPTModel for training (`optim` given) or forward only (a reference)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    from xray.backends.optim import build_scheduler

    config = model.config
    half = Float16Module(config, model)
    if optim is None:
        return Mixed(half, None, None)
    runner = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), half)
    opt_config = OptimizerConfig(
        optimizer="adam", lr=optim.lr, weight_decay=optim.weight_decay, adam_beta1=optim.betas[0],
        adam_beta2=optim.betas[1], adam_eps=optim.eps, clip_grad=float(optim.grad_clip), bf16=True,
        params_dtype=torch.bfloat16, decoupled_weight_decay=True)
    optimizer = get_megatron_optimizer(opt_config, [runner], config_overrides={})  # {}: decay on every tensor
    inner = [o.optimizer for o in optimizer.chained_optimizers]
    assert len(inner) in (1, 2), "one model chunk gives one optimizer (and one for its experts when ep > 1)"
    return Mixed(runner, optimizer, build_scheduler(inner[0] if len(inner) == 1 else _Groups(inner), optim))


class _Groups(torch.optim.Optimizer):
    """The parameter groups of several optimizers seen as one, so that one warm-up schedule sets
    every group's lr: Megatron keeps the experts (ep > 1) in an optimizer of their own. It is never
    stepped itself; Megatron's chained optimizer steps the real ones."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):  # noqa: super().__init__ would want parameters
        self.param_groups = [g for o in optimizers for g in o.param_groups]
        self.defaults, self.state = {}, {}
        self._opt_called = True  # the schedule's "stepped before the optimizer" warning does not apply

    def step(self, closure=None):
        return None
