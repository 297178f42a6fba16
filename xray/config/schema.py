"""The typed sections of an xray run config; `configs/*.yaml` are instances of `RunConfig`.

Each component receives its own section (a WholeModel its `RoleConfig`, PPO its `PPOConfig`),
never the whole tree. Every field says what it means; defaults belong to the component. The
cross-field checks (devices, batch divisibility) live in `xray.config.plan`. `docs/config.md` is
generated from these docstrings (`python -m xray.config.reference --write`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from xray.config.critic_free import CriticFreeConfig
from xray.config.data import DataConfig
from xray.config.distill import DistillConfig
from xray.config.elasticity import ElasticityConfig
from xray.config.env import EnvConfig
from xray.config.eval import EvalConfig
from xray.config.lora import LoraConfig
from xray.config.moe import MoeConfig
from xray.config.optim import OptimConfig
from xray.config.placement import DeviceGroups
from xray.config.reward import RewardConfig


@dataclass(frozen=True)
class ModelConfig:
    """Where the starting weights come from."""

    path: str = "builtin:tiny-llama"
    """A local Hugging Face model directory, or `builtin:tiny-llama` (a seeded tiny Llama built
    into the run's output directory on first use)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype of the trained and reference models (actor, critic, reference) on either
    training backend: `bfloat16` keeps bf16 weights with fp32 main weights in the optimizer and
    reduces gradients in fp32 (Megatron-core's mixed-precision optimizer, DeepSpeed's bf16). Also
    the rollout's dtype unless `rollout.dtype` is set."""


@dataclass(frozen=True)
class RoleConfig:
    """Layout and training settings of one model role (actor, critic, reference or teacher)."""

    tp: int = 1
    """Tensor-parallel size (megatron)."""
    pp: int = 1
    """Pipeline-parallel size (megatron)."""
    dp: int = 1
    """Data-parallel size; tp * pp * dp must equal the role's device group size."""
    ep: int = 1
    """Expert-parallel size (megatron, mixture-of-experts models): each MoE layer's experts split over
    `ep` consecutive data-parallel replicas (a divisor of dp and of the experts per layer); the
    other weights stay replicated over all dp. Padded micro-batches: no packing, no LoRA, no elasticity."""
    zero_stage: int = 3
    """DeepSpeed ZeRO stage (1, 2 or 3); used by the deepspeed backend only."""
    micro_batch_size: int = 4
    """Rows per micro-batch in forward and train steps, per data-parallel replica."""
    max_tokens_per_micro_batch: Optional[int] = None
    """Token budget per micro-batch instead of `micro_batch_size` rows (megatron with pp=1, deepspeed):
    rows grouped by length, each micro-batch's rows x its longest row (packed: its tokens) at most this."""
    packing: bool = False
    """Run each micro-batch's rows as one sequence without padding, attention kept inside each row
    (megatron with pp=1, deepspeed): the same log-probs and step as padded, for the tokens' cost only."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer, warm-up and lr schedule (ignored for the reference, which never trains)."""
    activation_checkpointing: bool = False
    """Keep only each decoder layer's input in a train step's forward and recompute the layer in
    the backward (actor and critic): activation memory of one layer instead of all, for about one
    more forward's compute; the same loss and gradients. Megatron: its full recompute, one layer
    at a time; DeepSpeed: the Hugging Face model's gradient checkpointing (non-reentrant). Not with
    `moe.routing_replay`."""
    model_path: Optional[str] = None
    """Weights for this role, if not the run's `model.path` (a critic from a reward model, say)."""
    lora: Optional[LoraConfig] = None
    """Train LoRA adapters instead of every weight (`{rank, alpha, dropout, target_modules}`;
    actor and critic): the base weights stay frozen, only the adapters hold optimizer state, the
    rollout receives only the adapters, and the reference log-probs come from the actor with its
    adapters off (no reference model starts). Null: full fine-tuning."""
    moe: MoeConfig = field(default_factory=MoeConfig)
    """Router options of a mixture-of-experts model (`{load_balancing, aux_loss_coef,
    routing_replay}`); the defaults compute what Hugging Face's model computes."""
    elasticity: Optional[ElasticityConfig] = None
    """DeepSpeed's `elasticity` block (either training backend): the role's device group becomes
    elastic (its size follows the cluster within [min_gpus, max_gpus], synchronous runs), and the
    role's batch is DeepSpeed's for its current size (`xray/config/elastic_rule.py`: one global batch
    for the block, micro-batch x gradient accumulation x dp); the actor's is the PPO mini-batch (it
    replaces `ppo.mini_batch_size` and the role's `micro_batch_size`).
    DeepSpeed's block is read as written (`version`, `min_time`, `prefer_larger_batch` included);
    `enabled: false` leaves the role fixed, as if the block were absent."""

    deepspeed_config: Optional[str] = None
    """A DeepSpeed JSON config as DeepSpeed and ms-swift users write it (ms-swift's `zero1.json`, say),
    read into this role's keys when the config loads (`xray/config/deepspeed_json.py`): its ZeRO
    stage, `gradient_clipping`, `train_micro_batch_size_per_gpu` and `elasticity` block; `"auto"`
    takes xray's value, `bf16`/`fp16` must agree with `model.dtype`; a key xray does not read, CPU
    offload, or an optimizer with values of its own is an error that says the fix."""

    def __post_init__(self) -> None:
        if self.elasticity is not None and not self.elasticity.enabled:
            object.__setattr__(self, "elasticity", None)  # disabled: not elastic


@dataclass(frozen=True)
class RolloutConfig:
    """The generation engine (`rollout` role) and its sampling settings."""

    tp: int = 1
    """Tensor-parallel size inside one replica (vLLM on GPU)."""
    dp: int = 1
    """Number of engine replicas; tp * dp must equal the role's device group size."""
    dtype: Optional[Literal["float32", "bfloat16"]] = None
    """Generation dtype (null: `model.dtype`). The weight sync casts the actor's weights to it and
    verifies the engine holds exactly those values."""
    quantization: Literal["none", "fp8", "int8"] = "none"
    """Generate with a quantized copy of the actor (the trained roles keep full precision). `fp8`:
    vLLM quantizes each linear layer's weights to fp8 as it loads them, at every sync: on CPU
    per output channel (vLLM's `fp8_per_channel`, slow without fp8 hardware), on GPU vLLM's online
    `fp8_per_tensor`, which the verified sync cannot read back: refused unless `sync.verify` is
    false (not tested here). Needs a bf16 rollout (`rollout.dtype` or `model.dtype`
    bfloat16). The sync's exact check compares the engine's fp8 weights and scales with our own
    quantization of the tensors sent, and the policy loss corrects for the rollout's log-probs
    with the truncated importance weight (capped at `async.behaviour_weight_cap`). `int8` is
    refused: vLLM gives NaN after an in-place int8 reload and needs a prepared checkpoint. Only
    the vLLM rollout quantizes."""
    max_new_tokens: int = 16
    """Longest response."""
    temperature: float = 1.0
    """Sampling temperature (0 for greedy)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = -1
    """Top-k sampling (-1 for all tokens)."""
    n_samples: int = 1
    """Responses sampled per prompt."""
    stop: list[str] = field(default_factory=list)
    """Strings that end a response, besides the end-of-sequence ids (every EOS id of the tokenizer
    and of the model's generation_config.json). A response ends with the token that completes
    the first of them: that token and the stop string stay in the completion (its ids and
    log-probs are exactly what the engine sampled), as vLLM's `include_stop_str_in_output`."""
    kv_cache_gib: float = 1.0
    """KV-cache size per replica on CPU (VLLM_CPU_KVCACHE_SPACE)."""
    gpu_memory_utilization: float = 0.9
    """On GPU, the share of each of its GPUs' memory a vLLM replica takes (weights and KV cache);
    at most 0.5 when training roles share the rollout's GPUs (the plan checks)."""
    sleep: Union[Literal["auto"], bool] = "auto"
    """Whether the vLLM rollout sleeps while the actor and critic train: its GPU memory (weights
    moved to host memory, KV cache dropped: vLLM's sleep level 1) is freed after generation and
    taken back before the next generation or weight sync. `auto`: when it shares its GPUs with a
    trained role in a synchronous run; true (on) wherever that is possible, false (off) never.
    Unsupported on CPU (the plan refuses true there; auto stays off)."""


@dataclass(frozen=True)
class PPOConfig:
    """trlX-style PPO hyper-parameters. The critic-free algorithms (grpo, rloo, reinforce_pp) read
    the batch sizes, `ppo_epochs`, the clip ranges, `loss_agg_mode`, `kl_coef` and the KL guards
    too (their own settings are in `critic_free`)."""

    rollout_batch_size: int = 16
    """Prompts per PPO step."""
    mini_batch_size: int = 8
    """Samples per optimizer step inside a PPO epoch."""
    ppo_epochs: int = 1
    """Passes over each step's rollouts."""
    gamma: float = 1.0
    """GAE discount."""
    lam: float = 0.95
    """GAE lambda."""
    cliprange: float = 0.2
    """Policy ratio clip."""
    cliprange_value: float = 0.2
    """Value clip around the old values."""
    vf_coef: float = 0.1
    """Value loss weight."""
    kl_coef: float = 0.05
    """Initial KL penalty coefficient."""
    kl_target: Optional[float] = None
    """Adaptive KL controller target (null: fixed kl_coef)."""
    kl_horizon: int = 10000
    """Adaptive KL controller horizon."""
    whiten_advantages: bool = True
    """Normalise advantages to zero mean, unit variance per step."""
    whiten_min_std: float = 0.1
    """Whitening divides by at least this: a nearly uniform batch (the critic's noise) is not
    blown up to unit variance. 0: plain whitening."""
    cliprange_high: Optional[float] = None
    """Upper policy ratio clip, 1 + cliprange_high (DAPO's clip-higher); null: cliprange."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    """How the policy loss's per-token terms are reduced: over tokens, or per sequence (summed or
    averaged over its tokens) then over sequences."""
    policy_loss: Literal["vanilla", "gspo", "cispo"] = "vanilla"
    """The actor's policy loss, by its registered name (`algorithms/policy_losses`): vanilla (PPO's
    clipped token ratio), gspo (one clipped ratio per sequence, the geometric mean of its tokens';
    the paper's clip ranges are tiny, 3e-4 and 4e-4, and its aggregation seq-mean-token-mean),
    cispo (MiniMax-M1's REINFORCE with the ratio clipped and detached as a weight; cliprange >= 1:
    no lower bound, as the paper)."""
    target_kl: Optional[float] = None
    """Stop a step's PPO epochs early once an epoch's mean approx KL to the old policy exceeds this."""
    max_approx_kl: Optional[float] = None
    """Skip the update of any micro-batch whose approx KL to the old policy exceeds this (no
    gradient; the weights stay when a whole mini-batch is skipped); counted in the metrics."""


@dataclass(frozen=True)
class SyncConfig:
    """Weight sync from the actor to the rollout engine."""

    verify: bool = True
    """Check every sync: complete (every tensor the engine needs sent and loaded once), exact
    (order-sensitive checksums in transit; every engine tensor read back bit for bit, or checked
    by its own layer's product where it cannot be read), and end to end: the next step's rollout
    log-probs against the actor's recomputed ones before that step trains, and a probe forward on
    both sides at the first sync, every `probe_every` and the last."""
    probe_every: int = 10
    """Run the separate log-prob probe at every this many syncs (also the first and the last); the
    syncs between are checked end to end by the next step's own log-probs for free. 1: probe every
    sync. An on-policy critic-free step, which recomputes no actor log-probs, checks in its
    training forward instead (the rollout's log-probs against that forward's, before the update)."""
    tolerance: float = 1e-3
    """Largest allowed absolute log-prob difference of any token in the check when both sides are
    fp32 (seen: 2e-5 on the tiny model, 3e-5 on SmolLM2-135M)."""
    bf16_mean_tolerance: float = 0.15
    """When either side is bf16: the largest allowed mean absolute log-prob difference over the
    checked tokens (the largest is logged, not bounded). Two bf16 implementations of one model
    differ per token by noise with a long tail: Megatron bf16 against vLLM bf16 on SmolLM2-135M,
    256 samples, mean 0.046-0.048, largest 0.45-0.76 (0.87 in a real run); 0.004 on the tiny test
    model. A wrong tensor or name mapping moves every token (`xray/sync/end_to_end.py`)."""
    bucket_mb: int = 64
    """Largest bucket of tensors sent at once."""
    transport: Literal["auto", "objstore", "shm", "ipc", "pg"] = "auto"
    """How the weights travel: the object store (shared memory on one node), the actor's own
    shared-memory slots that the rollout maps once (one node, CPU: no page faults after the first
    sync), the actor's GPU buffers handed over by CUDA IPC (the rollout on the actor's own GPU), a
    process group of the actor's exporting shard and the rollout shards (gloo on CPU, NCCL on GPU),
    or auto: the slots when the rollout is on the actor's node on CPU and /dev/shm has room (else
    the object store there), CUDA IPC when it shares the actor's GPU (the object store when only
    part of it does: NCCL cannot group two processes of one GPU), the group otherwise."""


@dataclass(frozen=True)
class SFTConfig:
    """Supervised training of the actor alone: `python -m xray.train sft`, `distill`, `pt`, and the
    built-in model's warm start."""

    steps: int = 200
    """Optimizer steps."""
    batch_size: int = 32
    """Sequences per step: (prompt, answer) pairs, or `pt`'s text chunks."""
    lr: float = 1e-3
    """Peak learning rate (replaces actor.optim.lr for SFT). 1e-3 is sized for the built-in tiny
    model, whose warm start reads this value: fine-tuning a real pretrained model wants about
    1e-5 (`--sft.lr=1e-5`), or it forgets what it knew."""
    warmup_steps: int = 10
    """Linear warm-up steps."""


@dataclass(frozen=True)
class PTConfig:
    """Continued pre-training on plain text (`python -m xray.train pt`, `algorithms/pt.py`): the
    actor trains on next-token loss over every token, with the `sft` section's steps, batch size
    and learning rate; the text comes from `data.path` (`xray.data.text`)."""

    seq_len: int = 64
    """Tokens per training sequence: the documents, each followed by EOS, are joined and cut into
    chunks of this length (the tail shorter than a chunk is dropped)."""
    text_field: str = "text"
    """The column holding each document in a JSONL/Parquet file or a `datasets` directory."""
    eval_fraction: float = 0.1
    """Documents held out (seeded) whose loss is measured before and after training; 0: none."""


@dataclass(frozen=True)
class RMConfig:
    """Reward-model training (`python -m xray.train rm`, `algorithms/rm.py`): the `critic` role,
    with its layout, micro-batch and optimizer (but `lr`), learns a Bradley-Terry score."""

    steps: int = 150
    """Optimizer steps."""
    batch_size: int = 32
    """Preference pairs per step (2x as many sequences)."""
    lr: float = 3e-4
    """Peak learning rate (the critic's optim settings otherwise)."""
    chosen_field: str = "chosen"
    """The data column of the preferred response (a built-in task makes its own pairs)."""
    rejected_field: str = "rejected"
    """The data column of the other response."""


@dataclass(frozen=True)
class SampleConfig:
    """Best-of-N sampling (`python -m xray.train sample`, `algorithms/sample.py`): the `sampler` role
    draws `rollout.n_samples` candidates per prompt with the `rollout` section's engine settings;
    the `orm` role scores each whole response with `reward` (its function or model) and the
    optional `prm` role each step of it; the chosen responses are written as a dataset."""

    output_file: str = "sampling.jsonl"
    """The dataset, under the run's output directory (or an absolute path); `.parquet`: Parquet,
    anything else: JSON lines."""
    keep: Literal["best", "all"] = "best"
    """`best`: per prompt the `n_best` highest-scored candidates that pass the thresholds, each
    with the lowest-scored candidate as `rejected` when it scores lower; `all`: every candidate
    with its scores, rank and whether it passed."""
    n_best: int = 1
    """Candidates kept per prompt with `keep: best`."""
    num_prompts: int = 0
    """Prompts sampled, from the start of the data's training split (0: all of them)."""
    batch_prompts: int = 32
    """Prompts per sampler call; the next call's generation overlaps this one's scoring."""
    prm_model: Optional[str] = None
    """A Hugging Face sequence-classification directory (one label, or two: the second is "right")
    run by the `prm` role: each step's score is its probability at the step's last token."""
    step_separator: str = "\n"
    """What ends a step of a response for the PRM (the last step ends at the response's end)."""
    prm_threshold: Optional[float] = None
    """A candidate passes only if its weakest step's score is at least this (null: no filter)."""
    orm_threshold: Optional[float] = None
    """A candidate passes only if its outcome reward is at least this (null: no filter)."""
    orm_weight: float = 10.0
    """Candidates are ranked by `orm_weight x orm + prm` (the weakest step's score)."""


@dataclass(frozen=True)
class AsyncConfig:
    """Detached asynchronous training (`trainer.mode: async`): experience makers (the rollout's
    replicas, with the reference and the reward) and the trainer (actor, and critic in PPO) joined by an
    experience buffer."""

    push_every: int = 1
    """Trainer steps (experience batches trained on) between weight pushes to the makers."""
    max_staleness: int = 1
    """Largest allowed gap, in weight versions, between the oldest weights that sampled an
    experience's tokens and the trainer's when it trains on it."""
    on_stale: Literal["wait", "drop"] = "wait"
    """`wait`: admission control (AReaL's rule): a maker starts a prompt only while it will be
    fresh enough when trained on, and a group that still comes out too stale (overtaken by a
    slower maker) is made again (nothing is lost); `drop`: makers start prompts whenever the
    buffer has room, and the trainer drops too-stale groups (their prompts are lost). Both are
    counted in metrics."""
    buffer_capacity: int = 2
    """Steps' worth of experience (groups) each trainer's queue holds, counting the prompts being
    made for it; a maker starts no prompt beyond it."""
    segment_tokens: int = 16
    """Partial rollouts: a maker generates its samples this many tokens at a time, and between two
    segments loads a newer weight version if one was published; the samples then go on from the
    tokens they have, with the new weights (each token records the version that sampled it). A
    push thus waits at most one segment of each maker's generations, never their end. With
    `env.name` (episodes) it bounds each call of a model turn the same way: a turn of up to
    `env.max_turn_tokens` is generated this many tokens at a time, a load may come between two of
    its segments (`xray/run/detached/episode_maker.py`). 0: whole responses (turns) in one call."""
    max_in_flight: int = 0
    """Prompts a maker has in flight at most (being generated or scored; its engine batches all
    those generating); 0: one trainer's share of a step (`ppo.rollout_batch_size / trainers`)."""
    behaviour_weight_cap: float = 2.0
    """Truncation of the importance weight pi_proximal / pi_behaviour of the decoupled PPO loss."""
    feeds: dict[str, list[str]] = field(default_factory=dict)
    """Which trainers each maker delivers experience to, e.g. `{maker0: [trainer0]}` (makers are
    the rollout's replicas, trainers the actor's); a maker left out feeds every trainer. Each
    batch goes to the maker's trainer with the shortest queue (see `xray/config/graph.py`)."""
    pushes: dict[str, list[str]] = field(default_factory=dict)
    """Which makers each trainer sends its weights to, e.g. `{trainer1: [maker1]}`; a maker left
    out is updated by trainer (its index mod the trainers)."""


@dataclass(frozen=True)
class TrainerConfig:
    """The run loop."""

    mode: Literal["sync", "async"] = "sync"
    """`sync`: the lockstep PPO step. `async`: makers and trainer run detached (see `async`)."""
    steps: int = 20
    """PPO steps (trainer steps in async mode)."""
    agent_endpoint: str = "127.0.0.1:0"
    """`host:port` of the OpenAI-compatible chat-completions endpoint the run serves from its
    rollout engine while `env.agent` plays episodes (port 0: any free one); each episode's agent
    gets its session's base URL."""
    save_every: int = 10
    """Flash-checkpoint every this many steps (0: never; a signal still takes one): a short copy into host memory,
    written to disk in the background; it becomes the latest once all of it is on disk."""
    keep_last: int = 3
    """Complete checkpoints kept on disk (0: all): once a checkpoint is complete, the older ones beyond
    the newest `keep_last` are deleted. Never the one being written, nor the newest complete one (what
    `--resume` and a recovery load). `python -m xray.export RUN/checkpoints/step-N OUT` turns a kept
    one into a Hugging Face directory."""
    memory_snapshots: bool = True
    """Snapshot the trained models into host memory after every step (the copy overlaps the next
    step's generation, or in an asynchronous run its trainer's wait for experience; replicated to
    another node where there is one): a lost Workhorse then costs at most the step in flight, and
    an asynchronous run's makers and buffer go on while its trainer restores. Off: recovery goes
    back to the latest checkpoint. Costs host memory: the trained state (weights and optimizer)
    in the object store: the newest snapshot's, the one being taken and the latest checkpoint's."""
    standby_workhorses: int = 0
    """Warm standby processes each trained model (and each model sharing its devices) keeps on every
    node that can host its device group (CPU Workhorses; GPU ones start cold): a replacement after a
    loss, a drain or an elastic resize builds its shards in them instead of starting new processes (no
    imports on the critical path; the pool is refilled in the background). Each costs a process with its
    libraries imported (about 0.4 GB of host memory), and each refill the CPU of a start. 0: none. A group
    grows onto a joined node once a process per model is warm there (its standbys, or one started for it)."""
    on_signal: Literal["finish", "abandon"] = "finish"
    """SIGTERM/SIGINT: `finish` the step under way (within `exit_grace_s`), checkpoint it and exit
    0; `abandon` it at once and exit 0 (the last complete checkpoint stands)."""
    exit_grace_s: Optional[float] = None
    """Seconds a step under way may take to finish after a signal before it is abandoned; null:
    sized to the step (1.5 x the longest of the last 5 steps, at least 10 s), so that a run of long
    steps finishes its step rather than abandon it. Set a number below the time your scheduler
    gives the driver after SIGTERM (Kubernetes' `terminationGracePeriodSeconds`)."""
    drain_grace_s: float = 30.0
    """Seconds a Workhorse told to drain (SIGTERM to its process: its node preempted) goes on serving
    before it exits, while the run replaces it without losing a step (`xray/workhorse/drain.py`):
    the time your cluster gives a preempted node (30 s in Kubernetes by default)."""
    max_restarts: int = 2
    """Recoveries a run may make, all kinds together (a dead Workhorse's model replaced, a failed
    experience maker replaced, an asynchronous run sent back to its checkpoint: one restart budget
    for the whole run, `xray/run/recovery/policy.py`); one more death ends the run. A run that may
    restart takes a flash checkpoint of step 0 to go back to."""
    log_every: int = 1
    """Write metrics every this many steps."""
    eval_every: int = 0
    """Evaluate on the held-out prompts every this many steps too (metrics `eval` and `eval/*`, as
    the `eval` section says; 0: only before and after training)."""
    log_rollouts: int = 4
    """Write the responses of this many prompts of each step (all of each one's `rollout.n_samples`
    samples, the step's first prompts) to `rollouts.jsonl` in the run directory: step, group, sample,
    prompt, completion, reward, advantage (the mean over the response's trained tokens). 0: none."""
    timeline_step: int = 2
    """Record where this step's time goes: every Workhorse's busy intervals during it, per role and
    rank, written as a Chrome trace (`timeline.json` in the output directory, opened by Perfetto or
    chrome://tracing) and drawn in the run report (0: no timeline). Step 1 includes one-time
    warm-ups; 2 shows a steady step."""
    report: bool = True
    """Write the run report when the run ends (`report/index.html` in the output directory: plots of
    the metrics and the step timeline); a failure to write it is logged, never the run's.
    `python -m xray.report RUN_DIR` writes it at any time."""
    loggers: tuple[Literal["jsonl", "tensorboard", "wandb", "mlflow"], ...] = ("jsonl", "tensorboard")
    """Where every command's metrics go, each logger with the resolved config as hyper-parameters:
    `jsonl` (`metrics.jsonl`, which the run report reads), `tensorboard` (`tensorboard/`), `wandb`
    (offline under `wandb/` unless WANDB_MODE or WANDB_API_KEY is set; `pip install 'wandb>=0.31'`),
    `mlflow` (a file store in `mlruns/` unless MLFLOW_TRACKING_URI is set; `pip install
    'mlflow-skinny>=3.17'`). A missing package stops the run before it starts."""

    def __post_init__(self) -> None:
        if self.keep_last < 0:
            raise ValueError(f"trainer.keep_last={self.keep_last} is negative; give 0 (keep every checkpoint) "
                             "or the number of newest checkpoints to keep")


@dataclass(frozen=True)
class RunConfig:
    """A whole run; `configs/ppo_tiny_cpu.yaml` is the default instance."""

    seed: int = 1
    """Run seed; each Workhorse seeds from (seed, role, rank)."""
    threads_per_worker: int = 1
    """torch threads per CPU Workhorse."""
    pin_cpu_devices: bool = False
    """Pin each CPU Workhorse to its device's cores (device index r of a node: cores r x
    threads_per_worker onwards), so roles placed on one CPU device share it as roles on one GPU
    do. Off: the OS spreads every Workhorse over all cores."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Starting weights."""
    device_groups: DeviceGroups = field(default_factory=DeviceGroups)
    """Which roles run on which devices: named groups of devices, each with the roles placed on it."""
    actor: RoleConfig = field(default_factory=RoleConfig)
    """The policy being trained."""
    critic: RoleConfig = field(default_factory=RoleConfig)
    """The value model."""
    reference: RoleConfig = field(default_factory=RoleConfig)
    """The frozen starting policy for the KL penalty."""
    teacher: RoleConfig = field(default_factory=RoleConfig)
    """The model that scores the student's samples in on-policy distillation (`opd`,
    `distill.teacher_coef`): forward only, from `teacher.model_path`, on a training backend."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """The generation engine."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """The score."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Multi-turn episodes against an environment, instead of one completion per sample."""
    ppo: PPOConfig = field(default_factory=PPOConfig)
    """PPO's hyper-parameters (the critic-free algorithms read most of them too)."""
    critic_free: CriticFreeConfig = field(default_factory=CriticFreeConfig)
    """GRPO, RLOO, REINFORCE++ and on-policy distillation settings."""
    sync: SyncConfig = field(default_factory=SyncConfig)
    """Actor to rollout weight sync."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluations on the held-out prompts: sampling, pass@k, per-source metrics, samples files."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Run loop."""
    async_: AsyncConfig = field(default_factory=AsyncConfig)
    """Asynchronous mode (YAML key `async`)."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Supervised warm start."""
    pt: PTConfig = field(default_factory=PTConfig)
    """Continued pre-training on plain text."""
    rm: RMConfig = field(default_factory=RMConfig)
    """Reward-model training."""
    sample: SampleConfig = field(default_factory=SampleConfig)
    """Best-of-N sampling with the sampler, prm and orm roles."""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """Fine-tuning on a sampled dataset; the teacher's weight in on-policy distillation."""
