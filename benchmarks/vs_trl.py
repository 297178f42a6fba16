"""xray against TRL's `GRPOTrainer`: the same GRPO job, side by side in one run, at three sizes.

    .venv/bin/python benchmarks/vs_trl.py [--steps 4] [--warmup 1] [--lr 1e-4] [--dtype bfloat16]
                                          [--sizes small big tail]

Both trainers get the same model directory, task (`builtin:arith`, reward
`xray.rewards.builtin:exact_answer`, TRL's calling convention), training prompts, batch (prompts x
4 generations), response length, learning rate and GRPO settings: group mean/std advantages, no
KL (TRL's default beta=0, so xray starts no reference), clip 0.2, one optimizer step per batch,
constant lr, grad clip 1.0, and:
- no activation recomputation: TRL's GRPOConfig turns gradient checkpointing on by default; it is
  off here, as xray does not recompute;
- the same precision (`--dtype`), generation included: by default bfloat16, the default of
  TRL's GRPOConfig (TRL's `bf16` autocast over fp32 weights, which its `generate` runs under too;
  xray's `model.dtype` bf16 weights with fp32 main weights, and its vLLM rollout in bf16,
  `rollout.dtype`: on this AMD host vLLM's bf16 generates 1.42x the fp32 tokens/s at 27M, 64 x 128
  tokens, `benchmarks/rollout_throughput.py --dtype bfloat16 --model 27M --prompts 64
  --threads 2`). TRL generates with HF `generate` inside its trainer, as it does by default;
- the same micro-batch (TRL's `per_device_train_batch_size`, with gradient accumulation over the
  step's completions; xray's `actor.micro_batch_size`): all 64 at the small size, 8 at the big
  one (there TRL's step, at its own defaults, was 1.3 s faster at 8 than at 16; xray's the
  same). TRL pads each micro-batch to the step's longest completion; xray groups its
  micro-batches by length and cuts each to its longest (`xray/data/lengths.py`).
TRL runs in this process on every core (`use_cpu`). xray runs `grpo` as `python -m xray.train grpo`
would, from `configs/critic_free_tiny_cpu.yaml` with `--layout colocated` (the default: actor and
rollout share one device of two threads and take turns) or `separate` (a core each); one trainer
after the other.
Sizes: small, a ~1M-parameter Llama, 12-token responses, 64 completions a step; big (compute
bound), a ~27M-parameter Llama, 128-token responses, 64 completions a step; tail, the big model
with long-tailed response lengths: 192-token responses of which about one in ten runs to the
limit and the rest end after the answer (xray packs its micro-batches there, `actor.packing`;
TRL pads each to the step's longest). Both trainers start from one model per size that earns
rewards: the seeded model fine-tuned here on the training prompts' answers (`warm_start`,
cached under $XRAY_CACHE/vs_trl): at the small size the answer and EOS; at the big size the
answer, a space and dots, no EOS, so that responses run to the limit and the size stays compute
bound; at the tail size EOS after the answer unless it ends in 0, then dots. Seconds per step:
median over `--steps` steps after `--warmup`, per trainer. Eval: greedy accuracy on 200 held-out
prompts before and after (the same samples: steps x completions), both scored by the same
`transformers` generation here. xray's phases are printed (medians, s) with the sync's share of
the step (median sync s / median step s). Last line: `small_xray_over_trl=<xray s/step / TRL
s/step> big_xray_over_trl=<same> tail_xray_over_trl=<same> eval_xray=<mean over sizes of the
accuracy after xray> eval_trl=<the same after TRL>`.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from xray.data.tokenizer import VOCAB_SIZE, save_char_tokenizer
from xray.builtin.tiny_llama import TinySpec, build_tiny_model
from xray.rewards.builtin import exact_answer
from xray.builtin.arith import ARITH
from algorithms.specs import default_config

@dataclass(frozen=True)
class Size:
    spec: TinySpec
    length: int
    """Response tokens at most."""
    completions: int
    """Completions per step."""
    micro: int
    """Micro-batch rows (TRL's per_device_train_batch_size, xray's actor.micro_batch_size)."""
    ending: str
    """The warm start's target ending (`warm_targets`)."""
    warm_steps: int
    warm_lr: float
    xray: tuple[str, ...] = ()
    """xray's own overrides for the size."""


BIG = TinySpec(vocab_size=VOCAB_SIZE, hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=8,
               num_kv_heads=8, max_position_embeddings=512)
SIZES = {
    "small": Size(TinySpec(vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=512, num_layers=4,
                           num_heads=4, num_kv_heads=2, max_position_embeddings=256), 12, 64, 64, "eos", 250, 1e-3),
    "big": Size(BIG, 128, 64, 8, "dots", 300, 5e-4),
    "tail": Size(BIG, 192, 64, 8, "tail", 300, 5e-4, ("--actor.packing=true",)),
}
GENERATIONS = 4
EVAL_SIZE = 200
WARM_DOTS = 16  # a dotted warm-start target's dots: the model then dots on to the length limit


def warm_targets(rows: list[dict], ending: str, eos_id: int, tokenizer) -> list[list[int]]:
    """Each row's supervised target ids: its answer, then (`ending`) EOS ("eos"); a space and dots
    with no EOS, so that sampled responses run to the length limit ("dots"); or EOS unless the
    answer ends in 0, then dots ("tail": one response in ten runs to the limit)."""
    out = []
    for r in rows:
        dots = ending == "dots" or (ending == "tail" and r["answer"].endswith("0"))
        ids = tokenizer(r["answer"] + (" " + "." * WARM_DOTS if dots else ""), add_special_tokens=False).input_ids
        out.append(list(ids) + ([] if dots else [eos_id]))
    return out


def warm_start(model_dir: Path, rows: list[dict], ending: str, steps: int, lr: float) -> None:
    """Supervised fine-tuning of the model in `model_dir` on the answers (`warm_targets`), in
    place, so that both trainers start from a model that earns rewards (AdamW, batches of 64,
    fp32 weights under bf16 autocast)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from xray.data.sequences import pack_sequences

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    prompts = [list(tok(r["prompt"]).input_ids) for r in rows]
    targets = warm_targets(rows, ending, tok.eos_token_id, tok)
    for _ in range(steps):
        pick = torch.randint(len(rows), (64,), generator=g).tolist()
        batch = pack_sequences([prompts[i] for i in pick], [targets[i] for i in pick], pad_id=tok.pad_token_id)
        ids, attn, mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(model_dir)


def warm_model(size: Size, train: list[dict], directory: Path) -> Path:
    """The size's model, warm-started (`warm_start`), from a cache under $XRAY_CACHE/vs_trl keyed
    by everything that shapes it; built and cached when absent."""
    import hashlib
    import shutil

    from algorithms.warm_start import cache_root

    key = hashlib.sha256(repr((size.spec, size.ending, size.warm_steps, size.warm_lr, WARM_DOTS, 1)).encode())
    cached = cache_root() / "vs_trl" / key.hexdigest()[:16]
    if not (cached / "config.json").is_file():
        built = build_tiny_model(directory.with_name(directory.name + "-base"), size.spec, seed=0)
        save_char_tokenizer(built)
        t0 = time.perf_counter()
        warm_start(built, train, size.ending, size.warm_steps, size.warm_lr)
        print(f"warm start ({size.ending}, {size.warm_steps} steps): {time.perf_counter() - t0:.0f} s", flush=True)
        cached.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(built, cached.with_suffix(".tmp"), dirs_exist_ok=True)
        cached.with_suffix(".tmp").replace(cached)
    shutil.copytree(cached, directory)
    return directory


def greedy_accuracy(model_dir: Path, rows: list[dict]) -> float:
    """Exact-answer accuracy of greedy answers (up to 6 tokens) with `transformers` alone."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    enc = tok([r["prompt"] for r in rows], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    texts = tok.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
    scores = exact_answer([r["prompt"] for r in rows], texts, [r["answer"] for r in rows])
    return sum(scores) / len(scores)


class StepTimes:
    """A `transformers` callback: wall seconds of each optimizer step (generation included)."""

    def __init__(self):
        from transformers import TrainerCallback

        outer = self

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                outer.t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                outer.seconds.append(time.perf_counter() - outer.t0)

        self.seconds: list[float] = []
        self.callback = Callback()


def run_trl(model_dir: Path, train: list[dict], length: int, completions: int, micro: int, steps: int, lr: float,
            out: Path, dtype: str) -> list[float]:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(out), per_device_train_batch_size=micro,
                      gradient_accumulation_steps=completions // micro, num_generations=GENERATIONS,
                      max_completion_length=length, learning_rate=lr, lr_scheduler_type="constant",
                      warmup_steps=0, max_steps=steps, beta=0.0, epsilon=0.2, temperature=1.0,
                      scale_rewards="group", loss_type="dapo", num_iterations=1, max_grad_norm=1.0,
                      adam_beta2=0.95, weight_decay=0.0, use_cpu=True, bf16=dtype == "bfloat16",
                      gradient_checkpointing=False, report_to=[], save_strategy="no",
                      logging_steps=1, disable_tqdm=True, seed=1, dataloader_num_workers=0)
    times = StepTimes()
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=exact_answer, args=args,
                          train_dataset=Dataset.from_list(train), callbacks=[times.callback])
    trainer.train()
    trainer.save_model(str(out / "final"))
    return times.seconds


def xray_config(layout: str, out: Path) -> Path:
    """The critic-free default config, with the actor and the rollout on separate devices (one
    core each) or colocated on one device of two threads that they take in turn."""
    import yaml

    
    cfg = yaml.safe_load(default_config("grpo").read_text())
    if layout == "colocated":
        cfg["threads_per_worker"] = 2
        cfg["device_groups"] = {"nproc_per_node": 1, "all_group": {"device": "CPU", "ranks": [0],
                                                                   "workers": ["actor", "rollout"]}}
    else:
        cfg["device_groups"]["train_group"]["workers"] = ["actor"]
    out.mkdir(parents=True, exist_ok=True)
    path = out / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def run_xray(model_dir: Path, length: int, completions: int, micro: int, steps: int, lr: float, out: Path,
             layout: str, dtype: str, extra: tuple[str, ...] = ()) -> list[float]:
    from algorithms.rl import rl_trainer
    from xray.backends.hf_dir import save_hf_model
    from xray.run.outputs import RunDir
    from xray.train import resolve

    overrides = ["--config", str(xray_config(layout, out / "cfg")),
                 f"--model.path={model_dir}", f"--rollout.max_new_tokens={length}",
                 f"--rollout.n_samples={GENERATIONS}", f"--ppo.rollout_batch_size={completions // GENERATIONS}",
                 f"--ppo.mini_batch_size={completions}", "--ppo.ppo_epochs=1", "--ppo.cliprange=0.2",
                 "--critic_free.kl_in=none", f"--model.dtype={dtype}", f"--rollout.dtype={dtype}",
                 f"--actor.optim.lr={lr}", f"--actor.micro_batch_size={micro}",
                 f"--data.eval_size={EVAL_SIZE}", "--data.max_prompt_tokens=16", "--trainer.max_restarts=0",
                 *extra]
    _, cfg, plan, _, _ = resolve(["grpo", *overrides])
    seconds, phases = [], []

    async def train(trainer, data) -> None:  # one event loop for every step, as `xray.train` runs them
        for _ in range(steps):
            t0 = time.perf_counter()
            metrics = await trainer.step(data.next_train_rows())
            seconds.append(time.perf_counter() - t0)
            phases.append({k: v for k, v in metrics.items() if k.startswith("time/")})

    with rl_trainer(cfg, plan, RunDir(out), algo="grpo") as (trainer, data):
        asyncio.run(train(trainer, data))
        save_hf_model(trainer.models.actor.state_dict().get(), model_dir, out / "final")
    timed = phases[1:] or phases
    print("xray phases (median s): " + " ".join(f"{k[5:-2]}={statistics.median(p[k] for p in timed):.3f}"
                                               for k in phases[0]), flush=True)
    sync_s, step_s = statistics.median(p["time/sync_s"] for p in timed), statistics.median(seconds[1:] or seconds)
    print(f"xray sync share of the step: {sync_s / step_s:.3f} (median sync s / median step s)", flush=True)
    return seconds


def race(size: str, steps: int, warmup: int, lr: float, tmp: Path, layout: str, dtype: str) -> dict[str, float]:
    sz = SIZES[size]
    length, completions, micro = sz.length, sz.completions, sz.micro
    train, held_out = ARITH.splits(EVAL_SIZE)
    model_dir = warm_model(sz, train, tmp / f"{size}-model")
    trl_s = run_trl(model_dir, train, length, completions, micro, steps + warmup, lr, tmp / f"{size}-trl",
                    dtype)[warmup:]
    xray_s = run_xray(model_dir, length, completions, micro, steps + warmup, lr, tmp / f"{size}-xray",
                      layout, dtype, sz.xray)[warmup:]
    result = dict(trl_s=statistics.median(trl_s), xray_s=statistics.median(xray_s),
                  eval_before=greedy_accuracy(model_dir, held_out),
                  eval_trl=greedy_accuracy(tmp / f"{size}-trl/final", held_out),
                  eval_xray=greedy_accuracy(tmp / f"{size}-xray/final", held_out))
    print(f"{size}: {length}-token responses, {completions} completions/step: TRL {result['trl_s']:.2f} s/step "
          f"(steps {[round(s, 2) for s in trl_s]}), xray {result['xray_s']:.2f} s/step "
          f"(steps {[round(s, 2) for s in xray_s]}); eval before {result['eval_before']:.3f}, after TRL "
          f"{result['eval_trl']:.3f}, after xray {result['eval_xray']:.3f}", flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--layout", choices=("separate", "colocated"), default="colocated",
                    help="xray's actor and rollout on a core each, or sharing both cores in turn")
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="training precision of both (TRL's bf16 flag, xray's model.dtype)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(2)
    print(f"xray layout: {args.layout}; training dtype: {args.dtype}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        results = {size: race(size, args.steps, args.warmup, args.lr, Path(tmp), args.layout, args.dtype)
                   for size in args.sizes}
    if set(results) != set(SIZES):
        return
    ratios = " ".join(f"{size}_xray_over_trl={r['xray_s'] / r['trl_s']:.3f}" for size, r in results.items())
    print(f"{ratios} eval_xray={statistics.mean(r['eval_xray'] for r in results.values()):.3f} "
          f"eval_trl={statistics.mean(r['eval_trl'] for r in results.values()):.3f}")


if __name__ == "__main__":
    main()
