"""Benchmarks run by tests append their rows to a database of the session's own, never to one in the checkout."""
import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def _results_db(tmp_path_factory):
    os.environ["CPUMOE_RESULTS_DB"] = str(tmp_path_factory.mktemp("results") / "cpumoe-results.db")
    yield
