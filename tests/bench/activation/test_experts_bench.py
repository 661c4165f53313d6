"""`cpumoe bench experts` on a model whose routing is forced (tests/bench/activation/forced.py): exact counts,
imbalance and distinct experts; the heatmap PNG; the CLI's results row; bad input."""
import json
import struct

import pytest
import torch

from cpumoe.bench.activation.heatmap import draw_heatmap
from cpumoe.bench.activation.run import experts_report
from cpumoe.bench.activation.tokens import TokenSet
from cpumoe.bench.results import ResultsDB
from cpumoe.cli import main
from cpumoe.models import load_model
from cpumoe.models.routing_trace import RoutingTrace
from tests.bench.activation.forced import E, MINUS, PLUS, forced_checkpoint, plus

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def forced(tmp_path_factory):
    return forced_checkpoint(tmp_path_factory.mktemp("forced") / "ckpt")


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def test_forced_counts_and_imbalance(forced):
    sequences = [[1, 40, 2, 50, 3, 33, 31, 63], [5, 6, 7, 8], [60, 61]]  # 9 plus and 5 minus tokens
    report = experts_report(load_model(forced), TokenSet("test", sequences), name="forced", batches=[1, 2, 14, 15])
    n_plus = sum(plus(t) for s in sequences for t in s)
    n_minus = report.tokens - n_plus
    assert report.tokens == 14 and report.layers == [0, 1] and report.num_experts == E and report.top_k == 2
    for i, layer in enumerate(report.layers):
        expected = [n_plus if e in PLUS[layer] else n_minus if e in MINUS[layer] else 0 for e in range(E)]
        assert report.counts[i] == expected, f"layer {layer}"
    im = report.imbalance
    mean = 2 * 14 / E
    assert im.max_over_mean == pytest.approx([n_plus / mean] * 2)
    assert im.never_chosen == [4, 4]
    p = [n_plus / 28] * 2 + [n_minus / 28] * 2
    assert im.entropy == pytest.approx([-sum(q * torch.tensor(q).log2().item() for q in p)] * 2)
    # one token: its 2 experts; all 14: both pairs of the layer; 15 is more than were routed
    assert report.distinct_batches == [1, 2, 14]
    assert report.distinct_measured[0] == 2.0 and report.distinct_measured[2] == 4.0
    assert 2.0 <= report.distinct_measured[1] <= 4.0
    assert report.distinct_uniform[0] == pytest.approx(2.0)
    row = report.metrics
    assert set(row) >= {"counts", "max_over_mean", "cv", "entropy", "never_chosen", "distinct_batches",
                        "distinct_measured", "distinct_uniform"}
    assert report.case == {"model": "forced", "prompts": "test", "tokens": 14}


def test_routing_trace_is_off_outside_with(forced):
    model = load_model(forced)
    ids = torch.tensor([1, 40, 2])
    trace = RoutingTrace(model)
    model(ids)  # before: nothing recorded, no hooks
    assert trace.tokens == 0 and all(not m._forward_hooks for m in trace._modules)
    with trace:
        out = model(ids)
    assert trace.tokens == 3 and all(not m._forward_hooks for m in trace._modules)
    torch.testing.assert_close(out, model(ids), rtol=0, atol=0, msg="tracing changed the logits")
    assert trace.topk_ids(0).tolist()[1] in ([6, 7], [7, 6])


@pytest.mark.parametrize("layers,experts", [(4, 8), (64, 128)], ids=["4x8", "64x128"])
def test_heatmap_png(tmp_path, layers, experts):
    counts = torch.randint(0, 100, (layers, experts))
    out = draw_heatmap(counts, list(range(layers)), tmp_path / "sub" / "h.png", title="test")
    width, height = png_size(out)
    assert out.stat().st_size > 5_000 and width >= 600 and height >= 300


def test_cli_prompts_file(tmp_path, capsys):
    from cpumoe.synthetic.checkpoint import make_checkpoint, tiny_overrides
    path = make_checkpoint("qwen3-30b-a3b", tmp_path / "q3", layers=2, vocab=400, dtype=torch.float32,
                           overrides=tiny_overrides("qwen3-30b-a3b"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the quick brown fox jumps over the lazy dog\n\nhello world, one more prompt\n")
    db, png, js = tmp_path / "r.db", tmp_path / "h.png", tmp_path / "r.json"
    assert main(["bench", "experts", str(path), "--prompts", str(prompts), "--batch-sizes", "1,4,1000",
                 "--out", str(png), "--db", str(db), "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert "load imbalance" in out and "skipped" in out and "heatmap" in out
    png_size(png)
    rows = ResultsDB(db).rows("experts")
    assert len(rows) == 1 and rows[0].case["prompts"] == "prompts.txt" and rows[0].case["model"] == "q3"
    m = rows[0].metrics
    assert len(m["counts"]) == 2 and len(m["counts"][0]) == 4
    assert all(sum(c) == 2 * rows[0].case["tokens"] for c in m["counts"])
    assert m["distinct_batches"] == [1, 4] and json.loads(js.read_text())["metrics"]["cv"] == m["cv"]


def test_cli_bad_input(tmp_path, forced):
    with pytest.raises(SystemExit, match="cpumoe bench experts: error: .*does not exist"):
        main(["bench", "experts", str(tmp_path / "nope"), "--no-db"])
    with pytest.raises(SystemExit, match="prompt file .* does not exist"):
        main(["bench", "experts", str(forced), "--prompts", str(tmp_path / "none.txt"), "--no-db"])
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    with pytest.raises(SystemExit, match="no non-empty line"):
        main(["bench", "experts", str(forced), "--prompts", str(empty), "--no-db"])
    text = tmp_path / "t.txt"
    text.write_text("hello\n")
    with pytest.raises(SystemExit, match="has no tokenizer"):
        main(["bench", "experts", str(forced), "--prompts", str(text), "--no-db"])
    with pytest.raises(SystemExit):
        main(["bench", "experts", str(forced), "--batch-sizes", "0,2"])
