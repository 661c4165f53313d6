"""The metrics as a pure function of recorded timestamps (exact values), the arrival schedule, and SSE parsing."""
import numpy as np
import pytest

from cpumoe.bench.serve.client import RequestOutput, _token_text, arrival_offsets
from cpumoe.bench.serve.metrics import compute_metrics, meets_slos, summary, tpot


def _out(start, times, n, prompt_len=10, success=True, error=""):
    return RequestOutput(prompt_len=prompt_len, asked_output_len=n, success=success, error=error, start=start,
                         token_times=list(times), output_tokens=n if success else None)


def _runs():
    return [_out(100.0, [100.5, 100.6, 100.8, 101.1], 4),    # ttft 0.5, e2el 1.1, tpot 0.2, itl .1 .2 .3
            _out(200.0, [200.2, 200.3], 2),                  # ttft 0.2, e2el 0.3, tpot 0.1, itl .1
            _out(300.0, [], 4, success=False, error="HTTP 500: boom")]


def test_metrics_from_timestamps_are_exact():
    m = compute_metrics(_runs(), duration=10.0)
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (2, 1, 20, 6)
    assert m["request_throughput"] == pytest.approx(0.2) and m["output_throughput"] == pytest.approx(0.6)
    assert m["total_token_throughput"] == pytest.approx(2.6) and m["request_goodput"] is None
    expect = {
        "ttft": (350, 350, 150, 470, 497),                    # [500, 200] ms
        "tpot": (150, 150, 50, 190, 199),                     # [200, 100]
        "itl": (175, 150, np.std([100, 200, 300, 100]), 270, 297),   # [100, 200, 300, 100]
        "e2el": (700, 700, 400, 1020, 1092),                  # [1100, 300]
    }
    for name, (mean, median, std, p90, p99) in expect.items():
        got = [m[f"{s}_{name}_ms"] for s in ("mean", "median", "std", "p90", "p99")]
        assert got == pytest.approx([mean, median, std, p90, p99]), name


@pytest.mark.parametrize("slos,good", [({"ttft": 300}, 1), ({"tpot": 150}, 1), ({"ttft": 600, "tpot": 250}, 2),
                                       ({"e2el": 1000}, 1), ({"ttft": 100}, 0), ({"ttft": 500, "e2el": 1100}, 2)])
def test_goodput_counts_requests_meeting_every_slo(slos, good):
    assert compute_metrics(_runs(), duration=10.0, goodput=slos)["request_goodput"] == pytest.approx(good / 10)


def test_one_token_request_has_no_tpot_and_meets_a_tpot_slo():
    one = _out(0.0, [0.3], 1)
    assert tpot(one) is None and meets_slos(one, {"tpot": 1.0})
    m = compute_metrics([one], duration=1.0)
    assert m["mean_tpot_ms"] is None and m["mean_itl_ms"] is None and m["mean_ttft_ms"] == pytest.approx(300)


def test_summary_of_nothing_is_none_and_duration_must_be_positive():
    assert set(summary("x", []).values()) == {None}
    with pytest.raises(ValueError, match="duration"):
        compute_metrics(_runs(), duration=0.0)


def test_all_failed_run_has_zero_throughput():
    m = compute_metrics([_out(0.0, [], 3, success=False, error="x")], duration=2.0)
    assert (m["completed"], m["failed"], m["request_throughput"], m["mean_ttft_ms"]) == (0, 1, 0.0, None)


@pytest.mark.parametrize("rate", [0.5, 4.0, 100.0])
@pytest.mark.parametrize("burstiness", [1.0, 0.5, 3.0])
def test_arrivals_have_mean_gap_one_over_rate_and_gamma_spread(rate, burstiness):
    offsets = arrival_offsets(4001, rate, burstiness, seed=1)
    gaps = np.diff(offsets)                                   # [4000]
    assert offsets[0] == 0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.05)
    # gamma of shape k: coefficient of variation 1/sqrt(k) (1 for Poisson arrivals)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.1)


def test_arrivals_are_seeded_and_inf_sends_all_at_once():
    assert np.array_equal(arrival_offsets(50, 2.0, 1.0, seed=3), arrival_offsets(50, 2.0, 1.0, seed=3))
    assert not np.array_equal(arrival_offsets(50, 2.0, 1.0, seed=3), arrival_offsets(50, 2.0, 1.0, seed=4))
    assert np.array_equal(arrival_offsets(5, float("inf"), 1.0, seed=0), np.zeros(5))


@pytest.mark.parametrize("event, chat, expected", [
    ({"choices": [{"text": " a", "finish_reason": None}]}, False, " a"),
    ({"choices": [{"text": "", "finish_reason": None}]}, False, ""),           # a step inside a character: timed
    ({"choices": [{"text": "", "finish_reason": "length"}]}, False, None),    # a bare finish: not a token
    ({"choices": [{"text": " z", "finish_reason": "length"}]}, False, " z"),
    ({"choices": [], "usage": {"completion_tokens": 3}}, False, None),
    ({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, True, None),   # the role-only first event
    ({"choices": [{"delta": {"content": ""}, "finish_reason": None}]}, True, ""),
    ({"choices": [{"delta": {}, "finish_reason": "stop"}]}, True, None),
    ({"choices": [{"delta": {"content": "b"}, "finish_reason": None}]}, True, "b"),
])
def test_which_events_are_token_chunks(event, chat, expected):
    assert _token_text(event, chat) == expected
