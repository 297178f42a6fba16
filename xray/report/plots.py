"""Drawing the run report's metric panels (`xray.report.panels`) as PNG files, with matplotlib.

Figures are built with matplotlib's object API on its Agg canvas (no pyplot, no display, no
global backend switch), so a run can write its report from inside its own process.
"""
from __future__ import annotations

from pathlib import Path

from xray.report.panels import Panel, series

SIZE_IN = (8.0, 3.6)
"""Figure size in inches; at `DPI`, 800 x 360 pixels."""
DPI = 100


def new_figure(size_in: tuple[float, float] = SIZE_IN):
    """A matplotlib Figure on the Agg canvas."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=size_in, dpi=DPI)
    FigureCanvasAgg(figure)
    return figure


def save(figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=DPI, format="png")
    return path


def draw_panel(panel: Panel, keys: list[str], rows: list[dict], evals: dict[str, float], path: Path) -> Path:
    """Draw `panel`'s metrics `keys` over the steps of `rows` into the PNG `path`."""
    from matplotlib.ticker import MaxNLocator

    figure = new_figure()
    ax = figure.add_subplot()
    if panel.kind == "band":
        _band(ax, rows, keys[0], panel.spread)
    elif panel.kind == "stacked":
        _stacked(ax, rows, keys)
    elif panel.kind == "eval":
        _eval(ax, rows, evals)
    else:
        for key in keys:
            steps, values = series(rows, key)
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=key)
    ax.set_title(panel.title)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel(panel.ylabel)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small", loc="best")
    return save(figure, path)


def _band(ax, rows: list[dict], key: str, spread: str | None) -> None:
    steps, values = series(rows, key)
    ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=key)
    if spread:
        by_step = dict(zip(*series(rows, spread)))
        width = [by_step.get(s, 0.0) for s in steps]
        ax.fill_between(steps, [v - w for v, w in zip(values, width)], [v + w for v, w in zip(values, width)],
                        alpha=0.25, label=f"+-{spread}")


def _stacked(ax, rows: list[dict], keys: list[str]) -> None:
    steps = sorted({s for key in keys for s in series(rows, key)[0]})
    bottom = [0.0] * len(steps)
    for key in keys:
        by_step = dict(zip(*series(rows, key)))
        heights = [by_step.get(s, 0.0) for s in steps]
        ax.bar(steps, heights, bottom=bottom, width=0.8, label=key.removeprefix("time/").removesuffix("_s"))
        bottom = [b + h for b, h in zip(bottom, heights)]


def _eval(ax, rows: list[dict], evals: dict[str, float]) -> None:
    """One line through the evaluations: before training (step 0), every `trainer.eval_every`
    steps (`eval`), and after training (the last step); the first and last marked apart."""
    last = evals.get("step", max([int(r["step"]) for r in rows], default=0))
    ends = [(f"{label} training: {evals[key]:.3f}", step, evals[key], marker, colour)
            for label, key, step, marker, colour in (("before", "eval_before", 0, "s", "C2"),
                                                     ("after", "eval_after", last, "D", "C3")) if key in evals]
    points = sorted(list(zip(*series(rows, "eval"))) + [(step, value) for _, step, value, _, _ in ends])
    ax.plot([s for s, _ in points], [v for _, v in points], marker="o", markersize=4, color="C0",
            label="eval" if series(rows, "eval")[0] else None)
    for label, step, value, marker, colour in ends:
        ax.plot([step], [value], marker=marker, markersize=8, linestyle="none", color=colour, label=label)
