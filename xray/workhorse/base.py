"""Workhorse: one device's shard of one model. The base class every role's Workhorse extends.

A Workhorse is a plain Python class (testable without Ray); its WholeModel runs it as a Ray
actor, one per device. Its life: built with its role, rank and the model's parallel layout ->
`address()` on rank 0 gives the rendezvous point -> `start()` on every shard: `init_dist()` joins
the model's `torch.distributed` group (NCCL on GPU, gloo on CPU), `setup()` builds the shard (a
backend engine, in the role Workhorses), `shard_info()` tells the WholeModel who collects ->
marked methods (`@fanout`) serve calls. Errors leave a Workhorse as themselves when they can be
pickled, else as their text (`portable_errors`).

Each Workhorse seeds torch, numpy and random from (run seed, role, rank), fixes its torch thread
count, and logs with its role and ranks in every line. It keeps its busy time (`BusyRecorder` in
`xray.workhorse.busy`): the run's timeline of a step and the benchmarks read it.
"""
from __future__ import annotations

import logging
import os
import pickle
import random
import time
import traceback
import zlib
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from xray.backends.base import ShardInfo, layout_of
from xray.config.parallel import ParallelDims
from xray.data.columns import MODEL_INPUTS
from xray.protocol import PartsSlice, assemble, fanout
from xray.workhorse.busy import BusyRecorder
from xray.workhorse.quiet import install_filters

log = logging.getLogger(__name__)


def shard_seed(seed: int, role: str, rank: int) -> int:
    """A 31-bit seed from (run seed, role, rank): distinct per shard, the same on every rerun."""
    return zlib.crc32(f"{seed}:{role}:{rank}".encode()) & 0x7FFFFFFF


def node_ip() -> str:
    """This node's address as Ray knows it (127.0.0.1 for a local cluster bound to loopback)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"


class WorkhorseError(RuntimeError):
    """An error raised in a Workhorse whose own type cannot cross processes, kept as its text."""


@contextmanager
def portable_errors() -> Iterator[None]:
    """Let exceptions through as they are when they can be pickled, else as a WorkhorseError with
    the same type name, message and traceback text (never Ray's `... isn't serializable`)."""
    try:
        yield
    except Exception as exc:
        try:
            pickle.loads(pickle.dumps(exc))
        except Exception:  # noqa: BLE001 - any failure to round-trip means: send text
            text = "".join(traceback.format_exception(exc))
            raise WorkhorseError(f"{type(exc).__name__}: {exc}\n{text}") from None
        raise


def train_step_columns(args: tuple, kwargs: dict) -> tuple[str, ...] | None:
    """What `train_step(batch, loss_fn, ...)` ships: the model inputs and the columns the loss
    function says it reads (`loss_fn.reads`); every column if it does not say."""
    loss_fn = kwargs.get("loss_fn", args[1] if len(args) > 1 else None)
    reads = getattr(loss_fn, "reads", None)
    return None if reads is None else (*MODEL_INPUTS, *reads)


def _resolved(value: Any) -> Any:
    """A `PartsSlice` fetched from the object store and cut to its rows; anything else as is."""
    if not isinstance(value, PartsSlice):
        return value
    import ray

    return assemble(ray.get(list(value.parts)), value)


def pin_to_cpu_device(index: int, threads: int) -> list[int]:
    """Pin this process to CPU device `index` of its node: cores [index x threads, (index + 1) x
    threads), wrapped around the cores the process may use (`pin_cpu_devices` in the run config),
    so Workhorses placed on one CPU device share its cores as roles placed on one GPU share it."""
    import os

    allowed = sorted(os.sched_getaffinity(0))
    cores = sorted({allowed[(index * threads + k) % len(allowed)] for k in range(threads)})
    os.sched_setaffinity(0, cores)
    return cores


class Workhorse(BusyRecorder):
    """One shard of one model. Subclasses add `setup()` and `@fanout` methods."""

    REJOINS = False
    """Whether a live shard of this class can leave its model's process group and build again in
    a new one, in its own process (`rejoin`): its model's restart after another shard's loss then
    keeps it instead of starting a new process (`WholeModelActor.restart`)."""

    def __init__(self, role: str, rank: int, parallel: ParallelDims, seed: int = 0,
                 device: str = "cpu", threads: int = 1, standby: bool = False, **config: Any):
        install_filters()  # the libraries' start-up noise stays out of the console (xray.workhorse.quiet)
        self.role, self.rank, self.parallel = role, rank, parallel
        self.device = device.lower()
        self.threads = threads
        self.standby = standby
        """A standby process (`xray/wholemodel/standby.py`): warm, in no group, until `become`."""
        cpu_devices = config.pop("cpu_devices", None)
        if cpu_devices is not None and not standby:
            pin_to_cpu_device(cpu_devices[rank], threads)
        self.config = config
        self.base_seed = seed
        """The run's seed, the same on every rank (`seed` is this shard's, `shard_seed`)."""
        self.seed = shard_seed(seed, role, rank)
        self.log = logging.LoggerAdapter(log, {"role": role, "rank": rank})
        self._init_busy()
        try:
            from xray.workhorse.drain import listen

            if not standby:  # SIGTERM: a drain notice to the run, then an exit (xray/workhorse/drain.py)
                listen(role, rank)
        except Exception as exc:  # noqa: BLE001 - outside Ray (a unit test's engine): SIGTERM as usual
            self.log.debug("no drain listener: %s", exc)
        torch.set_num_threads(threads)
        self._seed_all()

    def _seed_all(self) -> None:
        """torch, numpy and random seeded from this shard's seed (`shard_seed`)."""
        random.seed(self.seed)
        torch.manual_seed(self.seed)
        try:
            import numpy as np

            np.random.seed(self.seed)
        except ImportError:
            pass

    # -- standby: a process started ahead of need (`xray/wholemodel/standby.py`) ------------------
    def warm(self) -> int:
        """Import what `setup` will need, so that a standby process builds its shard in a fraction
        of a cold start (subclasses: their backend's libraries). Returns this process's pid."""
        return os.getpid()

    def become(self, rank: int, parallel: ParallelDims, **init_kwargs: Any) -> int:
        """A standby process takes shard `rank` of layout `parallel`, built with `init_kwargs` (as a
        new Workhorse's constructor would be); `start` follows. Returns this process's pid."""
        if not self.standby:
            raise RuntimeError(f"{self.role} rank {self.rank} is a serving Workhorse, not a standby one")
        self.__init__(self.role, rank, parallel, **init_kwargs)
        self.log.info("standby process %d became %s rank %d", os.getpid(), self.role, rank)
        return os.getpid()

    # -- life cycle, called by the WholeModel in this order ------------------------------------
    def address(self) -> tuple[str, int]:
        """A rendezvous point of this shard's node, served by this process (asked of rank 0):
        its address and port, bound before they are told (`xray/transport/rendezvous.py`)."""
        from xray.transport.rendezvous import open_point

        return open_point(node_ip())

    def init_dist(self, master_addr: str, master_port: int, timeout_s: float = 300.0) -> None:
        """Join this model's process group: NCCL on GPU, gloo on CPU."""
        import torch.distributed as dist

        from xray.transport.rendezvous import join_world

        backend = "nccl" if self.device == "gpu" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(0)  # Ray exposes this Workhorse's GPU as device 0
        if not dist.is_initialized():
            join_world(backend, master_addr, master_port, self.rank, self.parallel.world_size, timeout_s)
        self.log.info("%s joined %s group of %d at %s:%d", self.role, backend,
                      self.parallel.world_size, master_addr, master_port)

    def start(self, master_addr: str, master_port: int) -> ShardInfo:
        """`init_dist`, `setup`, then this shard's info: the WholeModel's one start-up call."""
        with portable_errors():
            self.init_dist(master_addr, master_port)
            self.setup()
            return self.shard_info()

    def setup(self) -> None:
        """Build this shard (subclasses: the backend engine). Runs after `init_dist`."""

    # -- survivors: a restart that keeps this process (`WholeModelActor.restart`) --------------
    def survives(self) -> int | None:
        """This process's pid when it can take part in its model's restart as itself (its class
        rejoins, it is no standby and got no drain notice: a SIGTERMed process exits at its
        grace); None when it must be replaced."""
        from xray.workhorse.drain import draining

        return None if not self.REJOINS or self.standby or draining() else os.getpid()

    def rejoin(self, master_addr: str, master_port: int, rank: int | None = None,
               parallel: ParallelDims | None = None, init_kwargs: dict | None = None) -> ShardInfo:
        """A survivor's `start`: release the shard it holds and its model's old process groups
        (`teardown`; the old group may have lost a peer mid-collective), take its place in the new
        layout when given (`relayout`: an elastic resize may renumber it, change the data-parallel
        size and the build arguments), reseed as a new process would be, then join the new group
        and build again (`start`). The caller restores the state (a snapshot every shard can read)."""
        import torch.distributed as dist

        with portable_errors():
            t0 = time.perf_counter()
            self.teardown()
            if dist.is_initialized():
                dist.destroy_process_group()
            if rank is not None:
                self.relayout(rank, parallel or self.parallel, init_kwargs)
            self._seed_all()
            self.log.info("%s rank %d rejoins its model in process %d (its shard released in %.2f s)", self.role,
                          self.rank, os.getpid(), time.perf_counter() - t0)
        return self.start(master_addr, master_port)

    def relayout(self, rank: int, parallel: ParallelDims, init_kwargs: dict | None = None) -> None:
        """Become shard `rank` of layout `parallel`, built with `init_kwargs` (as the constructor
        takes them), in this process: its rank, layout, seed, build arguments and drain notice
        change; its CPU pinning does not (it stays on its device, the bundle it kept)."""
        kwargs = dict(init_kwargs if init_kwargs is not None else dict(self.config, seed=self.base_seed))
        seed = kwargs.pop("seed", self.base_seed)
        self.device = str(kwargs.pop("device", self.device)).lower()
        self.threads = kwargs.pop("threads", self.threads)
        kwargs.pop("standby", None)
        kwargs.pop("cpu_devices", None)
        self.rank, self.parallel, self.config, self.base_seed = rank, parallel, kwargs, seed
        self.seed = shard_seed(seed, self.role, rank)
        self.log = logging.LoggerAdapter(log, {"role": self.role, "rank": rank})
        torch.set_num_threads(self.threads)
        try:
            from xray.workhorse.drain import listen

            listen(self.role, rank)  # a notice names the new rank
        except Exception as exc:  # noqa: BLE001 - outside Ray: SIGTERM as before
            self.log.debug("no drain listener: %s", exc)

    def teardown(self) -> None:
        """Free what `setup` built and leave the process groups it made (subclasses that rejoin)."""

    @property
    def torch_device(self) -> str:
        """Where this shard's model lives: `cuda` on a GPU (Ray shows each Workhorse its own GPU
        as device 0), else `cpu`."""
        return "cuda" if self.device == "gpu" else "cpu"

    @property
    def model_device(self) -> torch.device:
        """The device of the weights of `self.model`, in Workhorses that hold a torch model (the
        Hugging Face and reward ones): their inputs move there."""
        return next(self.model.parameters()).device

    def shard_info(self) -> ShardInfo:
        """This shard's ranks; engine-backed subclasses report what their engine built."""
        return layout_of(self.parallel, self.rank)

    # -- service ------------------------------------------------------------------------------
    def call(self, method: str, packed: tuple[tuple, dict], *after: Any) -> Any:
        """Run marked method `method` with `packed = (args, kwargs)`: the entry of every call a
        WholeModel's caller makes. Arguments passed by reference (`PartsSlice`) are fetched and
        assembled here; `after` are answers Ray waited for before starting this task."""
        args, kwargs = packed
        if any(isinstance(v, PartsSlice) for v in (*args, *kwargs.values())):
            args = tuple(_resolved(a) for a in args)
            kwargs = {k: _resolved(v) for k, v in kwargs.items()}
        with portable_errors(), self.serving(method):
            return getattr(self, method)(*args, **kwargs)

    @staticmethod
    def cancelled() -> bool:
        """True once the caller gave up on the running call (its deadline passed): long methods
        poll this between steps and stop."""
        try:
            import ray

            return ray.is_initialized() and ray.get_runtime_context().is_canceled()
        except Exception:  # noqa: BLE001 - outside a Ray task nothing cancels
            return False

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def place(self) -> tuple[str, str | None]:
        """This shard's node and, on a GPU, its GPU's UUID (None on the CPU): two shards share a
        GPU exactly when both match, whatever indices CUDA_VISIBLE_DEVICES gives them."""
        from xray.transport.ipc import gpu_uuid

        return self.node_id(), gpu_uuid() if self.device == "gpu" else None

    def shutdown(self) -> None:
        """Leave the process group (best effort) before the process ends."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    @fanout(dispatch="all", execute="all", collect=lambda layout, results: results)
    def base_fingerprint(self) -> str | None:
        """The fingerprint of the weights in the model directory this shard started from
        (`xray/backends/base_fingerprint.py`; None without safetensors files), per shard."""
        from xray.backends.base_fingerprint import fingerprint

        return fingerprint(self.config.get("model_dir"))

    @fanout(dispatch="all", execute="all", collect=lambda layout, results: results, deadline_s=30.0)
    def ping(self) -> dict:
        """Liveness and identity of every shard, in rank order."""
        return {"rank": self.rank, "pid": os.getpid(), "role": self.role}
