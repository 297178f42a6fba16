"""Writing a run's report: `RUN_DIR/report/index.html` with its PNG plots and the step timeline.

Reads what a run leaves in its output directory (`xray.run.outputs`): `metrics.jsonl` (one row
per logged step), `eval.json` (the evaluations before and after training), `timeline.json` (one
step's Chrome trace, `xray.run.timeline`), the last evaluation's responses and the last step's
rollouts (`xray.report.samples`) and `config.yaml`; draws every panel of
`xray.report.panels` whose metrics the run has (`xray.report.plots`), the timeline as a Gantt chart
(`xray.report.gantt`, with the trace copied beside it), and the page (`xray.report.page`).
`python -m xray.report RUN_DIR` calls `write_report`; a run calls `report_at_end` when it ends
(`trainer.report`).
"""
from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

from xray.report.page import Section, render
from xray.report.panels import panels_for, series
from xray.report.samples import samples_html
from xray.run.outputs import EVAL_FILE, METRICS_FILE
from xray.run.timeline import TIMELINE_FILE

log = logging.getLogger(__name__)
REPORT_DIR = "report"
"""The report's folder in a run's output directory."""
TIMELINE_PNG = "timeline.png"


class ReportError(ValueError):
    """A run directory the report cannot be written from."""


def read_metrics(run_dir: Path) -> list[dict]:
    """The rows of `metrics.jsonl`, in step order (a resumed run's repeated step: its last row)."""
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise ReportError(f"{path} does not exist: give the output directory of a run "
                          "(the --output-dir of `python -m xray.train`)")
    rows: dict[int, dict] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ReportError(f"{path}:{n} is not JSON ({exc}); remove that line and report again") from None
            rows[int(row.get("step", n))] = {**row, "step": int(row.get("step", n))}
    return [rows[step] for step in sorted(rows)]


def read_evals(run_dir: Path) -> dict[str, float]:
    """`eval_before`, `eval_after` and the `step` of the latter, as far as the run wrote them."""
    path = run_dir / EVAL_FILE
    if not path.is_file():
        return {}
    return {k: float(v) for k, v in json.loads(path.read_text()).items()
            if isinstance(v, (int, float)) and math.isfinite(v)}


def final_eval_metrics(run_dir: Path) -> dict[str, float]:
    """The last evaluation's metrics besides `eval` (`eval/pass@k`, per source), from `eval.json`."""
    path = run_dir / EVAL_FILE
    after = json.loads(path.read_text()).get("metrics_after") if path.is_file() else None
    return {k: float(v) for k, v in (after or {}).items()
            if k not in ("eval", "eval/mean_reward") and isinstance(v, (int, float)) and math.isfinite(v)}


def summary_of(run_dir: Path, rows: list[dict], evals: dict[str, float]) -> list[tuple[str, str]]:
    """The table at the top of the page."""
    table = [("run", str(run_dir.resolve())), ("steps logged", str(len(rows)))]
    if rows:
        table.append(("last step", str(rows[-1]["step"])))
    for key in ("eval_before", "eval_after"):
        if key in evals:
            table.append((key.replace("_", " "), f"{evals[key]:.4f}"))
    table += [(f"{key} after", f"{value:.4f}") for key, value in final_eval_metrics(run_dir).items()]
    rewards = series(rows, "reward/mean")[1]
    if rewards:
        table.append(("reward, first / last step", f"{rewards[0]:.4f} / {rewards[-1]:.4f}"))
    seconds = [sum(v for k, v in row.items() if k.startswith("time/") and isinstance(v, (int, float)))
               for row in rows]
    if any(seconds):
        table.append(("seconds per step (mean)", f"{sum(seconds) / len(seconds):.3f}"))
    return table


def timeline_section(run_dir: Path, out: Path) -> Section | None:
    """Draw `timeline.json` (when the run wrote one) and copy it beside the page."""
    trace_path = run_dir / TIMELINE_FILE
    if not trace_path.is_file():
        return None
    from xray.report.gantt import draw_gantt

    trace = json.loads(trace_path.read_text())
    draw_gantt(trace, out / TIMELINE_PNG)
    shutil.copyfile(trace_path, out / TIMELINE_FILE)
    step = trace.get("otherData", {}).get("step", "?")
    return Section("timeline", f"Timeline of step {step}", TIMELINE_PNG,
                   "Busy intervals of every Workhorse during one step, per role and rank "
                   "(trainer.timeline_step chooses the step).",
                   (TIMELINE_FILE, "timeline.json: the same as a Chrome trace; open it in "
                                   "https://ui.perfetto.dev or chrome://tracing"))


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the report of the run in `run_dir` into `out` (default `run_dir/report`); the page's path."""
    from xray.report.plots import draw_panel

    run_dir = Path(run_dir)
    out = Path(out) if out is not None else run_dir / REPORT_DIR
    rows, evals = read_metrics(run_dir), read_evals(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    sections = []
    for panel, keys in panels_for(rows, evals):
        draw_panel(panel, keys, rows, evals, out / f"{panel.name}.png")
        sections.append(Section(panel.name, panel.title, f"{panel.name}.png", panel.about))
    timeline = timeline_section(run_dir, out)
    if timeline is not None:
        sections.append(timeline)
    config = run_dir / "config.yaml"
    page = render(f"xray run report: {run_dir.resolve().name}", summary_of(run_dir, rows, evals), sections,
                  config.read_text() if config.is_file() else None, samples_html(run_dir))
    (out / "index.html").write_text(page)
    return out / "index.html"


def report_at_end(run_dir: Path) -> Path | None:
    """`write_report` for a run that just ended: a failure is logged as a warning, never raised."""
    try:
        page = write_report(run_dir)
    except Exception as exc:  # noqa: BLE001 - the run's results stand without their report
        log.warning("the run report was not written (%s: %s); write it with `python -m xray.report %s`",
                    type(exc).__name__, exc, run_dir)
        return None
    log.info("run report: %s", page)
    return page
