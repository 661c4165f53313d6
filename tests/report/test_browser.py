"""The page in a real headless browser (Debian's chromium through playwright): every image loads, every table has
its rows, nothing is fetched from the network and the console stays clean."""
import shutil

import pytest

from .conftest import EXPECTED_FIGURES, EXPECTED_ROWS

CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium on PATH (apt-get install chromium)")


@pytest.mark.slow
def test_page_in_chromium(study_report):
    sync_playwright = pytest.importorskip("playwright.sync_api", reason="needs playwright").sync_playwright
    out, _ = study_report
    errors, requests = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("requestfailed", lambda r: errors.append(f"failed: {r.url}"))
            page.on("request", lambda r: requests.append(r.url))
            page.goto((out / "index.html").resolve().as_uri())
            page.wait_for_load_state("load")
            images = page.eval_on_selector_all(
                "img", "els => els.map(e => [e.getAttribute('src'), e.complete, e.naturalWidth, e.naturalHeight])")
            tables = page.eval_on_selector_all(
                "table", "els => els.map(t => [t.id, t.querySelectorAll('tbody tr').length])")
            headings = page.eval_on_selector_all("section h2", "els => els.map(e => e.textContent)")
        finally:
            browser.close()

    assert {src.removeprefix("figures/").removesuffix(".png") for src, *_ in images} == EXPECTED_FIGURES
    for src, complete, width, height in images:
        assert complete and (width, height) == (800, 500), f"{src} did not load ({width}x{height})"
    assert {name.removeprefix("table-"): rows for name, rows in tables} == EXPECTED_ROWS
    assert all(rows > 0 for _, rows in tables)
    assert headings[:6] == ["Machine", "MoE layer (kernel level)", "Model (offline engine)", "Serving under load",
                            "Expert routing", "Pruning"]
    assert not errors, errors
    assert all(url.startswith("file://") for url in requests), [u for u in requests if not u.startswith("file://")]
