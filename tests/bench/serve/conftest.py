"""Fixtures of the load generator's tests: a real (synthetic, byte-level BPE) tokenizer, and a fake server."""
import pytest

from tests.bench.serve.fake_server import FakeServer
from tests.server.serving import running_server


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    from cpumoe.synthetic.tokenizer import make_tokenizer

    out = tmp_path_factory.mktemp("serve_tokenizer")
    make_tokenizer(out, 1000)
    return out


@pytest.fixture
def fake():
    """A FakeServer (configure its fields before requests arrive) and its base URL."""
    server = FakeServer()
    with running_server(server.app()) as url:
        yield server, url
