"""Three-step GRPO, RLOO and REINFORCE++ runs on both backend pairs: one start of the WholeModels
per pair (start-up dominates), then each algorithm's whole run (`xray.run.loop.train`, what
`python -m xray.train <algo>` runs: evaluations, steps, metrics, flash checkpoints, the exported
actor) on them in turn.

Layout as the PPO e2e: actor, reference and teacher (a model twice the student's width) on
Megatron tp=2 or DeepSpeed ZeRO-3 dp=2, a rollout
of 2 replicas; 4 prompts x 2 responses a step; forwards and train steps cut by a 32-token budget
(`max_tokens_per_micro_batch`), packed on megatron-vllm (`packing`). No critic is started. Each run exercises one set
of options: Dr. GRPO (no std scaling, `seq-mean-token-sum`, clip-higher, KL loss term, DAPO's
dynamic sampling over up to 2 rounds, and a teacher's per-token term at `distill.teacher_coef=0.5`);
on-policy distillation (`opd`: the teacher's term alone, no reference, no reward in the advantage);
RLOO
(KL in the reward, `target_kl` stopping after the first of 2 epochs, and its syncs run as where
actor and rollout share devices: the actor's probe queued behind its last update, before the
push, and still verified); REINFORCE++ with a guard
bound below any approx KL, so every update is skipped on both engines and the weights stay; GRPO
on-policy (one epoch of one mini-batch, no KL): no actor forward before training, ratio exactly 1;
detached (`trainer.mode: async`, 2 experience makers), once over the two pairs: `opd` on
megatron-vllm (1 trainer; the makers have the teacher score each group, no reference) and GRPO with
the teacher's term and the KL loss on deepspeed-dsinfer (2 trainers fed by both makers; the
advantages over each group the trainer takes), the makers' loads verified;
and each on multi-turn episodes, once over the two pairs: GRPO on deepspeed-dsinfer with each
sample a guessing game over up to 3 turns (`env.name`; the engines sized for the episodes) and on
megatron-vllm with agent code written with the `openai` client (`env.agent`) through the run's
OpenAI-compatible endpoint, RLOO on megatron-vllm and REINFORCE++ on deepspeed-dsinfer on the game;
each episode's model tokens checked end to end against the actor's log-probs, its observations out
of the loss. (PPO with its critic plays it in the asynchronous e2e.)
"""
import asyncio
import dataclasses
import json
import math
import os
from pathlib import Path

import pytest
import yaml

from tests.e2e.answer_guess import ANSWER_GUESS
from tests.e2e.test_ppo_e2e import FP32_PROBE, check_held
from algorithms.specs import command_spec

pytestmark = pytest.mark.e2e
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep Ray on loopback
ROOT = Path(__file__).resolve().parents[2]


def critic_free_config(tmp_path: Path, model_dir: Path, backend: str, teacher_dir: Path):
    from xray.config import load_config

    cfg = yaml.safe_load((ROOT / "configs/critic_free_tiny_cpu.yaml").read_text())
    cfg["model"]["path"] = str(model_dir)
    cfg["device_groups"] = {
        "nproc_per_node": 4,
        "train_group": {"device": "CPU", "ranks": [0, 1], "workers": ["actor", "reference", "teacher"]},
        "rollout_group": {"device": "CPU", "ranks": [2, 3], "workers": ["rollout"]},
    }
    layout = {"tp": 2, "dp": 1} if backend.startswith("megatron") else {"tp": 1, "dp": 2, "zero_stage": 3}
    # forwards and train steps by a token budget; on megatron-vllm also packed (the parity is the backend tier's)
    cut = {"max_tokens_per_micro_batch": 32, "packing": backend.startswith("megatron")}
    cfg["teacher"] = {"model_path": str(teacher_dir)}
    for role in ("actor", "reference", "teacher"):
        cfg[role].update(layout, micro_batch_size=2, **cut)
    cfg["rollout"].update(dp=2, max_new_tokens=4, n_samples=2)
    cfg["ppo"].update(rollout_batch_size=4, mini_batch_size=4, ppo_epochs=2)
    cfg["data"]["eval_size"] = 8
    cfg["reward"]["function"] = "tests.e2e.test_critic_free_e2e:digit_share"  # the untrained model scores 0 on arith
    cfg["trainer"].update(steps=3, save_every=2)
    cfg["distill"] = {"teacher_coef": 0.5}  # the shared start has the teacher; each variant sets its own
    cfg["env"] = dict(ANSWER_GUESS)  # only the episodes variant plays it; the engines have its room
    path = tmp_path / "critic_free.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return load_config(path)


def digit_share(prompts: list[str], completions: list[str], **_) -> list[float]:
    """A graded reward the untrained tiny model earns sometimes: the share of digits in the text."""
    return [sum(c.isdigit() for c in text) / max(1, len(text)) for text in completions]


def openai_agent(row: dict, base_url: str) -> float:
    """Agent code as its author writes it, with the `openai` client: ask, and while the answer has
    no digit, say so and ask again (3 turns at most); the reward is `AnswerGuess`'s."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages, reward = [{"role": "user", "content": row["prompt"]}], 0.0
    for _ in range(3):
        text = client.chat.completions.create(model="policy", messages=messages, max_tokens=4).choices[0].message.content
        digits = "".join(c for c in text if c.isdigit())
        reward += len(digits) / max(1, len(text)) + float(digits == row["answer"])
        if digits:
            break
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": " no number"}]
    client.close()
    return reward


VARIANTS = {  # run: (algorithm, ppo overrides, critic_free overrides); the teacher's weight in TEACHER
    "grpo": ("grpo", {"loss_agg_mode": "seq-mean-token-sum", "cliprange_high": 0.28},
             {"scale_by_std": False, "dynamic_sampling": True, "max_sample_rounds": 2}),
    "opd": ("opd", {}, {}),
    "rloo": ("rloo", {"target_kl": 1e-9}, {}),
    "reinforce_pp": ("reinforce_pp", {"max_approx_kl": -1.0}, {}),
    "grpo-on-policy": ("grpo", {"ppo_epochs": 1, "mini_batch_size": 8}, {"kl_in": "none"}),
    "opd-async": ("opd", {}, {}),
    "grpo-async": ("grpo", {}, {}),
    "grpo-episodes": ("grpo", {}, {}),
    "grpo-agent": ("grpo", {}, {}),
    "rloo-episodes": ("rloo", {}, {}),
    "reinforce_pp-episodes": ("reinforce_pp", {}, {}),
}


TEACHER = {"grpo": 0.5, "opd": 0.0, "opd-async": 0.0, "grpo-async": 0.5}
"""`distill.teacher_coef` of the runs with a teacher (opd's term has weight 1 whatever it is); 0 elsewhere."""
EPISODES_ON = {"grpo-episodes": "deepspeed-dsinfer", "grpo-agent": "megatron-vllm",
               "rloo-episodes": "megatron-vllm", "reinforce_pp-episodes": "deepspeed-dsinfer"}
"""The backend pair each episode variant runs on (once: the suite's budget)."""
ASYNC_ON = {"opd-async": "megatron-vllm", "grpo-async": "deepspeed-dsinfer"}
"""The detached runs (`trainer.mode: async`, 2 makers; 1 trainer at tp=2, 2 fed by both makers at
dp=2) and the pair each runs on."""


def variant(cfg, name: str):
    from xray.config.env import EnvConfig

    _, ppo, critic_free = VARIANTS[name]
    env = cfg.env if name.endswith("-episodes") else EnvConfig()
    if name == "grpo-agent":
        env = dataclasses.replace(cfg.env, name=None, agent="tests.e2e.test_critic_free_e2e:openai_agent")
    trainer = dataclasses.replace(cfg.trainer, mode="async" if name in ASYNC_ON else "sync")
    return dataclasses.replace(cfg, ppo=dataclasses.replace(cfg.ppo, **ppo), trainer=trainer,
                               critic_free=dataclasses.replace(cfg.critic_free, **critic_free), env=env,
                               distill=dataclasses.replace(cfg.distill, teacher_coef=TEACHER.get(name, 0.0)))


@pytest.mark.parametrize("backend", ["megatron-vllm", "deepspeed-dsinfer"])
def test_grpo_opd_rloo_reinforce_pp_three_steps_each(tmp_path, tiny_model, tiny_teacher, backend):
    from algorithms.rl import rl_trainer
    from xray.run.loop import make_trainer, train
    from xray.config.plan import plan_run
    from xray.run.outputs import RunDir

    cfg = critic_free_config(tmp_path, tiny_model, backend, tiny_teacher)
    plan = plan_run(cfg, backend, command_spec("grpo"))
    assert [r.role for r in plan.roles] == ["rollout", "actor", "reference", "teacher"]
    with rl_trainer(cfg, plan, RunDir(tmp_path / "start"), algo="grpo") as (first, data):
        assert first.models.critic is None
        evals = []  # (before, after) of each run; each starts from the weights the one before ended on
        for algo, (name, _, _) in VARIANTS.items():
            if {**EPISODES_ON, **ASYNC_ON}.get(algo, backend) != backend:
                continue  # each episode and detached variant runs on one pair
            run_cfg = variant(cfg, algo)
            trainer = make_trainer(command_spec(name).algorithm(run_cfg), run_cfg, first.models, first.score_fn, data)
            assert trainer.on_policy == (algo == "grpo-on-policy")
            trainer.overlap_sync = algo != "rloo"  # rloo: a colocated layout's sync (`early_probe`)
            before = {k: v.clone() for k, v in first.models.actor.state_dict().get().items()}
            run = RunDir(tmp_path / algo)
            eval_after = asyncio.run(train(trainer, run, data, None))
            run.close()
            check_run(algo, tmp_path / algo, before, backend)
            assert trainer.queued_probe is None  # each sync took the probe its step queued (or none was)
            if algo in EPISODES_ON:  # its evaluation is the episodes' mean return
                check_episodes(trainer, tmp_path / algo)
                continue
            evals.append((trainer.state.eval_before, eval_after))
        # greedy evaluations of the same weights agree: a run's first is its predecessor's last,
        # and REINFORCE++, whose every update was skipped, ends where it began
        assert all(evals[i][0] == evals[i - 1][1] for i in range(1, len(evals))), evals
        assert evals[list(VARIANTS).index("reinforce_pp")][0] == evals[list(VARIANTS).index("reinforce_pp")][1]


def check_episodes(trainer, run: Path) -> None:
    """Each step's 8 samples were episodes, some of several turns, checked end to end (the actor's
    log-probs of the model's tokens equal the engine's), observations out of the loss."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        assert sum(v for k, v in row.items() if k.startswith("episode/ends_")) == 8, row
        assert "episode/ends_error" not in row and "episode/ends_timeout" not in row, row
        assert row["episode/turns"] >= 1 and row["episode/generate_calls"] >= 1, row
        assert row["rollout_logprob_gap_max"] <= FP32_PROBE, row
    assert any(row["episode/turns"] > 1 for row in rows), rows  # observations were in the trajectories
    evals = json.loads((run / "eval.json").read_text())  # the evaluations' episodes, before and after
    assert all(0.0 <= evals[k]["episode/tool_call_share"] <= 1.0 and evals[k]["episode/turns"] >= 1
               for k in ("episodes_before", "episodes_after")), evals
    last = trainer.episodes.last
    assert len(last) == 8  # the final evaluation's (greedy: may all end in one turn; the steps had several)
    from xray.data.trajectory import pack_trajectories

    batch = pack_trajectories(last)
    for i, t in enumerate(last):  # the loss mask: exactly the model's tokens of each trajectory
        response = batch["loss_mask"][i][len(t.prompt_ids) - 1:][:len(t.mask)]
        assert response.tolist() == [float(m) for m in t.mask], (t.mask, response)


def check_run(algo: str, run: Path, before: dict, backend: str) -> None:
    from safetensors.torch import load_file

    from tests.e2e.test_async_e2e import check as check_detached

    rows = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert sorted(rows) == [1, 2, 3], algo
    if algo in ASYNC_ON:  # the makers' verified loads, staleness, each trainer's share from the makers
        check_detached(rows, [1, 2, 3], 1 if backend.startswith("megatron") else 2, backend, prompts=4, paired=False)
    for row in rows.values():
        assert all(math.isfinite(v) for v in row.values() if isinstance(v, float)), (algo, row)
        if algo not in ASYNC_ON:
            assert row.get("sync/max_abs_logprob_diff", 0.0) <= FP32_PROBE, row
            check_held(row, backend)
            assert row["sync/version"] == row["step"]  # verified after every step's sync
        assert not any(k.startswith("critic/") for k in row)
        assert ("kl" in row and "kl_k3" in row) == (algo not in ("grpo-on-policy", "opd", "opd-async")), row
        assert ("distill/reverse_kl" in row) == (algo in TEACHER)  # the teacher scored the samples
        if algo in TEACHER:  # two different models: the teacher's log-probs are not the student's (a sample
            assert row["distill/reverse_kl"] != 0 and row["distill/teacher_logprob"] < 0, row  # k1 may be < 0)
    assert {p.name for p in (run / "checkpoints/step-000002").iterdir() if p.is_dir()} == {"actor"}
    after = load_file(str(run / "final/actor/model.safetensors"))
    moved = max(float((before[k].float() - after[k].float()).abs().max()) for k in after)
    if algo == "grpo":
        assert all(r["actor/kl_loss"] >= 0 for r in rows.values()) and moved > 0
        for r in rows.values():  # a second round exactly when the first had fewer than 4 varied groups
            rounds, varied = r["dynamic_sampling/rounds"], r["dynamic_sampling/varied_groups"]
            assert r["dynamic_sampling/sampled_groups"] == 4 * rounds and rounds in (1.0, 2.0), r
            assert r["dynamic_sampling/filled_groups"] == max(0.0, 4 - varied), r
        assert all(r["ppo/epochs"] == 2 and r["actor/updates_skipped"] == 0 for r in rows.values())
    if algo in ("opd", "opd-async", "grpo-async"):  # opd: the teacher's term alone (no reward in it) moved it
        assert all(r["ppo/epochs"] == 2 and r["actor/updates_skipped"] == 0 for r in rows.values()) and moved > 0
    if algo == "rloo":  # the first epoch's approx KL is above 1e-9: the second never runs
        assert all(r["ppo/epochs"] == 1 for r in rows.values()) and "actor/kl_loss" not in rows[1] and moved > 0
    if algo == "reinforce_pp":  # 2 mini-batches x 2 epochs, every one skipped: the weights stay
        assert all(r["actor/updates_skipped"] == 4 and r["actor/skipped"] == 1 for r in rows.values())
        assert moved == 0.0
    if algo == "grpo-on-policy":  # the train step's own log-probs as the old ones
        assert all(r["actor/ratio"] == 1.0 and r["actor/approx_kl"] == 0.0 for r in rows.values()) and moved > 0
