"""The run report (`xray.report`) from a synthetic run directory, and the step timeline's Chrome
trace (`xray.run.timeline`): the page references every plot, the PNGs are real images of the
stated size, the trace holds the expected events, and a failing report never fails a run."""
import asyncio
import json
import math
import re

import pytest
from PIL import Image

from xray.report.__main__ import main as report_main
from xray.report.panels import PANELS
from xray.report.plots import DPI, SIZE_IN
from xray.report.write import report_at_end, write_report
from xray.run.timeline import TIMELINE_FILE, StepTimeline, trace_events

pytestmark = pytest.mark.unit
T0 = 1_700_000_000.0
PNG_SIZE = (int(SIZE_IN[0] * DPI), int(SIZE_IN[1] * DPI))


def ppo_row(step: int) -> dict:
    row = {"step": step, "reward/mean": 0.1 * step, "reward/std": 0.05, "kl": 0.01 * step, "kl_k3": 0.009 * step,
           "kl_coef": 0.01, "actor/approx_kl": 0.002, "actor/entropy": 3.0 - 0.1 * step,
           "actor/policy_loss": -0.01 / step, "actor/policy_clipfrac": 0.05, "critic/value_loss": 0.5 / step,
           "critic/value_clipfrac": 0.01, "response_length": 4.0 + step, "time/generate_s": 0.5,
           "time/score_s": 0.2, "time/train_s": 1.0 + 0.1 * step, "time/sync_s": 0.3, "tokens_per_s": 900.0}
    if step % 3 == 0:
        row["eval"] = 0.2 + 0.05 * step
        row.update({"eval/mean_reward": row["eval"], "eval/pass@1": 0.1 + 0.05 * step, "eval/arith/mean_reward": 0.3})
    return row


BUSY = [  # busy_time() answers: (start, end) as before, (start, end, method) as now
    {"rank": 0, "role": "actor", "intervals": [(T0 + 0.5, T0 + 0.9, "forward"), (T0 + 1.2, T0 + 2.0, "train_step")]},
    {"rank": 1, "role": "actor", "intervals": [(T0 + 0.5, T0 + 0.9, "forward"), (T0 + 1.2, T0 + 2.1, "train_step")]},
    {"rank": 0, "role": "critic", "intervals": [(T0 + 0.6, T0 + 0.8, "forward")]},
    {"rank": 0, "role": "reference", "intervals": [(T0 + 0.5, T0 + 0.7)]},
    {"rank": 0, "role": "rollout", "intervals": [(T0 - 1.0, T0 + 0.4, "generate"), (T0 + 2.2, T0 + 2.4, "load_weights"),
                                                  (T0 + 3.0, T0 + 3.5, "generate")]},
]


def synthetic_run(path, rows, evals=None, trace=True):
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "config.yaml").write_text("trainer:\n  steps: 6\n")
    if evals is not None:
        (path / "eval.json").write_text(json.dumps(evals))
    if trace:
        (path / TIMELINE_FILE).write_text(json.dumps(trace_events(BUSY, T0, T0 + 2.5, step=2)))
    return path


def assert_png(path, size=None):
    assert path.is_file(), path
    assert path.stat().st_size > 8_000, (path, path.stat().st_size)  # axes, lines, text: not a blank canvas
    with Image.open(path) as image:
        assert image.format == "PNG"
        if size is not None:
            assert image.size == size
        colours = image.convert("RGB").getcolors(maxcolors=100_000)
        assert colours is None or len(colours) > 20  # drawn, not one flat colour
        return image.size


def test_report_of_a_ppo_run_has_every_plot_and_the_timeline(tmp_path):
    run = synthetic_run(tmp_path / "run", [ppo_row(s) for s in range(1, 7)],
                        {"eval_before": 0.1, "eval_after": 0.55, "step": 6})
    page = write_report(run)
    assert page == run / "report" / "index.html"
    html = page.read_text()
    images = re.findall(r"<img src='([^']+)'", html)
    assert images == [f"{p.name}.png" for p in PANELS] + ["timeline.png"]
    for name in images[:-1]:
        assert_png(run / "report" / name, PNG_SIZE)
    rows = 1 + 5  # the driver's step, actor r0, r1, critic r0, reference r0, rollout r0
    width, height = assert_png(run / "report" / "timeline.png")
    assert width == 1000 and height == round((1.2 + 0.35 * rows) * DPI)
    assert "href='timeline.json'" in html and (run / "report" / "timeline.json").is_file()
    assert "eval before</th><td>0.1000" in html and "eval after</th><td>0.5500" in html
    assert "steps: 6" in html  # the config


def test_a_panel_is_left_out_when_the_run_has_none_of_its_metrics(tmp_path):
    """A critic-free run without eval.json nor timeline: no value loss, eval only from `eval`."""
    rows = [{k: v for k, v in ppo_row(s).items() if not k.startswith(("critic/", "eval"))} for s in (1, 2)]
    run = synthetic_run(tmp_path / "grpo", rows, trace=False)
    html = write_report(run).read_text()
    drawn = sorted(p.name for p in (run / "report").glob("*.png"))
    assert drawn == sorted(p.name + ".png" for p in PANELS if p.name not in ("value_loss", "eval", "eval_detail"))
    assert "value_loss.png" not in html and "eval.png" not in html and "timeline" not in html
    assert_png(run / "report" / "clip_fractions.png", PNG_SIZE)  # the actor's clip fraction alone


def test_trace_events_are_a_chrome_trace_per_role_and_rank_relative_to_the_step():
    trace = json.loads(json.dumps(trace_events(BUSY, T0, T0 + 2.5, step=2)))  # plain JSON
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {0: "driver", 1: "actor", 2: "critic", 3: "reference", 4: "rollout"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert threads == {(0, 0): "step", (1, 0): "rank 0", (1, 1): "rank 1", (2, 0): "rank 0", (3, 0): "rank 0",
                       (4, 0): "rank 0"}
    spans = [(names[e["pid"]], e["tid"], e["name"], e["ts"], e["dur"]) for e in events if e["ph"] == "X"]
    assert spans[0] == ("driver", 0, "step 2", 0.0, 2.5e6)
    got = {s[:3]: s[3:] for s in spans[1:]}
    assert len(got) == len(spans) - 1 == 8  # the rollout's last generate is after the step: left out
    assert got[("actor", 1, "train_step")] == pytest.approx((1.2e6, 0.9e6))
    assert got[("reference", 0, "busy")] == pytest.approx((0.5e6, 0.2e6))  # unnamed (start, end) intervals
    assert got[("rollout", 0, "generate")] == pytest.approx((0.0, 0.4e6))  # clipped to the step's start
    assert got[("rollout", 0, "load_weights")] == pytest.approx((2.2e6, 0.2e6))
    assert all(e["ts"] >= 0 and e["ts"] + e["dur"] <= 2.5e6 + 1e-6 for e in events if e["ph"] == "X")
    assert trace["displayTimeUnit"] == "ms" and math.isclose(trace["otherData"]["wall_s"], 2.5)


class FakeModel:
    """A WholeModel's `busy_time()`: each call drains what was recorded since the last one."""

    def __init__(self, role, record):
        self.role, self.record, self.calls = role, record, 0

    async def busy_time(self):
        self.calls += 1
        answer, self.record = self.record, []
        return answer


class FakeModels:
    def __init__(self, *models):
        self.models = list(models)

    def all(self):
        return self.models


def test_step_timeline_drains_before_its_step_and_writes_after_it(tmp_path):
    import time

    now = time.time()
    old = {"rank": 0, "role": "actor", "intervals": [(now - 60, now - 59, "forward")]}  # before the step: drained
    actor, rollout = FakeModel("actor", [old]), FakeModel("rollout", [])
    models = FakeModels(actor, rollout)
    timeline = StepTimeline(2, tmp_path)

    async def steps():
        for step in (1, 2, 3):
            await timeline.begin(step, models)
            t = time.time()
            actor.record.append({"rank": 0, "role": "actor", "intervals": [(t, t + 0.001, "train_step")]})
            rollout.record.append({"rank": 0, "role": "rollout", "intervals": [(t, t + 0.001)]})
            await asyncio.sleep(0.002)
            await timeline.end(step, models)

    asyncio.run(steps())
    assert actor.calls == rollout.calls == 2  # once before step 2, once after: no cost at other steps
    trace = json.loads((tmp_path / TIMELINE_FILE).read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in spans] == ["step 2", "train_step", "busy"]
    assert trace["otherData"]["step"] == 2 and trace["otherData"]["roles"] == ["actor", "rollout"]

    off = StepTimeline(0, tmp_path / "off")
    asyncio.run(off.begin(0, models))
    asyncio.run(off.end(0, models))
    assert actor.calls == 2 and not (tmp_path / "off").exists()


def test_a_failing_report_is_a_warning_and_the_cli_says_the_fix(tmp_path, caplog, capsys):
    assert report_at_end(tmp_path / "missing") is None
    assert "python -m xray.report" in caplog.text and "metrics.jsonl does not exist" in caplog.text
    assert report_main([str(tmp_path / "missing")]) == 2
    assert "--output-dir" in capsys.readouterr().err
    run = synthetic_run(tmp_path / "run", [ppo_row(1)], trace=False)
    assert report_main([str(run), "--out", str(tmp_path / "elsewhere")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "elsewhere" / "index.html")
    assert_png(tmp_path / "elsewhere" / "reward.png", PNG_SIZE)
