"""The run report's HTML page: a summary table, then one section per plot, the step timeline,
the tables of the model's responses (`xray.report.samples`) and the run's config. Plain HTML with relative links to the PNG and JSON files beside it, so the
report folder opens from disk, anywhere it is copied.
"""
from __future__ import annotations

from dataclasses import dataclass
from html import escape

STYLE = """body{font-family:system-ui,sans-serif;max-width:1060px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse}td,th{padding:2px 12px 2px 0;text-align:left}
img{max-width:100%;border:1px solid #ddd}p.about{color:#555;margin-top:.2em}
pre{background:#f6f6f6;padding:.8em;overflow:auto;font-size:85%}
table.samples td{vertical-align:top;border-top:1px solid #ddd}
pre.sample{white-space:pre-wrap;margin:0;padding:.2em;max-width:420px}"""


@dataclass(frozen=True)
class Section:
    """One plot on the page."""

    anchor: str
    title: str
    image: str
    """The PNG's file name, beside the page."""
    about: str = ""
    link: tuple[str, str] | None = None
    """(file name, text) of a file to link under the plot (the timeline's trace)."""


def render(title: str, summary: list[tuple[str, str]], sections: list[Section], config_text: str | None,
           samples: str | None = None) -> str:
    """The whole page as a string; `samples`: the responses' section, already HTML (escaped)."""
    parts = [f"<!doctype html>\n<html><head><meta charset='utf-8'><title>{escape(title)}</title>",
             f"<style>{STYLE}</style></head><body>", f"<h1>{escape(title)}</h1>", "<table>"]
    parts += [f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>" for k, v in summary]
    parts.append("</table>")
    if sections:
        parts.append("<p>" + " · ".join(f"<a href='#{s.anchor}'>{escape(s.title)}</a>" for s in sections) + "</p>")
    for s in sections:
        parts += [f"<h2 id='{s.anchor}'>{escape(s.title)}</h2>",
                  f"<img src='{escape(s.image)}' alt='{escape(s.title)}'>"]
        if s.about:
            parts.append(f"<p class='about'>{escape(s.about)}</p>")
        if s.link:
            parts.append(f"<p><a href='{escape(s.link[0])}'>{escape(s.link[1])}</a></p>")
    if not sections:
        parts.append("<p>The run logged no metrics yet: nothing to plot.</p>")
    if samples is not None:
        parts.append(samples)
    if config_text is not None:
        parts += ["<h2 id='config'>Config</h2>", f"<details><summary>config.yaml</summary><pre>{escape(config_text)}"
                  "</pre></details>"]
    parts.append("</body></html>\n")
    return "\n".join(parts)
