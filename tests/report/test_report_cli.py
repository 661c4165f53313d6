"""`cpumoe report`: the page, the exports, a chosen skeleton, and clear errors for bad input."""
import csv

import pytest

from cpumoe.bench.results import ResultsDB
from cpumoe.cli import main

from .conftest import STUDY_ROWS


def test_report_writes_page_figures_and_exports(study_db, tmp_path, capsys):
    out = tmp_path / "page"
    (out / "figures").mkdir(parents=True)
    (out / "figures" / "stale.png").write_bytes(b"old")    # left from an earlier report: removed
    assert main(["report", "--db", str(study_db), "--out", str(out), "--skeleton", "4096,1792,8,2"]) == 0
    assert f"{STUDY_ROWS} rows, " in capsys.readouterr().out
    assert not (out / "figures" / "stale.png").exists()
    page = (out / "index.html").read_text()
    assert "Skeleton H=4096 I=1792 E=8 k=2 (given with --skeleton)" in page
    assert "No rows vary experts around the skeleton." in page        # nothing was swept around I=1792
    assert (out / "figures" / "layer-inter.png").exists() and not (out / "figures" / "layer-experts.png").exists()
    assert (out / "tables.md").exists() and (out / "csv" / "layer-all.csv").exists()
    assert "<script" not in page and "http://" not in page.replace("http://127.0.0.1:8000", "")


def test_missing_database_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["report", "--db", str(tmp_path / "nope.db"), "--out", str(tmp_path / "out")])
    assert str(exit_info.value).startswith("cpumoe report: error: no results database at")
    assert not (tmp_path / "nope.db").exists() and not (tmp_path / "out").exists()


def test_a_file_that_is_not_a_database_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"not sqlite at all " * 200)
    with pytest.raises(SystemExit) as exit_info:
        main(["report", "--db", str(bad), "--out", str(tmp_path / "out")])
    assert "cpumoe report: error:" in str(exit_info.value) and "not a usable results database" in str(exit_info.value)


def test_bad_skeleton_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["report", "--db", str(tmp_path / "x.db"), "--skeleton", "4096,8"])
    assert "four positive integers H,I,E,k" in capsys.readouterr().err


def test_empty_database_gives_a_page_that_says_so(tmp_path, capsys):
    db_path = tmp_path / "empty.db"
    ResultsDB(db_path).close()
    out = tmp_path / "out"
    assert main(["report", "--db", str(db_path), "--out", str(out)]) == 0
    page = (out / "index.html").read_text()
    assert 'id="no-results"' in page and "There are no results in" in page
    assert "no results" in (out / "tables.md").read_text()
    assert not list((out / "figures").glob("*.png"))


def test_plain_layer_runs_get_a_figure_per_shape_and_other_benches_say_they_have_no_rows(tmp_path):
    from .conftest import layer_metrics

    db_path = tmp_path / "layer.db"
    with ResultsDB(db_path) as db:
        for preset, shape in (("qwen3-30b-a3b", dict(hidden=2048, inter=768, experts=128, top_k=8)),
                              ("olmoe-1b-7b", dict(hidden=2048, inter=1024, experts=64, top_k=8))):
            for tokens in (1, 8):
                db.add("layer", dict(preset=preset, **shape, format="bf16", backend="avx512_bf16", impl="fused",
                                     tokens=tokens, threads=2), layer_metrics(shape, tokens, "fused", 1.0),
                       bandwidth_gbs=40.0, mm_gflops=900.0)
    out = tmp_path / "out"
    assert main(["report", "--db", str(db_path), "--out", str(out)]) == 0
    page = (out / "index.html").read_text()
    assert sorted(p.name for p in (out / "figures").glob("*.png")) == ["layer-tokens-1.png", "layer-tokens-2.png"]
    assert page.count("No rows vary") == 4
    for bench in ("model", "serve", "experts", "prune"):
        section = page.split(f'<section id="{bench}">')[1].split("</section>")[0]
        assert "No rows for this bench in the database" in section and "<img" not in section


def test_an_older_database_whose_layer_rows_say_path_still_renders(tmp_path):
    from .conftest import layer_metrics

    db_path = tmp_path / "old.db"
    shape = dict(hidden=2048, inter=768, experts=128, top_k=8)
    with ResultsDB(db_path) as db:
        for tokens in (1, 8):
            for impl, backend in (("fused", "x86-avx512bf16"), ("naive", "naive")):
                db.add("layer", dict(preset="qwen3-30b-a3b", **shape, format="bf16", path=backend, impl=impl,
                                     tokens=tokens, threads=2), layer_metrics(shape, tokens, impl, 1.0),
                       bandwidth_gbs=40.0, mm_gflops=900.0)
    out = tmp_path / "out"
    assert main(["report", "--db", str(db_path), "--out", str(out)]) == 0
    assert (out / "figures" / "layer-tokens-1.png").exists()
    with (out / "csv" / "layer-all.csv").open(newline="") as f:
        assert {r["backend"] for r in csv.DictReader(f)} == {"x86-avx512bf16", "naive"}
    with (out / "csv" / "layer-speedup.csv").open(newline="") as f:   # fused and naive pair up despite the old key
        assert [(r["tokens"], r["backend"]) for r in csv.DictReader(f)] == [("1", "x86-avx512bf16"),
                                                                           ("8", "x86-avx512bf16")]


def test_rows_that_lack_contract_fields_still_give_a_page(tmp_path):
    """The other benches are written against the row contracts; a row that misses fields shows blanks, not a crash."""
    db_path = tmp_path / "odd.db"
    with ResultsDB(db_path) as db:
        db.add("layer", {"preset": "x", "tokens": 1}, {"time_ms": 1.0})
        db.add("layer", {"preset": "x", "hidden": 64, "inter": 32, "experts": 4, "top_k": 2}, {"time_ms": 2.0})
        db.add("layer", {"preset": "x", "hidden": 64, "inter": 64, "experts": 4, "top_k": 2, "tokens": 1}, {})
        db.add("model", {"model": "m", "batch": 1}, {"ttft_ms": 5.0})
        db.add("model", {"model": "m", "batch": 2}, {"ttft_ms": None, "throughput_tok_s": 3.0})
        db.add("serve", {"label": "a", "request_rate": float("inf")}, {"median_ttft_ms": 1.0})
        db.add("serve", {"label": "a", "request_rate": 2.0}, {"median_ttft_ms": 2.0})
        db.add("experts", {"model": "m", "prompts": "random", "tokens": 8}, {"cv": [0.5]})
        db.add("prune", {"model": "m", "method": "inter", "ratio": 0.5}, {"perplexity": 9.0})
        db.add("prune", {"model": "m", "method": "inter", "ratio": 0.25}, {}, status="error")
    out = tmp_path / "out"
    assert main(["report", "--db", str(db_path), "--out", str(out)]) == 0
    page = (out / "index.html").read_text()
    assert page.count("<table") >= 6 and "error" in page
    assert (out / "figures" / "serve-request_rate.png").exists()
    assert not (out / "figures" / "prune-tradeoff.png").exists()    # perplexity without a speed-up: no point to draw
