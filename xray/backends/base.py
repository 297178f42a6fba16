"""The two contracts every backend meets: a training engine and a generation engine.

An engine is the per-device object a Workhorse holds: one shard of one model. It lives in a
process whose `torch.distributed` default group is already initialised by the Workhorse over
exactly that model's shards (gloo on CPU, NCCL on GPU); the engine builds its own sub-groups
(Megatron's tensor / pipeline / data groups, DeepSpeed's ZeRO group) inside it.

Backends never import Ray, and nothing imports a backend at `import xray` time: the registry in
`xray.backends` loads them lazily by name.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from xray.config.optim import OptimConfig  # noqa: F401 - part of the backend contract
from xray.config.parallel import ParallelDims
from xray.data.batch import Batch

if TYPE_CHECKING:
    from xray.backends.export_digest import ExportCheck
    from xray.backends.snapshot import Snapshot
    from xray.config.lora import LoraConfig

# A loss function for `TrainEngine.train_step`: given the model outputs of one micro-batch
# (keys from xray.data.columns: LOGPROBS and ENTROPY for a policy head, VALUES for a value head;
# each [b, T-1]) and that micro-batch, return the scalar loss and float metrics to report, or the
# scalar loss alone (engines call it through `apply_loss`).
# An optional attribute `reads` (column names) says which batch columns it uses besides the
# model inputs; a train step through a WholeModel then ships only those.
# An optional true attribute `by_length` lets the engine form micro-batches of rows of similar
# length, each cut to its longest row (`xray.data.lengths`); such a loss must divide by the
# slice-wide counts that module puts in each micro-batch's meta.
LossFn = Callable[[dict[str, torch.Tensor], Batch], "tuple[torch.Tensor, dict[str, float]]"]

def apply_loss(loss_fn: LossFn, outputs: dict[str, torch.Tensor], batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
    """`loss_fn(outputs, batch)` as (loss, metrics): a bare loss tensor gets no metrics."""
    result = loss_fn(outputs, batch)
    if isinstance(result, torch.Tensor):
        return result, {}
    return result


# Full tensors with Hugging Face names, in buckets of bounded size.
WeightBucket = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class ShardInfo:
    """What a shard reports about itself, so its WholeModel knows who collects."""

    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    collects: bool
    """True for the shard whose answer stands for its data-parallel replica."""


class TrainEngine(ABC):
    """One shard of a trainable model (actor, critic or reference)."""

    @abstractmethod
    def shard_info(self) -> ShardInfo:
        """This shard's ranks and whether it collects for its replica."""

    lora: "LoraConfig | None" = None
    """The role's LoRA settings when it trains adapters (`xray/config/lora.py`), else None."""

    @abstractmethod
    def forward(self, batch: Batch, entropy: bool = False, adapters: bool = True) -> dict[str, torch.Tensor] | None:
        """Outputs for `batch` (INPUT_IDS, ATTENTION_MASK), in micro-batches of the engine's
        forward micro-batch size: LOGPROBS [B, T-1] (and ENTROPY if `entropy`) for a policy head,
        VALUES [B, T-1] for a value head. Returns None on non-collecting shards. With LoRA,
        `adapters=False` computes with the adapters off: the frozen base model (the reference)."""

    @abstractmethod
    def train_step(self, batch: Batch, loss_fn: LossFn, micro_batch_size: int) -> dict[str, float]:
        """One optimizer step over `batch` (this replica's slice), in micro-batches; gradients
        all-reduced over data parallel, clipped, stepped. Returns metrics averaged over the
        micro-batches and replicas (loss, grad_norm, lr, and the loss function's metrics)."""

    @abstractmethod
    def export_weights(self, bucket_bytes: int = 64 << 20, replica: int = 0,
                       check: bool = True) -> Iterator[WeightBucket]:
        """Yield the full weights with Hugging Face names, in buckets of at most `bucket_bytes`
        (a single larger tensor is its own bucket), from data-parallel replica `replica`. Every
        shard must iterate (gathers are collective); only the shard where `exports(replica)` is
        true yields tensors.
        `check`: digest the shards and judge the export (`export_check`); off, no digest is made
        (a sync that is not verified, a checkpoint or `state_dict` export)."""

    _export_check: "ExportCheck | None" = None

    def export_check(self) -> dict | None:
        """On the exporting shard, the digest check of the last `export_weights` run to its end
        (`xray/backends/export_digest.py`: tensors checked, mismatched, diverged replicas); None
        elsewhere, and on an engine that does not check its export."""
        return None if self._export_check is None else self._export_check.as_dict()

    def export_adapter(self, replica: int = 0) -> dict[str, torch.Tensor] | None:
        """With LoRA: the full adapter tensors of data-parallel replica `replica` with `peft` names
        (`xray.config.lora.peft_names`), on the shard where `exports(replica)` is true (None on the
        others; every shard must call: gathers are collective). `export_weights` then yields the
        merged weights (W + alpha/r B A). Without LoRA it raises."""
        raise NotImplementedError(f"{type(self).__name__} trains no LoRA adapters; set <role>.lora to train them")

    def state_bytes(self) -> dict[str, int]:
        """This shard's bytes of trainable parameters and of optimizer state
        (`xray.backends.optim.state_bytes`): what LoRA shrinks (benchmarks/lora.py)."""
        raise NotImplementedError(f"{type(self).__name__} does not report its state bytes")

    @abstractmethod
    def exports(self, replica: int = 0) -> bool:
        """True on the one shard that yields the weights exported from `replica` (its first rank;
        global rank 0 for replica 0)."""

    @abstractmethod
    def save(self, directory: str) -> None:
        """Save this shard's full training state (weights, optimizer, scheduler, RNG)."""

    @abstractmethod
    def snapshot(self, directory: str) -> "Snapshot":
        """Copy this shard's full training state into host memory now (blocking) and return it as
        the files `save(directory)` would write, with the call that writes them, to run in the
        background (a flash checkpoint; see `xray/backends/snapshot.py`)."""

    def restore_ranks(self, saved) -> list[int]:
        """The ranks of layout `saved` (ParallelDims) whose files a restore into this engine's other
        layout reads; default every rank's."""
        return list(range(saved.world_size))

    def as_rank(self, files: dict, directory: str, source: int, rank: int) -> dict:
        """`files` (held files of rank `source` of checkpoint `directory`) as rank `rank`'s: for an
        engine whose data-parallel replicas' files are alike (`Engine.replicas_identical`), a
        restore reads a lost rank's file from a peer's."""
        raise NotImplementedError(f"{type(self).__name__} keeps each data-parallel replica's own files; "
                                  "restore every rank from its own (or its copy on another node)")

    @abstractmethod
    def load(self, directory: str, held: dict | None = None, complete: bool = False) -> None:
        """Load what `save` wrote, into a freshly built engine (of this layout or another: resharded);
        files that `held` (path -> object, a snapshot's files) holds are read from it instead of the
        disk. `complete`: `held` has every rank's files (a snapshot of another layout), else only
        this rank's and rank 0's."""

    def close(self) -> None:
        """Leave the process groups this engine's library built over the default group (its own
        module-level state), so that the process can join a new default group and build again: a
        survivor of a lost shard re-forming its model's groups (`Workhorse.rejoin`). The default
        group itself is left by the caller. Default: the engine keeps no such state."""


class GenerationEngine(ABC):
    """One data-parallel replica of a rollout engine (vLLM, DeepSpeed-Inference)."""

    @abstractmethod
    def generate(self, prompts: list[list[int]], sampling: dict[str, Any]) -> Batch:
        """Sample responses. `sampling` holds temperature, top_p, top_k, max_new_tokens, n,
        stop_token_ids, seed. Returns a Batch with list columns PROMPT_IDS, RESPONSE_IDS,
        "response_logprobs" (list of lists of float) and "finish_reason", n rows per prompt."""

    @abstractmethod
    def load_weights(self, bucket: WeightBucket, check: bool = True) -> None:
        """Load full tensors with Hugging Face names in place; with `check`, then check what the
        engine holds against them (`held_check` reports it)."""

    @abstractmethod
    def logprobs(self, sequences: list[list[int]], prompt_lens: list[int]) -> list[list[float]]:
        """Log-probabilities of each sequence's tokens after its prompt, as the engine computes
        them (used to verify a weight sync)."""

    def finish_load(self) -> None:
        """Called once a sync's last bucket is loaded, before `held_check`: an engine that applies
        what it received as a whole (an adapter) does it here. Default: nothing."""

    def takes_adapter(self) -> bool:
        """Whether the engine serves a LoRA adapter synced alone (the actor then sends only its
        adapter tensors, with `peft` names); default False: it takes merged full weights."""
        return False

    def weight_names(self) -> dict | None:
        """The Hugging Face names a full sync must write ("needs") and the names this engine can
        take ("takes"), for the completeness check of `xray.sync.manifest.check_complete`; None
        where the engine takes an adapter alone or does not say."""
        return None

    def pending_weights(self) -> list[str]:
        """Names loaded but not applied yet (vLLM: a fused layer still incomplete); default none."""
        return []

    def not_reloaded(self) -> list[str]:
        """The engine's own account of the parameters no load since the last call wrote (vLLM);
        default none."""
        return []

    def drop_pending(self) -> list[str]:
        """`pending_weights`, forgotten: the end of a sync, which fails if any (the next one
        starts clean)."""
        return []

    def held_check(self) -> dict:
        """Since the last call: how many loaded tensors the engine was seen to hold exactly, was
        seen to compute with functionally, could not check, or holds otherwise, and the names
        given a verdict (`xray/backends/held.py`, `HeldCheck.take`). Default: none checked, which
        fails a verified sync that loaded anything (`xray/sync/coverage.py`): an engine must check
        what it holds."""
        return {"exact": 0, "functional": 0, "unchecked": 0, "mismatched": [], "checked": []}

    def held_tensors(self) -> list[str] | None:
        """The engine tensors the loads since the last call wrote (reset afterwards), named as its
        held check names them (vLLM: a fused layer once, `...qkv_proj.weight`): a verified sync
        fails unless each got exactly one verdict (`xray/sync/coverage.py`). Default None (the
        engine does not say), which fails a verified sync."""
        return None

    def sleep(self) -> bool:
        """Free the engine's device memory until `wake_up`, where the engine can (vLLM built with
        sleep mode, on GPU); default: nothing. True when the engine sleeps now."""
        return False

    def wake_up(self) -> bool:
        """Take back what `sleep` freed, before generating or loading weights; default: nothing.
        True when the engine was asleep."""
        return False


def layout_of(parallel: ParallelDims, rank: int) -> ShardInfo:
    """The ShardInfo of `rank` in Megatron's default rank order."""
    c = parallel.coords(rank)
    return ShardInfo(rank=rank, world_size=parallel.world_size, tp_rank=c.tp_rank, tp_size=parallel.tp,
                     pp_rank=c.pp_rank, pp_size=parallel.pp, dp_rank=c.dp_rank, dp_size=parallel.dp,
                     collects=parallel.is_collector(rank))
