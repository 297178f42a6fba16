"""The run report's tables of what the model said: the first responses of the run's last evaluation
(`evals/step-<N>.jsonl`, `xray.run.evaluate`) and the last logged step's rollouts
(`rollouts.jsonl`, `xray.run.rollout_log`), as HTML with every text escaped and long texts cut.
"""
from __future__ import annotations

import json
from html import escape
from pathlib import Path

from xray.run.outputs import EVALS_DIR, ROLLOUTS_FILE

ROWS = 8
"""Responses shown per table."""
CHARS = 400
"""Characters shown of a prompt or completion (the files hold them whole)."""


def read_jsonl(path: Path) -> list[dict]:
    """The whole JSON objects of a JSON-lines file (a torn last line left out)."""
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def last_eval(run_dir: Path) -> tuple[Path, list[dict]] | None:
    """The newest evaluation's samples file and its rows (None: the run wrote none)."""
    files = sorted((run_dir / EVALS_DIR).glob("step-*.jsonl"))
    return (files[-1], read_jsonl(files[-1])) if files else None


def last_rollouts(run_dir: Path) -> list[dict]:
    """The rows of the last step in `rollouts.jsonl` (none: the run wrote none)."""
    path = run_dir / ROLLOUTS_FILE
    rows = read_jsonl(path) if path.is_file() else []
    last = max((r.get("step", 0) for r in rows), default=None)
    return [r for r in rows if r.get("step") == last]


def cell(value) -> str:
    """One table cell's text, escaped: numbers to 4 digits, long texts cut at `CHARS`."""
    if value is None:
        return "<td>-</td>"
    if isinstance(value, float):
        return f"<td>{value:.4f}</td>"
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    if len(text) > CHARS:
        text = text[:CHARS] + " [...]"
    return f"<td><pre class='sample'>{escape(text)}</pre></td>"


def table(rows: list[dict], columns: tuple[str, ...]) -> str:
    head = "".join(f"<th>{escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(cell(r.get(c)) for c in columns) + "</tr>" for r in rows[:ROWS])
    return f"<table class='samples'><tr>{head}</tr>{body}</table>"


def samples_html(run_dir: Path) -> str | None:
    """The section of the page with both tables (None: the run wrote neither file)."""
    parts = []
    evaluation = last_eval(run_dir)
    if evaluation is not None:
        path, rows = evaluation
        parts += [f"<h3>Evaluation: {escape(path.name)}</h3>",
                  f"<p class='about'>The first {min(ROWS, len(rows))} of its {len(rows)} responses "
                  f"({escape(EVALS_DIR)}/{escape(path.name)} holds them all).</p>",
                  table(rows, ("prompt_index", "sample", "source", "prompt", "completion", "reward", "correct"))]
    rollouts = last_rollouts(run_dir)
    if rollouts:
        parts += [f"<h3>Rollouts of step {escape(str(rollouts[0].get('step')))}</h3>",
                  f"<p class='about'>The first {min(ROWS, len(rollouts))} of the {len(rollouts)} responses "
                  f"{escape(ROLLOUTS_FILE)} holds for that step (trainer.log_rollouts prompts' samples).</p>",
                  table(rollouts, ("group", "sample", "prompt", "completion", "reward", "advantage"))]
    if not parts:
        return None
    return "\n".join(["<h2 id='samples'>Samples</h2>", *parts])
