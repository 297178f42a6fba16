"""Cross-field checks of a run config, and the placement plan they produce.

`plan_run(cfg, backend)` checks everything that can be known before Ray starts (each role placed
once, layouts matching their group's size, batch sizes dividing what they must) and returns the
`Plan`: which role runs on which device group, how many Workhorses, with what tp/pp/dp, in which
node packs (`xray/config/packing.py`), whether the rollout engine sleeps while the training roles
train, and the scheme a quantized rollout uses (`rollout.quantization`: what the device does not
offer is refused here). The runtime applies exactly this plan; `--dry-run` prints it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from xray.config.batches import (check_batch_info, check_node_range, elastic_ranges, role_lr, supervised_batches,
                                 train_batches)
from xray.config.elasticity import ElasticityError
from xray.config.engines import REWARD_FUNCTION, REWARD_MODEL, engine, labels, names, playing, split_pair
from xray.config.graph import build_graph
from xray.config.job import JobSpec
from xray.config.moe import check_experts, check_routing_replay
from xray.config.packing import Packs, describe_packs, node_packs, spans, whole_replicas
from xray.config.parallel import LayoutError, ParallelDims
from xray.config.schema import RunConfig
from xray.config.typed import ConfigError

TRAINED_ROLES = ("actor", "critic", "reference", "teacher")


@dataclass(frozen=True)
class RolePlan:
    """How one role is laid out."""

    role: str
    """actor, critic, reference, reward, rollout; sampler, prm, orm (the sample job)."""
    backend: str
    """The engine playing it, a row of `xray/config/engines.py`: megatron, deepspeed, vllm, dsinfer,
    hf-reward (a reward model), or fn-reward (a reward function in a process of its own)."""
    group: str
    """Device group name."""
    device: str
    """GPU or CPU."""
    ranks: tuple[int, ...]
    """Global device indices as the config writes them, one Workhorse each. They count devices:
    Ray picks each pack's node and each Workhorse's device on it."""
    nodes: tuple[int, ...]
    """Node of each Workhorse as the ranks would put it (rank // nproc_per_node); Ray may choose others."""
    parallel: ParallelDims
    """tp / pp / dp of the role."""
    resources: tuple[tuple[str, float], ...] = ()
    """Custom Ray resources each of its devices also reserves (the group's `resources`)."""
    packs: Packs = ()
    """The group's node packs (positions 0 .. workhorses - 1): each reserved on one node."""

    @property
    def num_workhorses(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class ElasticPlan:
    """An elastic device group: the device counts it may take and the actor's batch at each
    (DeepSpeed's rule: global batch = micro-batch x accumulation x data-parallel replicas)."""

    group: str
    roles: tuple[str, ...]
    sizes: tuple[tuple[int, int, int, int, int], ...]
    """(devices, dp, micro-batch, accumulation steps, global batch) per valid device count."""
    lrs: tuple[float, ...] = ()
    """The actor's peak lr at each size, when `elasticity.lr_scaling` moves it (else empty)."""

    PER_LINE = 4

    def describe(self) -> list[str]:
        counts = [s[0] for s in self.sizes]
        lines = [f"elastic {self.group} ({', '.join(self.roles)}): {len(counts)} sizes in {counts[0]}-{counts[-1]} "
                 "devices; the actor's batch at each, devices: dp x micro x accumulation = global"]
        cells = [f"{n}: {dp} x {micro} x {accum} = {total}" for n, dp, micro, accum, total in self.sizes]
        if self.lrs:
            lines[0] += ", lr"
            cells = [f"{cell}, lr {lr:.3g}" for cell, lr in zip(cells, self.lrs)]
        for i in range(0, len(cells), self.PER_LINE):
            lines.append("    " + " | ".join(cells[i:i + self.PER_LINE]))
        return lines


@dataclass(frozen=True)
class Plan:
    """The placement of every role of a run."""

    backend: str
    roles: tuple[RolePlan, ...]
    nproc_per_node: int
    nnodes: int
    rollout_sleep: bool = False
    """The rollout engine sleeps (frees its GPU memory) while the training roles train (`rollout.sleep`)."""
    rollout_quantization: str | None = None
    """vLLM's quantization scheme of the rollout (`rollout.quantization`); None: unquantized."""

    elastic: tuple["ElasticPlan", ...] = ()
    """The elastic device groups: the sizes each may take and the batch at each."""

    lora_sync: str | None = None
    """With `actor.lora` in an RL run: what a weight sync sends the rollout, "adapters" (vLLM
    serves the adapter) or "merged" (W + alpha/r B A, for DeepSpeed-Inference); None without."""

    min_nnodes: int | None = None
    """The fewest nodes the run starts on (`device_groups.nnodes: MIN:MAX`); None: `nnodes`."""

    def role(self, name: str) -> RolePlan:
        for r in self.roles:
            if r.role == name:
                return r
        raise KeyError(f"role {name!r} is not in this plan")

    def shares_devices(self, a: str, b: str) -> bool:
        """Whether roles `a` and `b` are placed on the same devices (one device group: colocated)."""
        return self.role(a).group == self.role(b).group

    def describe(self) -> str:
        nodes = self.nnodes if self.min_nnodes is None else f"{self.min_nnodes}:{self.nnodes}"
        lines = [f"placement plan (backend {self.backend}; {nodes} node(s) x "
                 f"{self.nproc_per_node} devices):"]
        for r in self.roles:
            p = r.parallel
            lines.append(
                f"  {r.role:<9} {r.backend:<9} group={r.group:<14} {r.device} ranks={spans(r.ranks)} "
                f"nodes={spans(r.nodes)} workhorses={r.num_workhorses} tp={p.tp} pp={p.pp} dp={p.dp}"
                f"{f' ep={p.ep}' if p.ep > 1 else ''}")
        lines.append("device groups, each reserved as packs of devices that Ray keeps on one node (STRICT_PACK):")
        for group in dict.fromkeys(r.group for r in self.roles):
            roles = [r for r in self.roles if r.group == group]
            first, whole = roles[0], whole_replicas(roles[0].packs, [r.parallel for r in roles])
            lines.append(f"  {group:<14} {first.num_workhorses} {first.device} in {describe_packs(first.packs)}: "
                         f"each {'replica' if whole else 'tensor-parallel group'} of "
                         f"{', '.join(r.role for r in roles)} inside one pack"
                         f"{'' if whole else ' (pipeline stages may sit on other nodes)'}")
        lines += [line for e in self.elastic for line in e.describe()]
        if "rollout" in {r.role for r in self.roles}:
            lines.append("rollout sleep: on (vLLM frees its GPU memory while the training roles train)"
                         if self.rollout_sleep else "rollout sleep: off")
        if self.rollout_quantization:
            lines.append(f"rollout quantization: vLLM {self.rollout_quantization}, requantized at every sync "
                         "(the trained roles keep full precision)")
        if self.lora_sync:
            lines.append("LoRA: only the actor's adapters train; no reference model starts (the actor with its "
                         "adapters off gives the reference log-probs)")
            lines.append("weight sync: " + ("the adapters alone, into vLLM's LoRA slot" if self.lora_sync == "adapters"
                                            else "merged weights (W + alpha/r B A)"))
        lines.append("note: ranks count devices, they do not choose them. Ray picks each pack's node and gives each\n"
                     "  Workhorse a device there (CUDA_VISIBLE_DEVICES): the device indices and nodes above are not\n"
                     "  pinned. To pin a group to nodes, give it `resources` its nodes are started with.")
        return "\n".join(lines)




def check_teacher(cfg: RunConfig, spec: JobSpec, needed: tuple[str, ...]) -> None:
    """The teacher's cross-field checks (it scores the student's samples where the spec's roles
    name it); a ConfigError that says the fix."""
    t = cfg.teacher
    if cfg.distill.teacher_coef < 0:
        raise ConfigError(f"distill.teacher_coef={cfg.distill.teacher_coef} must be >= 0 (0: no teacher)")
    if "teacher" not in needed:
        if spec.kind == "rl" and cfg.device_groups.group_of("teacher") is not None:  # (sft: a warm start)
            raise ConfigError(f"device_groups: {spec.name} starts no teacher (distill.teacher_coef is 0); remove "
                              "'teacher' from its group's workers, or set --distill.teacher_coef")
        return
    if not t.model_path:
        raise ConfigError("the teacher scores the student's samples: set teacher.model_path to a Hugging Face "
                          "directory with the student's tokenizer, or builtin:tiny-llama-teacher")
    if t.lora is not None or t.elasticity is not None:
        raise ConfigError("teacher: it never trains and keeps its devices; remove teacher.lora and teacher.elasticity")


def _role_dims(cfg: RunConfig, role: str, train_backend: str, size: int) -> ParallelDims:
    if role in TRAINED_ROLES:
        rc = getattr(cfg, role)
        e = engine(train_backend)
        if (rc.tp != 1 and not e.tensor_parallel) or (rc.pp != 1 and not e.pipeline_parallel):
            raise ConfigError(f"{role}.tp/{role}.pp: the {e.name} backend has no tensor or pipeline "
                              f"parallelism; set --{role}.tp=1 --{role}.pp=1, or use --backend "
                              f"{'|'.join(names('train', 'pipeline_parallel'))}-*")
        budget = rc.max_tokens_per_micro_batch
        if (budget is not None or rc.packing) and (rc.pp > 1 or (budget is not None and budget < 1)):
            raise ConfigError(f"{role}.max_tokens_per_micro_batch and {role}.packing need {role}.pp=1 (a pipeline "
                              "sends one activation shape) and a positive budget; set them to null and false")
        check_experts(role, rc, train_backend)
        dims = ParallelDims(rc.tp, rc.pp, rc.dp, rc.ep)
        what = f"{role}.tp * {role}.pp * {role}.dp = {rc.tp}*{rc.pp}*{rc.dp}"
    elif role in ("rollout", "sampler"):  # the sampler is laid out and samples as the rollout
        dims = ParallelDims(tp=cfg.rollout.tp, pp=1, dp=cfg.rollout.dp)
        what = f"rollout.tp * rollout.dp = {cfg.rollout.tp}*{cfg.rollout.dp}"
    else:  # reward, prm, orm: one replica per device
        return ParallelDims(dp=size)
    if dims.world_size != size:
        raise ConfigError(f"{what} = {dims.world_size}, but its device group has {size} devices; "
                          f"make the product {size}, or change the group's ranks")
    return dims


def _check_sft_batches(cfg: RunConfig, plan: Plan) -> None:
    if cfg.actor.elasticity is not None:  # DeepSpeed's rule sets the batch at every size the group may take
        check_batch_info(cfg, cfg.device_groups, "sft.batch_size")
        return
    unit = plan.role("actor").parallel.dp * cfg.actor.micro_batch_size
    if cfg.sft.batch_size % unit:
        raise ConfigError(f"sft.batch_size={cfg.sft.batch_size} is not divisible by actor.dp x "
                          f"actor.micro_batch_size = {unit}; make it a multiple of {unit}")


def _check_rm_batches(cfg: RunConfig, plan: Plan) -> None:
    micro = cfg.critic.micro_batch_size
    unit = plan.role("critic").parallel.dp * micro
    if micro % 2 or (2 * cfg.rm.batch_size) % unit:
        raise ConfigError(f"rm: 2 x rm.batch_size = {2 * cfg.rm.batch_size} sequences must be divisible by critic.dp x "
                          f"critic.micro_batch_size = {unit}, and the micro-batch ({micro}) even, so that every "
                          "micro-batch holds whole (chosen, rejected) pairs; change rm.batch_size or the micro-batch")


def _check_async(cfg: RunConfig, plan: Plan) -> None:
    a = cfg.async_
    trainers = plan.role("actor").parallel.dp
    build_graph(a.feeds, a.pushes, plan.role("rollout").parallel.dp, trainers)
    if cfg.ppo.rollout_batch_size % trainers:
        raise ConfigError(f"ppo.rollout_batch_size={cfg.ppo.rollout_batch_size} is not divisible by the {trainers} "
                          f"trainers (actor.dp): each maker batch is one trainer's share; use a multiple of {trainers}")
    if a.push_every > a.max_staleness + 1:
        raise ConfigError(f"async.push_every={a.push_every} with async.max_staleness={a.max_staleness}: between "
                          "pushes the makers' weights fall further behind than allowed, and the run would stall; "
                          f"set async.push_every <= {a.max_staleness + 1} or raise async.max_staleness")
    if a.buffer_capacity < 1 or a.behaviour_weight_cap <= 0:
        raise ConfigError("async.buffer_capacity must be >= 1 and async.behaviour_weight_cap > 0")
    if a.segment_tokens < 0 or a.max_in_flight < 0:
        raise ConfigError(f"async.segment_tokens={a.segment_tokens} and async.max_in_flight={a.max_in_flight} "
                          "must be >= 0 (0: whole responses; one trainer's share)")


def _check_sampling(cfg: RunConfig, plan: Plan, role: str = "rollout") -> None:
    placed, share = plan.role(role), cfg.rollout.gpu_memory_utilization
    if not 0.0 < share <= 1.0:
        raise ConfigError(f"rollout.gpu_memory_utilization={share}: give the share of a GPU's memory, in (0, 1]")
    shared = [r.role for r in plan.roles if r.group == placed.group and r.role in TRAINED_ROLES]
    e = engine(placed.backend)
    if placed.device == "GPU" and e.memory_share and shared and share > 0.5:
        raise ConfigError(f"rollout.gpu_memory_utilization={share} leaves too little of the GPUs {', '.join(shared)} "
                          f"share with the rollout ({e.label} takes that share at start); set it to 0.5 or less")
    if e.max_temperature is not None and not 0.0 <= cfg.rollout.temperature <= e.max_temperature:
        raise ConfigError(f"rollout.temperature={cfg.rollout.temperature}: {e.label} samples at temperatures from 0 "
                          f"to {e.max_temperature:g}; choose one in that range")


def _why_no_sleep(cfg: RunConfig, gen_backend: str, device: str) -> str | None:
    """Why the rollout engine cannot sleep in this run (None: it can)."""
    if not engine(gen_backend).sleeps:
        return f"only the {' or '.join(names('generation', 'sleeps'))} rollout can sleep, this run's is {gen_backend}"
    if device != "GPU":
        return f"{engine(gen_backend).label}'s sleep mode needs a GPU (it is unsupported on CPU)"
    if cfg.trainer.mode != "sync":
        return "an asynchronous run generates while it trains"
    return None


def rollout_sleeps(cfg: RunConfig, gen_backend: str) -> bool:
    """Whether the rollout engine sleeps (frees its GPU memory) while the training roles train,
    from `rollout.sleep`: `auto` when a vLLM rollout shares its GPUs with a trained role in a
    synchronous run; true wherever it can (a ConfigError where it cannot); false never."""
    setting, group = cfg.rollout.sleep, cfg.device_groups.group_of("rollout")
    if setting is False or group is None:
        return False
    why_not = _why_no_sleep(cfg, gen_backend, group.device)
    if setting is True and why_not:
        raise ConfigError(f"rollout.sleep=true: {why_not}; set rollout.sleep to auto or false")
    return why_not is None and (setting is True or any(w in TRAINED_ROLES for w in group.workers))


def rollout_quantization(cfg: RunConfig, gen_backend: str, device: str) -> str | None:
    """vLLM's scheme for `rollout.quantization` on the rollout's `device` (GPU or CPU), None when
    unquantized; a ConfigError, with what this device offers, for what it does not."""
    q = cfg.rollout.quantization
    if q == "none":
        return None
    e = engine(gen_backend)
    if not e.quant_schemes:
        raise ConfigError(f"rollout.quantization={q}: only the {labels('generation', 'quant_schemes')} rollout "
                          f"quantizes, this run's is {gen_backend}; set rollout.quantization=none, or use a pair "
                          f"with it (--backend <train>-{'|'.join(names('generation', 'quant_schemes'))})")
    try:
        scheme = e.scheme(q, "cuda" if device == "GPU" else "cpu")
    except ValueError as exc:
        raise ConfigError(f"{exc}; set --rollout.quantization to one of them") from None
    dtype = cfg.rollout.dtype or cfg.model.dtype
    if dtype not in e.quant_dtypes:
        raise ConfigError(f"rollout.quantization={q} with a {dtype} rollout: {e.label} quantizes online from bf16 "
                          "weights only; set --rollout.dtype=bfloat16 (the trained roles keep model.dtype)")
    if cfg.actor.lora is not None:
        raise ConfigError(f"rollout.quantization={q} with actor.lora: an adapter-only sync into a quantized engine "
                          "is not supported; set rollout.quantization=none, or train without actor.lora")
    if cfg.sync.verify and scheme not in e.quant_verified:
        raise ConfigError(f"rollout.quantization={q} on {device}: {e.label} quantizes with {scheme}, whose weights the "
                          f"verified sync cannot read back code for code (it reads back {', '.join(e.quant_verified)} "
                          "only; its layers would pass only a loose functional bound); set rollout.quantization=none, "
                          "or --sync.verify=false to run it unverified")
    return scheme


def _with_packs(roles: list[RolePlan], per_node: int) -> list[RolePlan]:
    """Each role with its group's node packs: every replica of every role of a group on one node."""
    packs = {}
    for group in dict.fromkeys(r.group for r in roles):
        members = [r for r in roles if r.group == group]
        try:
            packs[group] = node_packs(members[0].num_workhorses, [r.parallel for r in members], per_node)
        except LayoutError as exc:
            raise ConfigError(f"device_groups.{group}: {exc}") from None
    return [replace(r, packs=packs[r.group]) for r in roles]


def _check_graces(cfg: RunConfig) -> None:
    t = cfg.trainer
    if not t.drain_grace_s > 0:
        raise ConfigError(f"trainer.drain_grace_s={t.drain_grace_s} must be > 0: the seconds a Workhorse told to "
                          "drain serves on (your cluster's preemption grace, 30 s in Kubernetes)")
    if t.exit_grace_s is not None and t.exit_grace_s < 0:
        raise ConfigError(f"trainer.exit_grace_s={t.exit_grace_s} must be >= 0, or null to size it to the step")


def _check_batches(cfg: RunConfig, plan: Plan) -> None:
    _check_sampling(cfg, plan)
    if cfg.trainer.standby_workhorses < 0:
        raise ConfigError(f"trainer.standby_workhorses={cfg.trainer.standby_workhorses} must be >= 0 (0: none)")
    if cfg.trainer.mode == "async":
        _check_async(cfg, plan)
    samples = cfg.ppo.rollout_batch_size * cfg.rollout.n_samples
    rollout_dp = plan.role("rollout").parallel.dp
    for key, value in (("ppo.rollout_batch_size", cfg.ppo.rollout_batch_size), ("data.eval_size", cfg.data.eval_size)):
        if value % rollout_dp:
            raise ConfigError(f"{key}={value} is not divisible by the {rollout_dp} rollout replicas "
                              f"(rollout.dp); use a multiple of {rollout_dp}")
    base = {r.role: r.num_workhorses for r in plan.roles if r.role in TRAINED_ROLES}
    layouts = [base] + [{**base, **{role: n for role in er.roles}}
                        for er in elastic_ranges(cfg, cfg.device_groups) for n in er.sizes]
    for devices in layouts:
        _check_train_batches(cfg, devices, samples)
    check_batch_info(cfg, cfg.device_groups)  # after: a mismatch between roles is named first


def _check_train_batches(cfg: RunConfig, devices: dict[str, int], samples: int) -> None:
    """The mini- and micro-batches divide what they must when the trained roles have `devices`."""
    try:
        batches = train_batches(cfg, devices)
    except ElasticityError as exc:
        raise ConfigError(f"elasticity: {exc}") from None
    where = "" if batches.mini_batch_size == cfg.ppo.mini_batch_size else \
        f" (the elastic mini-batch on {devices['actor']} actor devices)"
    if samples % batches.mini_batch_size:
        raise ConfigError(f"ppo.mini_batch_size={batches.mini_batch_size}{where} does not divide the "
                          f"{samples} samples of a step (rollout_batch_size x rollout.n_samples); "
                          "choose a divisor")
    for role, n in devices.items():
        rc, micro = getattr(cfg, role), batches.micro_of(role)
        unit = n // (rc.tp * rc.pp) * micro
        batch, name = (samples, "rollout_batch_size x n_samples") if role in ("reference", "teacher") else \
            (batches.mini_batch_size, "ppo.mini_batch_size")
        if batch % unit:
            raise ConfigError(f"{name}={batch} is not divisible by {role}.dp x {role}.micro_batch_size = "
                              f"{unit // micro}x{micro}{where}; make it a multiple of {unit} or lower "
                              f"{role}.micro_batch_size")


def _quantization_of(cfg: RunConfig, roles: list[RolePlan], gen_backend: str) -> str | None:
    generating = [r for r in roles if r.role in ("rollout", "sampler")]
    return rollout_quantization(cfg, gen_backend, generating[0].device) if generating else None


def _lora_sync(cfg: RunConfig, spec: JobSpec, gen_backend: str) -> str | None:
    """How an RL run with `actor.lora` syncs the rollout (see `Plan.lora_sync`); refuses what LoRA
    does not support yet."""
    if cfg.reference.lora is not None:
        raise ConfigError("reference.lora: the reference never trains (a LoRA run takes its log-probs from the actor "
                          "with its adapters off); remove reference.lora")
    if cfg.actor.lora is None or spec.kind != "rl":
        return None
    if cfg.trainer.mode != "sync":
        raise ConfigError("actor.lora with trainer.mode=async: staged weight syncs do not carry adapters yet; "
                          "set trainer.mode=sync, or train without actor.lora")
    if cfg.actor.elasticity is not None:
        raise ConfigError("actor.lora with actor.elasticity: an elastic LoRA actor is not supported yet; "
                          "remove one of them")
    return engine(gen_backend).lora_sync


def _elastic_plans(cfg: RunConfig, spec: JobSpec) -> tuple[ElasticPlan, ...]:
    """Each elastic group's sizes and the actor's batch at each (`xray/config/batches.py`)."""
    if not spec.elastic:
        return ()
    out = []
    for er in elastic_ranges(cfg, cfg.device_groups):
        rows = []
        for n in er.sizes:
            rc = cfg.actor if "actor" in er.roles else getattr(cfg, er.roles[0])
            dp = n // (rc.tp * rc.pp)
            try:
                b = (train_batches if spec.kind == "rl" else supervised_batches)(cfg, {r: n for r in er.roles})
            except ElasticityError:
                continue  # the batch checks name the size that fails
            micro = b.micro_of("actor" if "actor" in er.roles else er.roles[0])
            rows.append((n, dp, micro, b.mini_batch_size // max(1, micro * dp), b.mini_batch_size))
        role = "actor" if "actor" in er.roles else er.roles[0]
        scaled = getattr(cfg, role).elasticity is not None and getattr(cfg, role).elasticity.lr_scaling != "none"
        lrs = tuple(role_lr(cfg, role, row[0]) for row in rows) if scaled else ()
        out.append(ElasticPlan(er.group, er.roles, tuple(rows), lrs))
    return tuple(out)


def _check_env(cfg: RunConfig, spec: JobSpec) -> None:
    """Episodes (`env.name` or `env.agent`) are played by PPO and the critic-free steps of a
    synchronous run; an environment's (`env.name`) also by an asynchronous run's makers."""
    try:
        cfg.env.check()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if spec.kind != "rl":
        raise ConfigError(f"env.name or env.agent is set but {spec.name} plays no episodes; unset it, or run an RL "
                          "command (ppo, grpo, ...)")
    if cfg.trainer.mode != "sync" and cfg.env.agent:
        raise ConfigError("env.agent: an agent's episodes are played by synchronous runs only so far (the "
                          "endpoint serves the driver's rollout); set trainer.mode=sync, or give an environment "
                          "class in env.name, whose episodes the makers of an asynchronous run play")
    if cfg.reward.model:
        raise ConfigError("env: the environment's or agent's rewards score the episodes; set reward.model=null")


def plan_run(cfg: RunConfig, backend: str, spec: JobSpec) -> Plan:
    """Check `cfg` for a run of the command `spec` (its roles and checks: `xray/config/job.py`) with
    `backend` (e.g. `megatron-vllm`); return its placement."""
    train_backend, gen_backend = split_pair(backend)
    groups = cfg.device_groups
    if not groups.groups:
        raise ConfigError("device_groups: no groups; add one with device, ranks and workers")
    check_routing_replay(cfg, gen_backend, spec.name, spec.routing_replay)
    spec.check(cfg)
    needed = spec.roles(cfg)
    check_teacher(cfg, spec, needed)
    if cfg.env.episodes:
        _check_env(cfg, spec)
    buffer, limit = cfg.reward.overlong_buffer, cfg.rollout.max_new_tokens
    if buffer and (cfg.env.episodes or not 0 < buffer < limit or cfg.reward.overlong_penalty < 0):
        raise ConfigError(f"reward.overlong_buffer={buffer} needs 0 < buffer < rollout.max_new_tokens={limit}, a penalty "
                          ">= 0 and no env (an episode's budget counts observations); set it to 0 to turn it off")
    if spec.kind == "rl" and cfg.trainer.report and "jsonl" not in cfg.trainer.loggers:
        raise ConfigError("trainer.report draws the metrics of metrics.jsonl: keep jsonl in trainer.loggers, "
                          "or set trainer.report=false")
    for role in needed:
        if groups.group_of(role) is None:
            raise ConfigError(f"device_groups: role {role!r} is placed in no group; add it to one "
                              "group's workers")
    if spec.kind in ("rl", "reward_model") and not cfg.reward.model and groups.group_of("reward") is not None:
        raise ConfigError("device_groups: role 'reward' is placed but reward.model is not set; "
                          "set reward.model to a sequence-classification directory or remove 'reward'")
    if cfg.reward.model and cfg.reward.specs:
        raise ConfigError("reward: both a function and model are set; set reward.function=null (and "
                          "reward.functions=[]) to use the model, or drop reward.model")
    roles = []
    rewards = (REWARD_MODEL, REWARD_FUNCTION) if cfg.reward.model else (REWARD_FUNCTION, REWARD_MODEL)  # orm's
    for role in needed:
        g = groups.group_of(role)
        assert g is not None
        backend_of = playing(role, (train_backend, gen_backend, *rewards))
        try:
            dims = _role_dims(cfg, role, train_backend, g.size)
        except LayoutError as exc:
            raise ConfigError(f"{role}: {exc}") from None
        roles.append(RolePlan(role=role, backend=backend_of, group=g.name, device=g.device,
                              ranks=g.ranks, nodes=tuple(groups.node_of(r) for r in g.ranks),
                              parallel=dims, resources=g.resources))
    plan = Plan(backend=backend, roles=tuple(_with_packs(roles, groups.nproc_per_node)),
                nproc_per_node=groups.nproc_per_node, nnodes=groups.nnodes, min_nnodes=groups.min_nnodes,
                rollout_sleep="rollout" in needed and rollout_sleeps(cfg, gen_backend),
                rollout_quantization=_quantization_of(cfg, roles, gen_backend),
                lora_sync=_lora_sync(cfg, spec, gen_backend), elastic=_elastic_plans(cfg, spec))
    check_node_range(cfg, groups)
    _check_graces(cfg)
    checks = {"supervised": _check_sft_batches, "reward_model": _check_rm_batches,
              "best_of_n": lambda c, p: _check_sampling(c, p, "sampler"), "rl": _check_batches}
    checks[spec.kind](cfg, plan)
    return plan
