"""``report.html``: the header table of each run, then every figure, with the series each
figure drew embedded as JSON (``<script type="application/json" id="report-data">``), so a
tool or a test reads the numbers without parsing pixels. One self-contained page beside its
PNGs: it opens from a cluster's file system with nothing else.
"""

from __future__ import annotations

import html
import json
import math
from dataclasses import asdict
from datetime import datetime, timezone

from report.figures import Figure
from report.phases import Comparison
from report.runs import Run

STYLE = """
body { font-family: sans-serif; margin: 1.5em; color: #222; max-width: 1100px; }
table { border-collapse: collapse; margin-bottom: 1em; }
td, th { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; font-size: 0.9em; }
th { background: #f3f3f3; }
figure { margin: 1.2em 0; }
img { max-width: 100%; border: 1px solid #eee; }
.note { color: #777; font-size: 0.85em; }
"""


def page(runs: list[Run], headers: list[list[tuple[str, str]]], figures: list[Figure],
         phases: list[Comparison]) -> str:
    names = ", ".join(run.name for run in runs)
    parts = [f"<!doctype html>\n<html><head><meta charset='utf-8'><title>{html.escape(names)}</title>",
             f"<style>{STYLE}</style></head><body>", f"<h1>{html.escape(names)}</h1>",
             f"<p class='note'>written {datetime.now(timezone.utc).isoformat(timespec='seconds')} by "
             f"<code>python -m report</code></p>"]
    for run, head in zip(runs, headers):
        parts.append(f"<h2>{html.escape(run.name)} <span class='note'>{html.escape(str(run.path))}</span></h2>")
        parts.append("<table>" + "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
                                         for k, v in head) + "</table>")
    parts += phase_section(phases)
    parts += figure_sections(figures)
    data = {f.name: f.data for f in figures if f.data}
    parts.append(data_script({**data, **({"phase_comparison": [asdict(c) for c in phases]} if phases else {})}))
    parts.append("</body></html>\n")
    return "\n".join(parts)


def phase_section(phases: list[Comparison]) -> list[str]:
    """Each phase's short-context numbers before and after it (report.phases), a table each."""
    if not phases:
        return []
    parts = ["<section id='phase_comparison'><h2>phase comparison: the short context before and after each phase "
             "(Llama 3 moves on once it has recovered)</h2>"]
    for c in phases:
        before = f"{c.parent}, step {c.before_step:,}" if c.before_step is not None else f"{c.parent}: no eval"
        after = f"{c.run}, step {c.after_step:,}" if c.after_step is not None else f"{c.run}: no eval"
        parts.append(f"<h3>{html.escape(c.run)} after {html.escape(c.parent)} (short context: {c.length:,})</h3>")
        parts.append(f"<table><tr><th>metric</th><th>before ({html.escape(before)})</th>"
                     f"<th>after ({html.escape(after)})</th><th>recovered</th></tr>")
        parts += [f"<tr><td>{html.escape(r['metric'])}</td><td>{_number(r['before'])}</td>"
                  f"<td>{_number(r['after'])}</td><td>{_yes_no(r['recovered'])}</td></tr>" for r in c.rows]
        parts.append("</table>")
        if c.note:
            parts.append(f"<p class='note'>{html.escape(c.note)}</p>")
    parts.append("</section>")
    return parts


def _number(value: float | None) -> str:
    return "—" if value is None else f"{value:.4f}"


def _yes_no(recovered: bool | None) -> str:
    return "—" if recovered is None else ("yes" if recovered else "no")


def html_table(fields: list[str], rows: list[dict]) -> str:
    """An HTML table of ``rows`` by ``fields``: floats to 6 significant digits, None empty."""
    def cell(value) -> str:
        if value is None:
            return ""
        return f"{value:.6g}" if isinstance(value, float) and math.isfinite(value) else str(value)

    return "<table><tr>" + "".join(f"<th>{f}</th>" for f in fields) + "</tr>" + "".join(
        "<tr>" + "".join(f"<td>{html.escape(cell(r[f]))}</td>" for f in fields) + "</tr>" for r in rows) + "</table>"


def figure_sections(figures: list[Figure]) -> list[str]:
    """A section per figure: its title, its PNG (when it drew anything) and its note."""
    parts = []
    for f in figures:
        parts.append(f"<section id='{f.name}'><h2>{html.escape(f.title)}</h2>")
        if f.data:
            parts.append(f"<figure><img src='{f.name}.png' alt='{html.escape(f.title)}'></figure>")
        if f.note:
            parts.append(f"<p class='note'>{html.escape(f.note)}</p>")
        parts.append("</section>")
    return parts


def data_script(data: dict) -> str:
    """The numbers the page shows, as the JSON a tool or test reads (``id="report-data"``)."""
    blob = json.dumps(_finite(data), allow_nan=False).replace("</", "<\\/")  # safe inside <script>
    return f"<script type='application/json' id='report-data'>{blob}</script>"


def _finite(value):
    """Plain JSON (a browser's JSON.parse takes no NaN): non-finite numbers become null."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value


def embedded_data(text: str) -> dict:
    """The series embedded in a report.html (for tools and tests)."""
    start = text.index(">", text.index("id='report-data'")) + 1
    return json.loads(text[start:text.index("</script>", start)].replace("<\\/", "</"))
