"""Read a results database and write the whole report: index.html, figures/*.png, tables.md, csv/*.csv.

Figures and CSV files left from an earlier report in the same directory are removed first, so the directory
holds exactly what the page refers to.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cpumoe.bench.results import ResultsDB
from cpumoe.report.build import FIGURES_DIR, build_report
from cpumoe.report.cases import Skeleton
from cpumoe.report.export import write_exports
from cpumoe.report.page import render_page


@dataclass(frozen=True, slots=True)
class Written:
    index: Path
    rows: int
    figures: int
    tables: int


def write_report(db_path: Path, out_dir: Path, skeleton: Skeleton | None = None,
                 title: str = "cpumoe benchmark report") -> Written:
    with ResultsDB(db_path, read_only=True) as db:
        rows = db.rows()
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*(out_dir / FIGURES_DIR).glob("*.png"), *(out_dir / "csv").glob("*.csv")]:
        stale.unlink()
    report = build_report(rows, out_dir, source=str(db_path), skeleton=skeleton)
    index = out_dir / "index.html"
    index.write_text(render_page(report, title=title))
    write_exports(report, out_dir)
    return Written(index=index, rows=report.rows, figures=len(report.figures()), tables=len(report.tables()))
