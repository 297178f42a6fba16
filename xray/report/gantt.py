"""The run report's timeline: a step's Chrome trace (`xray.run.timeline`) drawn as a Gantt chart.

One row per process and thread of the trace: the driver's step first, then each role's ranks
(`actor r0`, `actor r1`, ..., `rollout r0`); one bar per complete event, coloured by its name
(the Workhorse method, or `busy`), in milliseconds from the step's start.
"""
from __future__ import annotations

from pathlib import Path

from xray.report.plots import new_figure, save

MAX_LEGEND = 10
"""Names shown in the legend (those with the most time); the others share the colour `other`."""


def rows_of(trace: dict) -> tuple[list[tuple[int, int]], dict[tuple[int, int], str]]:
    """The (pid, tid) of every row with an event, in order, and each row's label."""
    events = trace.get("traceEvents", [])
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e["name"] == "thread_name"}
    keys = sorted({(e["pid"], e["tid"]) for e in events if e.get("ph") == "X"})
    labels = {}
    for pid, tid in keys:
        thread = threads.get((pid, tid), f"{tid}").replace("rank ", "r")
        labels[(pid, tid)] = f"{processes.get(pid, pid)} {thread}"
    return keys, labels


def draw_gantt(trace: dict, path: Path) -> Path:
    """Draw `trace`'s complete events as a Gantt chart into the PNG `path`."""
    keys, labels = rows_of(trace)
    spans = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    totals: dict[str, float] = {}
    for e in spans:
        if e["pid"] != 0:  # the driver's step is not a method
            totals[e["name"]] = totals.get(e["name"], 0.0) + e["dur"]
    named = sorted(totals, key=totals.get, reverse=True)[:MAX_LEGEND]
    from matplotlib import colormaps

    palette = colormaps["tab10"].colors
    colours = {name: palette[i % len(palette)] for i, name in enumerate(named)}
    figure = new_figure((10.0, 1.2 + 0.35 * max(1, len(keys))))
    ax = figure.add_subplot()
    row = {key: i for i, key in enumerate(keys)}
    seen: set[str] = set()
    for e in spans:
        step = e["pid"] == 0
        name = "step" if step else e["name"] if e["name"] in colours else "other"
        colour = "0.75" if step else colours.get(name, "0.4")
        ax.broken_barh([(e["ts"] / 1e3, max(e["dur"] / 1e3, 1e-3))], (row[(e["pid"], e["tid"])] - 0.4, 0.8),
                       facecolors=colour, edgecolor="none", label=None if name in seen else name)
        seen.add(name)
    ax.set_yticks(range(len(keys)), [labels[k] for k in keys], fontsize="small")
    ax.set_ylim(len(keys) - 0.5, -0.5)
    ax.set_xlabel("milliseconds from the step's start")
    step = trace.get("otherData", {}).get("step")
    ax.set_title(f"Busy intervals per role and rank, step {step}" if step is not None else "Busy intervals")
    ax.grid(True, axis="x", alpha=0.3)
    if seen:
        ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return save(figure, path)

