"""The parallel dimensions of one model: one validated object, shared by config, runtime and backends.

Sits under `xray/config/` because the config builds it, but it imports nothing heavy: the
WholeModel uses it to plan shards and to dispatch, the backends use it to build process groups.

Rank order follows Megatron-core's default (`tp` fastest, then `dp`, then `pp`):
    rank = tp_rank + tp * (dp_rank + dp * pp_rank)
so the tensor-parallel peers of one shard are neighbours, as NCCL likes them.

Expert parallelism (`ep`, mixture-of-experts models) divides the data-parallel replicas, as in
Megatron-core: the world stays `tp * pp * dp`; each run of `ep` consecutive replicas splits every
MoE layer's experts `ep` ways (the expert-parallel group: `ep_rank = dp_rank % ep`) while the
other weights stay replicated over all `dp`; an expert is then replicated `dp / ep` times (the
expert-data-parallel group).
"""
from __future__ import annotations

from dataclasses import dataclass


class LayoutError(ValueError):
    """A parallel layout that cannot work; the message says how to fix it."""


@dataclass(frozen=True)
class ShardCoords:
    """Where one rank sits in a model's layout."""

    rank: int
    tp_rank: int
    pp_rank: int
    dp_rank: int


@dataclass(frozen=True)
class ParallelDims:
    """Tensor, pipeline and data parallel sizes of one model; `world_size = tp * pp * dp`."""

    tp: int = 1
    """Tensor-parallel size: each layer's weights split over this many devices."""
    pp: int = 1
    """Pipeline-parallel size: the layers split into this many stages."""
    dp: int = 1
    """Data-parallel size: this many replicas, each seeing its own slice of a batch."""
    ep: int = 1
    """Expert-parallel size (mixture-of-experts models): each MoE layer's experts split over this
    many consecutive data-parallel replicas; a divisor of `dp`."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"{name} must be a positive integer, got {value!r}")
        if self.dp % self.ep:
            raise LayoutError(f"ep={self.ep} does not divide dp={self.dp}: experts are split over data-parallel "
                              f"replicas; choose ep among the divisors of {self.dp} (or raise dp)")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def coords(self, rank: int) -> ShardCoords:
        """The (tp, pp, dp) ranks of `rank` in Megatron's default order."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside a layout of {self.world_size} shards")
        tp_rank = rank % self.tp
        dp_rank = (rank // self.tp) % self.dp
        pp_rank = rank // (self.tp * self.dp)
        return ShardCoords(rank=rank, tp_rank=tp_rank, pp_rank=pp_rank, dp_rank=dp_rank)

    def rank_of(self, tp_rank: int, pp_rank: int, dp_rank: int) -> int:
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

    def expert_owner(self, replica: int, expert: int, num_experts: int) -> int:
        """The data-parallel rank holding `expert` (of `num_experts`) for replica `replica`: the
        member of that replica's expert-parallel group whose share it is."""
        return replica - replica % self.ep + expert // (num_experts // self.ep)

    def check_experts(self, num_experts: int) -> None:
        """Raise LayoutError if `ep` cannot split a model with `num_experts` experts per layer."""
        if self.ep > 1 and not num_experts:
            raise LayoutError(f"ep={self.ep} on a dense model: expert parallelism splits the experts of "
                              "mixture-of-experts layers; use ep=1")
        if num_experts % self.ep:
            raise LayoutError(f"ep={self.ep} does not divide the model's {num_experts} experts per layer; "
                              f"choose ep among the divisors of {num_experts} that divide dp={self.dp}")

    def is_collector(self, rank: int) -> bool:
        """True for the shard that answers for its replica: tp_rank 0 on the last pipeline stage."""
        c = self.coords(rank)
        return c.tp_rank == 0 and c.pp_rank == self.pp - 1

    def collectors(self) -> list[int]:
        """The collector rank of each data-parallel replica, in dp order."""
        return [self.rank_of(0, self.pp - 1, d) for d in range(self.dp)]

    def check_model(self, num_layers: int, num_heads: int, num_kv_heads: int) -> None:
        """Raise LayoutError if this layout cannot shard a model of these sizes."""
        if num_heads % self.tp:
            raise LayoutError(
                f"tp={self.tp} does not divide the model's {num_heads} attention heads; "
                f"choose tp among the divisors of {num_heads}")
        if num_kv_heads % self.tp:
            raise LayoutError(
                f"tp={self.tp} does not divide the model's {num_kv_heads} key/value heads; "
                f"choose tp among the divisors of {num_kv_heads}")
        if self.pp > num_layers:
            raise LayoutError(
                f"pp={self.pp} is greater than the model's {num_layers} layers; "
                f"choose pp <= {num_layers}")
