"""Evaluation users read (`xray/run/eval_metrics.py`, `xray/run/evaluate.py`, `xray/run/rollout_log.py`,
`xray/report/samples.py`): the unbiased pass@k and mean@k with exact numbers, the per-source
breakdown, the eval config's checks, the samples file's and rollouts.jsonl's rows, and the report's
escaped tables. No Ray, no model: a fake trainer and tokenizer."""
import asyncio
import json

import pytest
import torch

from xray.config.eval import EvalConfig, eval_max_new_tokens
from xray.config.schema import RunConfig
from xray.config.typed import ConfigError, build
from xray.data import columns as C
from xray.data.batch import Batch
from xray.report.samples import samples_html
from xray.run.eval_metrics import PromptResult, eval_metrics, pass_at_k, summary
from xray.run.evaluate import Evaluations, eval_sampling
from xray.run.outputs import RunDir
from xray.run.rollout_log import RolloutLog, pick_rollouts

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("n, c, k, expected", [
    (4, 1, 2, 0.5),         # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (4, 1, 1, 0.25),        # pass@1 is the share correct
    (5, 2, 3, 0.9),         # 1 - C(3,3)/C(5,3) = 1 - 1/10
    (10, 3, 4, 1 - 35 / 210),
    (4, 3, 2, 1.0),         # fewer wrong ones than k: always a correct one drawn
    (4, 0, 4, 0.0),
    (1, 1, 1, 1.0),
])
def test_pass_at_k_is_the_unbiased_estimate(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_refuses_k_above_n():
    with pytest.raises(ValueError, match="n=2, c=1, k=3"):
        pass_at_k(2, 1, 3)


def test_mean_at_k_pass_at_k_and_the_per_source_breakdown():
    results = [PromptResult((1.0, 0.0, 0.0, 0.0), "gsm8k"),   # 1 of 4 correct
               PromptResult((1.0, 1.0, 0.5, None), "gsm8k"),  # 2 correct, one dropped by the reward
               PromptResult((0.0, 0.0, 0.0, 0.0), "math")]    # none
    m = eval_metrics(results, (1, 2), 1.0)
    kept = [1, 0, 0, 0, 1, 1, 0.5, 0, 0, 0, 0]
    assert m["eval"] == m["eval/mean_reward"] == pytest.approx(sum(kept) / len(kept))  # mean@k over kept
    assert m["eval/pass@1"] == pytest.approx((0.25 + 0.5 + 0.0) / 3)
    assert m["eval/pass@2"] == pytest.approx((0.5 + (1 - 1 / 6) + 0.0) / 3)  # c=2 of 4: 1 - C(2,2)/C(4,2)
    assert m["eval/gsm8k/mean_reward"] == pytest.approx(3.5 / 7)
    assert m["eval/gsm8k/pass@2"] == pytest.approx((0.5 + 5 / 6) / 2)
    assert m["eval/math/mean_reward"] == 0.0 and m["eval/math/pass@1"] == 0.0
    assert sorted(m) == sorted(["eval", "eval/mean_reward", "eval/pass@1", "eval/pass@2",
                                *(f"eval/{s}/{k}" for s in ("gsm8k", "math") for k in ("mean_reward", "pass@1", "pass@2"))])


def test_threshold_and_no_source_column():
    results = [PromptResult((0.6, 0.4)), PromptResult((0.9, 0.2))]
    assert eval_metrics(results, (1,), 0.5) == pytest.approx(
        {"eval": 0.525, "eval/mean_reward": 0.525, "eval/pass@1": 0.5})  # no `eval/<source>/...`
    partly = [PromptResult((1.0,), "a"), PromptResult((0.0,), None)]
    assert summary(partly, (1,), 1.0) == {"mean_reward": 0.5, "pass@1": 0.5}
    assert eval_metrics(partly, (1,), 1.0)["eval/unknown/mean_reward"] == 0.0


def test_eval_config_checks_say_the_fix():
    with pytest.raises(ConfigError, match="eval.temperature above 0"):
        EvalConfig(n_samples=4)
    with pytest.raises(ConfigError, match=r"\[8\] outside 1..eval.n_samples=4; raise eval.n_samples to 8"):
        EvalConfig(n_samples=4, temperature=0.8, pass_k=(1, 8))
    with pytest.raises(ConfigError, match="eval: eval.top_p=0"):
        build(RunConfig, {"eval": {"top_p": 0}})
    cfg = build(RunConfig, {"eval": {"n_samples": 4, "temperature": 0.7, "pass_k": [1, 4], "max_new_tokens": 8},
                            "rollout": {"max_new_tokens": 16}})
    assert cfg.eval.pass_k == (1, 4) and eval_max_new_tokens(cfg) == 8
    assert eval_max_new_tokens(build(RunConfig, {"rollout": {"max_new_tokens": 16}})) == 16
    with pytest.raises(ConfigError, match="eval.max_new_tokens=32 exceeds rollout.max_new_tokens=16"):
        eval_max_new_tokens(build(RunConfig, {"eval": {"max_new_tokens": 32}, "rollout": {"max_new_tokens": 16}}))


def test_eval_sampling_takes_the_eval_section_and_one_seed():
    cfg = build(RunConfig, {"seed": 3, "eval": {"n_samples": 2, "temperature": 0.6, "top_p": 0.9},
                            "rollout": {"temperature": 1.0, "top_k": 20, "max_new_tokens": 12}})
    s = eval_sampling(cfg, [2])
    assert {k: s[k] for k in ("temperature", "top_p", "top_k", "max_new_tokens", "n", "stop_token_ids", "seed")} == \
        {"temperature": 0.6, "top_p": 0.9, "top_k": 0, "max_new_tokens": 12, "n": 2, "stop_token_ids": [2],
         "seed": 3 * 100003}


class Tokenizer:
    """Token i is the letter chr(97 + i); 0 is a special token, left out."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(96 + i) for i in ids if i or not skip_special_tokens)


class FakeTrainer:
    """What an evaluation uses of an RLTrainer: the rollout answers row i's sample j with tokens
    [i+1, j+1, 0]; the reward is 1 for sample 0, NaN-dropped for prompt 1's sample 1, else 0.25."""

    def __init__(self, cfg):
        self.cfg, self.stop_ids, self.sampled = cfg, [0], []

    async def wake_rollout(self):
        pass

    async def rollout(self, rows, sampling):
        self.sampled.append(sampling)
        n = sampling["n"]
        return Batch({}, {C.RESPONSE_IDS: [[i // n + 1, i % n + 1, 0] for i in range(len(rows) * n)]})

    async def score(self, rows, generated, pending):
        assert [r["prompt"] for r in rows] == ["p0", "p0", "p0", "p1", "p1", "p1"]  # a row per sample
        scores = torch.tensor([1.0 if ids[1] == 1 else 0.25 for ids in generated[C.RESPONSE_IDS]])
        keep = torch.ones(len(scores), dtype=torch.bool)
        keep[4] = False
        return scores, keep


def test_evaluation_writes_one_row_per_response(tmp_path):
    cfg = build(RunConfig, {"eval": {"n_samples": 3, "temperature": 0.8, "pass_k": [1, 2], "correct_threshold": 0.5}})
    run = RunDir(tmp_path / "run", loggers=())
    rows = [{"prompt": "p0", "prompt_ids": [5], "data_source": "arith"}, {"prompt": "p1", "prompt_ids": [6]}]
    evaluations = Evaluations(FakeTrainer(cfg), rows, run, Tokenizer())
    metrics = asyncio.run(evaluations(7))
    assert metrics["eval"] == pytest.approx((1 + 0.25 + 0.25 + 1 + 0.25) / 5)
    assert metrics["eval/pass@1"] == pytest.approx((1 / 3 + 1 / 3) / 2)
    assert metrics["eval/arith/pass@2"] == pytest.approx(1 - 1 / 3) and metrics["eval/unknown/mean_reward"] == 0.625
    lines = (tmp_path / "run/evals/step-000007.jsonl").read_text().splitlines()
    got = [json.loads(line) for line in lines]
    assert len(got) == 6 and evaluations.last == metrics
    assert got[0] == {"step": 7, "prompt_index": 0, "sample": 0, "source": "arith", "prompt": "p0",
                      "completion": "aa", "reward": 1.0, "correct": True}
    assert got[4] == {"step": 7, "prompt_index": 1, "sample": 1, "source": None, "prompt": "p1",
                      "completion": "bb", "reward": None, "correct": False}
    assert [r["reward"] for r in got] == [1.0, 0.25, 0.25, 1.0, None, 0.25]


def test_pick_rollouts_keeps_the_first_groups_with_their_mean_advantage():
    exp = Batch({}, {C.PROMPT_IDS: [[1], [1], [2], [2], [3], [3]], C.RESPONSE_IDS: [[4, 5], [6], [7], [8], [9], [9]]})
    mask = torch.tensor([[1, 1, 0], [0, 1, 0], [1, 0, 0], [0, 0, 0], [1, 0, 0], [1, 0, 0]], dtype=torch.float)
    adv = torch.arange(18, dtype=torch.float).reshape(6, 3)
    keep = torch.tensor([True, True, True, False, True, True])
    rows = pick_rollouts(exp, torch.tensor([0.5, 1.0, 0.0, 0.0, 1.0, 1.0]), adv, mask, 2, 2, keep)
    assert rows == [
        {"group": 0, "sample": 0, "prompt_ids": [1], "response_ids": [4, 5], "reward": 0.5, "advantage": 0.5},
        {"group": 0, "sample": 1, "prompt_ids": [1], "response_ids": [6], "reward": 1.0, "advantage": 4.0},
        {"group": 1, "sample": 0, "prompt_ids": [2], "response_ids": [7], "reward": 0.0, "advantage": 6.0},
        {"group": 1, "sample": 1, "prompt_ids": [2], "response_ids": [8], "reward": None, "advantage": None}]
    assert pick_rollouts(exp, torch.zeros(6), None, mask, 9, 2)[5]["advantage"] is None  # all 6, no advantages
    assert pick_rollouts(exp, torch.zeros(6), adv, mask, 0, 2) == []


def test_rollout_log_appends_and_a_step_done_again_replaces_its_rows(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    row = {"group": 0, "sample": 0, "prompt_ids": [1, 0], "response_ids": [2, 3], "reward": float("nan"),
           "advantage": -0.5}
    log = RolloutLog(path, Tokenizer())
    assert log.write(1, [row, dict(row, sample=1)]) == 2 and log.write(2, [row]) == 1
    first = json.loads(path.read_text().splitlines()[0])
    assert first == {"step": 1, "group": 0, "sample": 0, "prompt": "a", "completion": "bc", "reward": None,
                     "advantage": -0.5}
    log.write(2, [dict(row, group=5)])  # step 2 again (a recovery): its rows replaced
    assert [(r["step"], r["group"]) for r in map(json.loads, path.read_text().splitlines())] == [(1, 0), (1, 0), (2, 5)]
    with open(path, "a") as f:
        f.write('{"step": 3, "gro')  # a crash mid-write
    RolloutLog(path, Tokenizer(), start_step=1)  # resumed after step 1: later rows go, the torn one too
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 1]


def test_report_shows_escaped_samples(tmp_path):
    from xray.report.write import write_report

    run = tmp_path / "run"
    (run / "evals").mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    (run / "evals/step-000000.jsonl").write_text(json.dumps({"prompt": "stale-eval", "completion": "stale-eval"}) + "\n")
    rows = [{"step": 1, "prompt_index": i, "sample": 0, "source": None, "prompt": f"{i}+1=",
             "completion": "<script>x</script>" if i == 0 else "y" * 1000, "reward": 1.0, "correct": True}
            for i in range(10)]
    (run / "evals/step-000001.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "rollouts.jsonl").write_text("".join(json.dumps({"step": s, "group": 0, "sample": 0, "prompt": "q & a",
                                                            "completion": f"step {s}", "reward": 0.25,
                                                            "advantage": -1.5}) + "\n" for s in (1, 2)))
    (run / "eval.json").write_text(json.dumps({"eval_before": 0.1, "eval_after": 0.5, "step": 1,
                                               "metrics_after": {"eval": 0.5, "eval/pass@4": 0.75}}))
    html = write_report(run).read_text()
    assert samples_html(run) in html and "&lt;script&gt;x&lt;/script&gt;" in html and "<script>" not in html
    assert "step-000001.jsonl" in html and "stale-eval" not in html  # the newest evaluation only
    assert "8+1=" not in html and "9+1=" not in html  # rows past the 8th are left out
    assert "<td><pre class='sample'>7+1=</pre></td>" in html and "y" * 400 + " [...]" in html
    assert "Rollouts of step 2" in html and "step 2" in html and "q &amp; a" in html and "-1.5000" in html
    assert "eval/pass@4 after</th><td>0.7500" in html


def test_an_asynchronous_run_hands_its_trainers_rollouts_to_the_driver():
    """The detached trainer's step metrics carry its picked rollouts (`ROLLOUT_ROWS`); the supervisor
    takes them out onto the driver's trainer before `on_step` logs the metrics."""
    from types import SimpleNamespace

    from xray.run.detached.supervisor import Detached
    from xray.run.detached.trainer import TRAINER_STATE
    from xray.run.rollout_log import ROLLOUT_ROWS

    picked = {1: [{"group": 0}], 2: [{"group": 0}, {"group": 1}]}

    class Remote:
        def __init__(self, fn):
            self.remote = lambda *args: asyncio.ensure_future(fn(*args))

    async def run(until):
        return until

    async def next_metrics(step, _):
        return {"reward/mean": 0.5 * step, ROLLOUT_ROWS: picked[step], TRAINER_STATE: {"kl": {"value": step}}}

    async def state():
        return {"step": 2, "kl": {}}

    detached = object.__new__(Detached)
    detached.trainer = SimpleNamespace(state=SimpleNamespace(step=0), kl=SimpleNamespace(load_state_dict=lambda s: None),
                                       rollout_rows=[])
    detached.learner = SimpleNamespace(run=Remote(run), next_metrics=Remote(next_metrics), state=Remote(state))
    async def no_notices():
        return []

    detached.runs, detached.trainer_runs, detached.inbox = [], 0, SimpleNamespace(take=Remote(no_notices))
    detached.kl_states = {}
    seen = []

    async def on_step(step, metrics):
        seen.append((step, dict(metrics), detached.trainer.rollout_rows))

    asyncio.run(detached.segment(1, 2, on_step, None))
    assert seen == [(1, {"reward/mean": 0.5}, picked[1]), (2, {"reward/mean": 1.0}, picked[2])]
    assert detached.kl_states == {1: {"value": 1}, 2: {"value": 2}}  # each step's KL state, for a takeover
