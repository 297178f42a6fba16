"""The engine registry: every training, generation and reward engine as one row of facts.

Sits at the bottom, in the config layer. Each row says what one engine is and can do: the
backend module `load_backend` imports, the Workhorse class that serves it, the roles it plays,
the dtypes and parallelism it takes, whether it sleeps, how a LoRA actor's weights reach it,
the quantization it offers, whether it reports its routing. The plan, the Workhorses,
`WholeModel.from_pretrained`, the run's model builder, the checks and the benchmarks read these
facts instead of comparing engine names; `--backend` pairs are checked here too.

Facts only: modules and classes are named as strings and imported by name where they are used
(`xray/backends/__init__.py`, `xray/workhorse/roles.py`), so nothing here imports a backend
library or `xray.backends`. `tests/unit/test_engine_registry.py` holds the rows against the code
and fails on a comparison of an engine name outside `xray/backends`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from xray.config.typed import ConfigError

KINDS = ("train", "generation", "reward", "plain", "check")
"""What an engine is: `train` (a training backend), `generation` (a rollout engine), `reward`
(scores sequences), `plain` (a plain `transformers` model, for notebooks and runtime tests),
`check` (no model: cluster and protocol checks)."""
QUANTIZATIONS = ("none", "fp8", "int8")
"""The values of `rollout.quantization`."""


class EngineError(ConfigError):
    """An unknown engine or `--backend` pair, or a quantization the engine does not offer; the
    message lists what is valid."""


@dataclass(frozen=True)
class Engine:
    """One engine's facts."""

    name: str
    """What `--backend` pairs, plans and `from_pretrained(backend=)` call it."""
    kind: str
    """One of `KINDS`."""
    label: str
    """Its name in messages."""
    workhorse: str
    """The Workhorse class that serves it, `module:Class` (imported by `xray/workhorse/roles.py`)."""
    module: str | None = None
    """The backend module `load_backend` imports (None: its Workhorse holds the model itself)."""
    roles: tuple[str, ...] = ()
    """The roles of a run it plays; the plan gives each role the first engine of the run that plays it."""
    pretrained_roles: tuple[str, ...] = ()
    """The roles `WholeModel.from_pretrained` builds it as, the first by default (empty: not offered there)."""
    options: tuple[str, ...] = ()
    """The engine keyword arguments `from_pretrained` accepts."""
    dtypes: tuple[str, ...] = ("float32",)
    """The dtypes `from_pretrained` builds it in."""
    tensor_parallel: bool = False
    """Whether tp may exceed 1."""
    pipeline_parallel: bool = False
    """Whether pp may exceed 1."""
    expert_parallel: bool = False
    """Whether ep may exceed 1 (the experts of a mixture split over data-parallel replicas)."""
    zero: bool = False
    """Shards parameters, gradients and optimizer state with DeepSpeed ZeRO: takes `zero_stage`
    (1, 2 or 3; 3 unless given)."""
    replicas_identical: bool = False
    """Its data-parallel replicas' checkpoint files hold the same weights and optimizer state
    (gradients all-reduced, each replica stepping a whole optimizer), their random state aside,
    when `ep` is 1: a replica's file restores another's rank (`TrainEngine.as_rank`), so an
    in-memory snapshot whose replicas sit on other nodes needs no copy of its own there
    (`xray/run/snapshot_holder.py`)."""
    checks_layout: bool = False
    """Its module has `check_layout(model_dir, parallel)`, run before any Workhorse starts."""
    load_balancing: tuple[str, ...] = ("none",)
    """The `moe.load_balancing` losses it computes."""
    replica_world: bool = False
    """Takes the default process group as its tensor-parallel world (vLLM's `external_launcher`):
    its Workhorses join the role's group only for tp > 1, then each replica a world of its own."""
    memory_share: bool = False
    """Takes `rollout.gpu_memory_utilization` of each GPU at start (on CPU, a KV cache of
    `rollout.kv_cache_gib`), so a GPU shared with a trained role needs a share of 0.5 or less."""
    max_temperature: float | None = None
    """The highest sampling temperature it takes, from 0 (None: not checked before the start)."""
    sleeps: bool = False
    """Can free its GPU memory while the training roles train (`rollout.sleep`; GPU only)."""
    lora_sync: str | None = None
    """How a LoRA actor's weights reach it: `adapters` (it serves the adapter, synced alone) or
    `merged` (W + alpha/r B A); None for engines that receive no sync."""
    quant_schemes: dict[str, dict[str, str]] = field(default_factory=dict, hash=False)
    """Per device (cpu, cuda), each `rollout.quantization` it applies online and its own name for
    the scheme; empty: it does not quantize."""
    quant_verified: tuple[str, ...] = ()
    """The schemes whose quantized weights the held check reads back code for code
    (`xray/backends/quantize.py`); a verified sync refuses the others."""
    quant_dtypes: tuple[str, ...] = ()
    """The engine dtypes it quantizes from online."""
    quant_refused: dict[str, str] = field(default_factory=dict, hash=False)
    """Why a quantization is refused on every device."""
    reports_routing: bool = False
    """Reports the experts it routed each token to (routing replay: `actor.moe.routing_replay`)."""
    no_routing: str = ""
    """Why it does not report its routing."""

    def offered(self, device: str) -> tuple[str, ...]:
        """The `rollout.quantization` values it supports on `device` (cpu or cuda)."""
        return ("none", *self.quant_schemes.get(device, {}))

    def scheme(self, quantization: str, device: str) -> str | None:
        """Its scheme for `rollout.quantization` on `device` (None: unquantized); EngineError,
        saying what the device offers, for anything else."""
        if quantization == "none":
            return None
        scheme = self.quant_schemes.get(device, {}).get(quantization)
        if scheme is None:
            why = self.quant_refused.get(quantization, "it is not implemented")
            raise EngineError(f"rollout.quantization={quantization} is unsupported on {device} ({why}); "
                              f"this device offers: {', '.join(self.offered(device))}")
        return scheme


_TRAIN = dict(kind="train", workhorse="xray.workhorse.train:TrainWorkhorse",
              roles=("actor", "critic", "reference", "teacher"), pretrained_roles=("actor", "critic", "reference"))
_BATCHING = ("forward_micro_batch_size", "max_tokens_per_micro_batch", "packing")
_GENERATION = dict(kind="generation", workhorse="xray.workhorse.rollout:RolloutWorkhorse",
                   roles=("rollout", "sampler"), pretrained_roles=("rollout",), dtypes=("float32", "bfloat16"),
                   tensor_parallel=True)

ENGINES = (
    Engine(name="megatron", label="Megatron", module="xray.backends.megatron", **_TRAIN,
           options=("optim", "attention", *_BATCHING), tensor_parallel=True, pipeline_parallel=True,
           expert_parallel=True, replicas_identical=True, checks_layout=True,
           load_balancing=("none", "aux_loss", "seq_aux_loss")),
    Engine(name="deepspeed", label="DeepSpeed", module="xray.backends.deepspeed", **_TRAIN,
           options=("optim", "zero_stage", *_BATCHING), zero=True, load_balancing=("none", "aux_loss")),
    Engine(name="vllm", label="vLLM", module="xray.backends.vllm", **_GENERATION,
           options=("dtype", "max_model_len", "kv_cache_gib", "enforce_eager", "enable_prefix_caching",
                    "max_num_seqs", "stop_strings"),
           replica_world=True, memory_share=True, max_temperature=2.0, sleeps=True, lora_sync="adapters",
           # vLLM's online fp8 on GPU: `fp8` no longer quantizes online, `fp8_per_tensor` does (with a
           # Marlin fallback on GPUs without fp8). Not run here (no vLLM on the lent GPU machine).
           quant_schemes={"cpu": {"fp8": "fp8_per_channel"}, "cuda": {"fp8": "fp8_per_tensor"}},
           quant_verified=("fp8_per_channel",), quant_dtypes=("bfloat16", "float16"),
           quant_refused={"int8": "vLLM's int8 (W8A8) runs from a prepared checkpoint (llmcompressor, not "
                                  "installed), and an int8 engine whose weights are reloaded in place gives NaN "
                                  "without an error: each sync would have to rebuild the engine (2-6 s)"},
           no_routing="vLLM 0.32 reports the experts it chose (enable_return_routed_experts) only with its Model "
                      "Runner V2, which needs Triton and so a GPU, and xray does not read them from it yet"),
    Engine(name="dsinfer", label="DeepSpeed-Inference", module="xray.backends.dsinfer", **_GENERATION,
           options=("dtype", "max_model_len", "generate_batch", "stop_strings"), lora_sync="merged", reports_routing=True),
    Engine(name="hf", kind="plain", label="Hugging Face", workhorse="xray.workhorse.hf:HFWorkhorse",
           pretrained_roles=("actor", "reference"), options=("optim",)),
    Engine(name="hf-reward", kind="reward", label="reward model", workhorse="xray.workhorse.reward:RewardWorkhorse",
           roles=("reward", "prm", "orm"), pretrained_roles=("reward",)),
    Engine(name="fn-reward", kind="reward", label="reward function",
           workhorse="xray.workhorse.function_reward:FunctionRewardWorkhorse", roles=("orm",)),
    Engine(name="echo", kind="check", label="echo", workhorse="xray.workhorse.echo:EchoWorkhorse"),
)
"""Every engine, in the order messages list them."""

PAIRS = ("megatron-vllm", "deepspeed-dsinfer", "megatron-dsinfer", "deepspeed-vllm")
"""The pairs `--backend` accepts: TRAIN-GENERATION, the default first."""

REWARD_MODEL, REWARD_FUNCTION = "hf-reward", "fn-reward"
"""The reward engines: a sequence-classification model, a Python function."""

_BY_NAME = {e.name: e for e in ENGINES}


def engine(name: str, kind: str | None = None) -> Engine:
    """The row of engine `name` (which must be of `kind` when given); EngineError listing the valid names."""
    row = _BY_NAME.get(name)
    if row is None or (kind is not None and row.kind != kind):
        what = f"{kind} engine" if kind else "engine"
        raise EngineError(f"unknown {what} {name!r}; choose one of {', '.join(names(kind))}")
    return row


def names(kind: str | None = None, having: str | None = None) -> tuple[str, ...]:
    """The engines of `kind` (all when None) whose fact `having` is true (all when None), in order."""
    return tuple(e.name for e in ENGINES
                 if (kind is None or e.kind == kind) and (having is None or getattr(e, having)))


def labels(kind: str | None = None, having: str | None = None) -> str:
    """`names(kind, having)` as their labels, for a message: "vLLM" or "vLLM or DeepSpeed-Inference"."""
    return " or ".join(engine(n).label for n in names(kind, having))


def split_pair(pair: str) -> tuple[str, str]:
    """`megatron-vllm` -> ("megatron", "vllm"), with an error that lists the valid pairs."""
    if pair not in PAIRS:
        raise EngineError(f"unknown --backend {pair!r}; choose one of {', '.join(PAIRS)}")
    train, gen = pair.split("-")
    return train, gen


def playing(role: str, candidates: tuple[str, ...]) -> str:
    """The first of the engines `candidates` that plays `role`; EngineError when none does."""
    for name in candidates:
        if role in engine(name).roles:
            return name
    raise EngineError(f"role {role!r} is played by none of the engines {', '.join(candidates)}; "
                      f"the roles they play: {', '.join(r for n in candidates for r in engine(n).roles)}")
