"""On-policy distillation against GRPO alone on `builtin:arith`: how many student samples each
needs to bring the student to the teacher's accuracy.

    .venv/bin/python benchmarks/opd.py [--seeds 1 2] [--lrs 1e-4 2e-4] [--max-steps 500] [--eval-every 10]

The student is the built-in model (`builtin:tiny-llama`: 344K parameters, warm-started by 135
supervised steps), the teacher the larger built-in one (`builtin:tiny-llama-teacher`: 3.2M
parameters, 405 steps); both are built once (seed 1; cached under $XRAY_CACHE/builtin) and every
run starts from them. Per learning rate of `--lrs` and seed (the run's seed: its sampling and
shuffles), two runs from the same student with the same settings: 32 prompts x 4 samples a step,
that learning rate, 2 epochs of 2 mini-batches, clip 0.2, no KL to a reference,
`configs/opd_tiny_cpu.yaml` otherwise:
  opd  - `python -m xray.train opd`: each token's advantage is the teacher's log-prob of it less
         the student's; the reward is only measured;
  grpo - `python -m xray.train grpo`: the group-normalised exact-answer reward.
Every `--eval-every` steps the student's greedy exact-answer accuracy on the 200 held-out prompts
(xray's evaluation; the teacher's is the same evaluation of its weights). A run stops at the
first evaluation with accuracy >= teacher - 0.05; its samples to the target are that step x 128.
A run that does not get there in `--max-steps` counts `--max-steps` x 128 (printed as ">N").
Each algorithm is compared at its own best learning rate of `--lrs` (the fewest samples summed
over the seeds; the two learn best at different rates: GRPO's normalised sequence advantage and
the teacher's unnormalised per-token one), and where its runs there missed the target, the ratio
is a bound, said on the line before the last.
Last line: `opd_samples_over_grpo=<opd samples to the target summed over seeds / grpo's, each at its
best rate> student=<the opd student's accuracy where it stopped, mean over seeds> teacher=<teacher
accuracy>`.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import tempfile
from pathlib import Path

import yaml
from algorithms.specs import default_config

SAMPLES_PER_STEP = 32 * 4
MARGIN = 0.05


def settings(algo: str, out: Path, model: str, teacher: str, seed: int, lr: float) -> list[str]:
    """`python -m xray.train` arguments of one run."""
    
    cfg = yaml.safe_load(default_config("opd").read_text())
    if algo != "opd":
        cfg["device_groups"]["train_group"]["workers"] = ["actor"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return [algo, "--config", str(out / "config.yaml"), f"--model.path={model}", f"--teacher.model_path={teacher}",
            f"--seed={seed}", f"--actor.optim.lr={lr}", "--rollout.n_samples=4", "--ppo.rollout_batch_size=32",
            "--ppo.mini_batch_size=64", "--ppo.ppo_epochs=2", "--ppo.cliprange=0.2", "--critic_free.kl_in=none",
            "--trainer.max_restarts=0", "--trainer.memory_snapshots=false"]


def built_models(tmp: Path) -> tuple[str, str]:
    """The warm-started student and teacher directories (built on first use, then cached)."""
    from algorithms.warm_start import model_dir, with_teacher_dir
    from xray.run.outputs import RunDir
    from xray.train import resolve

    _, cfg, plan, _, _ = resolve(["opd", "--config", str(Path(__file__).parents[1] / "configs/opd_tiny_cpu.yaml")])
    run = RunDir(tmp / "build")
    return model_dir(cfg, plan, run, None), str(with_teacher_dir(cfg, plan, run, None).teacher.model_path)


def accuracy_of(model: str, tmp: Path) -> float:
    """xray's evaluation of `model`: greedy exact-answer accuracy on the held-out prompts."""
    from algorithms.rl import rl_trainer
    from xray.run.outputs import RunDir
    from xray.train import resolve

    _, cfg, plan, _, _ = resolve(settings("grpo", tmp / "teacher-eval", model, model, 1, 1e-4))
    with rl_trainer(cfg, plan, RunDir(tmp / "teacher-eval"), algo="grpo") as (trainer, data):
        return asyncio.run(trainer.evaluate(data.eval_rows))


def run(algo: str, seed: int, student: str, teacher: str, target: float, lr: float, args,
        tmp: Path) -> tuple[int | None, float]:
    """(samples to the target or None, the accuracy where the run stopped)."""
    from algorithms.rl import rl_trainer
    from xray.run.outputs import RunDir
    from xray.train import resolve

    out = tmp / f"{algo}-{lr:g}-{seed}"
    _, cfg, plan, _, _ = resolve(settings(algo, out, student, teacher, seed, lr))
    with rl_trainer(cfg, plan, RunDir(out), algo=algo) as (trainer, data):
        accuracy, history = asyncio.run(trainer.evaluate(data.eval_rows)), []
        for step in range(1, args.max_steps + 1):
            asyncio.run(trainer.step(data.next_train_rows()))
            if step % args.eval_every:
                continue
            accuracy = asyncio.run(trainer.evaluate(data.eval_rows))
            history.append(f"{step}:{accuracy:.3f}")
            if accuracy >= target:
                print(f"{algo} lr {lr:g} seed {seed}: {' '.join(history)} -> target at step {step}", flush=True)
                return step * SAMPLES_PER_STEP, accuracy
    print(f"{algo} lr {lr:g} seed {seed}: {' '.join(history)} -> not reached in {args.max_steps} steps", flush=True)
    return None, accuracy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-4, 2e-4])
    ap.add_argument("--max-steps", type=int, default=500)
    ap.add_argument("--eval-every", type=int, default=10)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        student, teacher = built_models(tmp)
        teacher_acc = accuracy_of(teacher, tmp)
        target = teacher_acc - MARGIN
        print(f"teacher accuracy {teacher_acc:.3f}; target {target:.3f} (student before: "
              f"{accuracy_of(student, tmp):.3f})", flush=True)
        tried = {(algo, lr): [run(algo, seed, student, teacher, target, lr, args, tmp) for seed in args.seeds]
                 for algo in ("opd", "grpo") for lr in args.lrs}
    budget = args.max_steps * SAMPLES_PER_STEP
    total = {key: sum(n if n is not None else budget for n, _ in r) for key, r in tried.items()}
    for (algo, lr), r in tried.items():
        print(f"{algo} lr {lr:g}: samples to {target:.3f}: " + ", ".join(
            str(n) if n is not None else f">{budget}" for n, _ in r), flush=True)
    best = {algo: min(args.lrs, key=lambda lr: total[(algo, lr)]) for algo in ("opd", "grpo")}
    print(f"best learning rates: opd {best['opd']:g}, grpo {best['grpo']:g}", flush=True)
    results = {algo: tried[(algo, lr)] for algo, lr in best.items()}
    counts = {algo: [n if n is not None else budget for n, _ in r] for algo, r in results.items()}
    missed = {algo for algo, r in results.items() if any(n is None for n, _ in r)}
    bound = ("opd missed it: the ratio is a lower bound" if "opd" in missed and "grpo" not in missed else
             "grpo missed it: the ratio is an upper bound" if "grpo" in missed and "opd" not in missed else
             "both missed it: the ratio compares budgets" if missed else "both reached it: the ratio is exact")
    print(bound, flush=True)
    student_acc = sum(acc for _, acc in results["opd"]) / len(results["opd"])
    print(f"opd_samples_over_grpo={sum(counts['opd']) / sum(counts['grpo']):.3f} student={student_acc:.3f} "
          f"teacher={teacher_acc:.3f}")


if __name__ == "__main__":
    main()
