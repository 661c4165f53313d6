"""The report's tables as files: every table in one Markdown file, and each as csv/<name>.csv.

Markdown shows cells as the page does (median, lowest–highest run in brackets). CSV keeps the numbers as stored:
a column measured over runs becomes three, <key> (the median), <key>_lo and <key>_hi; a missing value is empty.
"""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from cpumoe.report.build import Report
from cpumoe.report.cases import Stat
from cpumoe.report.tables import Table, format_cell


def write_markdown(report: Report, path: Path) -> None:
    lines = ["# cpumoe benchmark report", "", f"{report.rows} rows from `{report.source}`.", ""]
    if not report.sections:
        lines.append(f"There are no results in `{report.source}` yet.")
    for section in report.sections:
        lines += [f"## {section.title}", ""]
        if section.text:
            lines += [section.text, ""]
        for block in section.blocks:
            if not block.tables and block.text:
                lines += [f"### {block.title}", "", block.text, ""]
            for table in block.tables:
                lines += [f"### {table.title}", "", markdown_table(table), ""]
    path.write_text("\n".join(lines))


def markdown_table(table: Table) -> str:
    header = "| " + " | ".join(_md(c.label) for c in table.columns) + " |"
    rule = "|" + "|".join("---" for _ in table.columns) + "|"
    rows = ["| " + " | ".join(_md(format_cell(v)) for v in row) + " |" for row in table.rows]
    return "\n".join([header, rule, *rows])


def write_csv(table: Table, path: Path) -> None:
    header: list[str] = []
    for column in table.columns:
        header += [column.key, f"{column.key}_lo", f"{column.key}_hi"] if column.stat else [column.key]
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        for row in table.rows:
            cells: list[Any] = []
            for column, value in zip(table.columns, row):
                if column.stat:
                    cells += ([value.value(v) for v in (value.median, value.lo, value.hi)] if isinstance(value, Stat)
                              else ["", "", ""])
                else:
                    cells.append("" if value is None else value)
            writer.writerow(cells)


def write_exports(report: Report, out_dir: Path) -> list[Path]:
    """tables.md and csv/<table>.csv under out_dir; returns the files written."""
    csv_dir = out_dir / "csv"
    csv_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "tables.md"]
    write_markdown(report, written[0])
    for table in report.tables():
        path = csv_dir / f"{table.name}.csv"
        write_csv(table, path)
        written.append(path)
    return written


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
