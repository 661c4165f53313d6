"""The written report: every table exported to CSV and Markdown with the rows the page shows, and the values stored."""
import csv
import statistics

import pytest

from cpumoe.bench.results import ResultsDB
from cpumoe.report.export import markdown_table
from cpumoe.report.tables import Column, Table, format_cell
from cpumoe.report.cases import Stat

from .conftest import EXPECTED_FIGURES, EXPECTED_ROWS, SKELETON, STUDY_ROWS, layer_case


def read_csv(path):
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_every_table_is_exported_with_its_rows(study_report, study_db):
    out, written = study_report
    with ResultsDB(study_db) as db:
        assert len(db.rows()) == STUDY_ROWS
    assert written.rows == STUDY_ROWS and written.tables == len(EXPECTED_ROWS)
    assert written.figures == len(EXPECTED_FIGURES)
    assert {p.stem for p in (out / "csv").glob("*.csv")} == set(EXPECTED_ROWS)
    for name, count in EXPECTED_ROWS.items():
        assert len(read_csv(out / "csv" / f"{name}.csv")) == count, name
    assert {p.stem for p in (out / "figures").glob("*.png")} == EXPECTED_FIGURES


def test_csv_holds_the_stored_values_with_their_range(study_report, study_db):
    out, _ = study_report
    key = layer_case(SKELETON, 32, "naive")
    with ResultsDB(study_db) as db:
        times = [r.metrics["time_ms"] for r in db.rows("layer") if r.case == key]
        bandwidths = [r.bandwidth_gbs for r in db.rows("layer") if r.case == key]
    (row,) = [r for r in read_csv(out / "csv" / "layer-all.csv")
              if r["tokens"] == "32" and r["impl"] == "naive" and r["inter"] == "14336" and r["experts"] == "8"
              and r["top_k"] == "2" and r["hidden"] == "4096"]
    assert row["runs"] == "3" and row["status"] == "ok" and row["machine"] == "M1"
    assert float(row["time_ms"]) == pytest.approx(statistics.median(times))
    assert float(row["time_ms_lo"]) == pytest.approx(min(times))
    assert float(row["time_ms_hi"]) == pytest.approx(max(times))
    assert float(row["bandwidth_gbs_lo"]) == pytest.approx(min(bandwidths))
    oom = [r for r in read_csv(out / "csv" / "layer-experts.csv") if r["experts"] == "64"]
    assert len(oom) == 8 and all(r["status"].startswith("oom: needs 22.5 GiB") and r["time_ms"] == "" for r in oom)


def test_speedup_csv_is_naive_over_fused(study_report):
    out, _ = study_report
    for row in read_csv(out / "csv" / "layer-speedup.csv"):
        assert float(row["speedup"]) == pytest.approx(float(row["naive_ms"]) / float(row["fused_ms"]))
        assert float(row["speedup_lo"]) <= float(row["speedup"]) <= float(row["speedup_hi"])


def test_serve_and_prune_csv_keep_the_contract_keys(study_report):
    out, _ = study_report
    serve = read_csv(out / "csv" / "serve-all.csv")
    assert [r["request_rate"] for r in serve if r["label"] == "cpumoe" and not r["max_concurrency"]] == [
        "1", "2", "4", "8", "inf"]
    along = read_csv(out / "csv" / "serve-max_concurrency.csv")
    assert [r["max_concurrency"] for r in along] == ["1", "4", "16", ""]
    assert {r["request_rate"] for r in along} == {"inf"}
    assert {"median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "p99_itl_ms", "request_goodput"} <= set(serve[0])
    prune = read_csv(out / "csv" / "prune-all.csv")
    assert [(r["method"], r["ratio"]) for r in prune][:3] == [("none", "0.0"), ("inter", "0.125"), ("inter", "0.25")]
    assert {r["method"] for r in prune} == {"none", "inter", "intra"}


def test_experts_tables_name_decoder_layers(study_report):
    out, _ = study_report
    rows = read_csv(out / "csv" / "experts-1.csv")
    assert [r["layer"] for r in rows] == ["1", "2", "3", "4"]
    assert [r["never_chosen"] for r in rows] == ["3", "1", "0", "2"] and rows[0]["entropy_norm"] == "0.93"


def test_markdown_holds_every_table_with_its_rows(study_report):
    out, _ = study_report
    text = (out / "tables.md").read_text()
    blocks = text.split("\n### ")[1:]
    tables = [b for b in blocks if "\n| " in b]
    assert len(tables) == len(EXPECTED_ROWS)
    for block in tables:
        lines = [ln for ln in block.splitlines() if ln.startswith("|")]
        assert len(lines) - 2 in EXPECTED_ROWS.values(), block.splitlines()[0]
    assert "| M2 |" in text and "oom: needs 22.5 GiB" in text


def test_cells_show_median_and_range_and_markdown_escapes_pipes():
    assert format_cell(Stat(median=12.345, lo=11.0, hi=13.5, n=3)) == "12.3 (11.0–13.5)"
    assert format_cell(Stat(median=0.5, lo=0.5, hi=0.5, n=2)) == "0.5"
    assert format_cell(None) == "–" and format_cell(1234.5) == "1234" and format_cell(7) == "7"
    table = Table(name="t", title="t", columns=[Column("a", "a|b")], rows=[["x|y"]])
    assert markdown_table(table) == "| a\\|b |\n|---|\n| x\\|y |"
