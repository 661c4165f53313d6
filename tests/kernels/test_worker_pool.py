"""The kernels' worker pool (csrc/core/worker_pool.h): helpers join a run only if they are free in time and the
caller never waits for one that has not started, so every item must still be computed, once, whichever threads
took part: runs back to back (helpers still finishing the last one), more workers than cores (helpers often late),
calls from several threads at once (one runs alone), a forked child (whose helpers did not survive the fork)."""
import multiprocessing
import threading

import pytest
import torch

from cpumoe import ops
from tests.kernels.moe_cases import backend_dtype_grid

BACKEND, DTYPE = next(p.values for p in backend_dtype_grid() if p.values[0] != "naive")


def _case(M: int = 5, N: int = 200, K: int = 96):
    g = torch.Generator().manual_seed(M * 31 + N)
    x = torch.randn(M, K, generator=g).to(DTYPE)
    packed = ops.pack_linear((torch.randn(N, K, generator=g) / K**0.5).to(DTYPE), BACKEND)
    return x, packed, N


def _linear(x, packed, n):
    return ops.linear(x, packed, None, backend=BACKEND, out_features=n)


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _alone(x, packed, n, threads):
    threads(1)
    try:
        return _linear(x, packed, n)
    finally:
        threads(2)


@pytest.mark.parametrize("workers", [2, 4, 8], ids=lambda w: f"{w}workers")
def test_runs_back_to_back_compute_every_item(threads, workers):
    """Rows do not depend on the thread that computes them, so every run equals the single-threaded one exactly."""
    x, packed, n = _case()
    expected = _alone(x, packed, n, threads)
    threads(workers)
    for i in range(2000):
        out = _linear(x, packed, n)
        assert torch.equal(out, expected), f"run {i} with {workers} workers differs"


def test_calls_from_several_threads_at_once(threads):
    x, packed, n = _case(M=9)
    expected = _alone(x, packed, n, threads)
    wrong: list[int] = []

    def calls() -> None:
        for i in range(300):
            if not torch.equal(_linear(x, packed, n), expected):
                wrong.append(i)
    pool = [threading.Thread(target=calls) for _ in range(4)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(120)
    assert not any(t.is_alive() for t in pool), "a call never returned"
    assert not wrong, f"{len(wrong)} calls differ"


def _child(x, packed, n, queue) -> None:
    queue.put(_linear(x, packed, n).float().tolist())   # plain values: a tensor would be shared by a descriptor


def test_a_forked_child_runs_kernels(threads):
    x, packed, n = _case(M=17)
    expected = _linear(x, packed, n)            # the parent's pool is made and its helpers are running
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child, args=(x, packed, n, queue))
    child.start()
    out = queue.get(timeout=60)
    child.join(60)
    assert child.exitcode == 0 and out == expected.float().tolist()
