"""The report as one static HTML page: inline CSS, PNGs referred to relatively, no script, nothing fetched.

    header (source, rows, when) -> contents -> one <section> per Report section: text, then each block's
    figure and the tables under it (median over runs, with the lowest–highest run in brackets)
"""
from __future__ import annotations

import html
import re
import time

from cpumoe import __version__
from cpumoe.report.build import Report
from cpumoe.report.cases import Stat
from cpumoe.report.tables import Table, format_cell

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1200px;
       padding: 0 1em; color: #222; line-height: 1.4; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ccc; margin-top: 2em; } h3 { margin-top: 1.5em; }
nav ul { columns: 2; } figure { margin: 1em 0; } img { border: 1px solid #ddd; max-width: 100%; height: auto; }
figcaption, .note { color: #555; font-size: 0.9em; }
.table-wrap { overflow-x: auto; margin: 0.5em 0 1.5em; }
table { border-collapse: collapse; font-size: 0.8em; }
caption { text-align: left; font-weight: 600; padding: 0.3em 0; }
th, td { border: 1px solid #ddd; padding: 0.2em 0.5em; white-space: nowrap; }
th { background: #f3f3f3; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
tbody tr:nth-child(even) { background: #fafafa; } td.oom, td.error { color: #b00; }
code { background: #f3f3f3; padding: 0 0.2em; }
"""


def render_page(report: Report, title: str = "cpumoe benchmark report") -> str:
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    parts = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
             f"<title>{_e(title)}</title>", f"<style>{CSS}</style>", "</head>", "<body>", f"<h1>{_e(title)}</h1>",
             f'<p class="note">{report.rows} rows from <code>{_e(report.source)}</code>, drawn {when} by cpumoe '
             f"{_e(__version__)}. Cells measured more than once show the median and, in brackets, the lowest and "
             "highest run.</p>"]
    if not report.sections:
        parts.append(f'<p id="no-results">There are no results in <code>{_e(report.source)}</code> yet: run a '
                     "benchmark (<code>cpumoe bench layer</code>, <code>cpumoe bench sweep</code>, ...) to write "
                     "some.</p>")
    else:
        parts.append("<nav><h2>Contents</h2><ul>")
        parts += [f'<li><a href="#{s.id}">{_e(s.title)}</a></li>' for s in report.sections]
        parts.append("</ul></nav>")
    for section in report.sections:
        parts.append(f'<section id="{section.id}"><h2>{_e(section.title)}</h2>')
        if section.text:
            parts.append(f"<p>{_text(section.text)}</p>")
        for block in section.blocks:
            parts.append(f"<h3>{_e(block.title)}</h3>")
            if block.text:
                parts.append(f'<p class="note">{_text(block.text)}</p>')
            if block.figure is not None:
                parts.append(f'<figure><img src="{_e(block.figure.file)}" alt="{_e(block.figure.alt)}" width="800" '
                             f'height="500"><figcaption>{_e(block.figure.alt)}</figcaption></figure>')
            parts += [render_table(t) for t in block.tables]
        parts.append("</section>")
    parts += ["</body>", "</html>"]
    return "\n".join(parts) + "\n"


def render_table(table: Table) -> str:
    head = "".join(f"<th>{_e(c.label)}</th>" for c in table.columns)
    body = []
    for row in table.rows:
        cells = []
        for value in row:
            cls = "num" if isinstance(value, (int, float, Stat)) and not isinstance(value, bool) else ""
            if isinstance(value, str) and value.split(":")[0] in ("oom", "error"):
                cls = value.split(":")[0]
            attribute = f' class="{cls}"' if cls else ""
            cells.append(f"<td{attribute}>{_e(format_cell(value))}</td>")
        body.append(f"<tr>{''.join(cells)}</tr>")
    return (f'<div class="table-wrap"><table id="table-{table.name}"><caption>{_e(table.title)} '
            f'<span class="note">({len(table.rows)} rows; <a href="csv/{table.name}.csv">CSV</a>)</span></caption>'
            f"<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table></div>")


def _text(text: str) -> str:
    """Escaped prose, with `code` spans as <code>."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", _e(text))


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)
