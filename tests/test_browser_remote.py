"""Remote mode in a real browser (Debian's Chromium through Playwright, as
tests/test_browser.py): the playground over our own OpenAI server on 127.0.0.1 runs a load test,
and the Load test tab's "Running and waiting requests" panel, which has no data remotely, shows
its whole explanation inside the panel (a Plotly annotation does not wrap: it clipped before)."""

from __future__ import annotations

import pytest
import test_browser as tb
from test_browser import CHROMIUM, CHROMIUM_ARGS, open_tab, wait_text

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:'future.no_silent_downcasting'"),
    pytest.mark.filterwarnings("ignore:The copy keyword is deprecated"),
]
sync_api = pytest.importorskip("playwright.sync_api")


@pytest.fixture(scope="module")
def remote_app_url():
    from engine import EngineConfig
    from engine.serving.http_server import BackgroundServer
    from engine.serving.server import create_app
    from engine.serving.service import EngineService
    from playground.app import build_app, launch
    from playground.remote.client import RemoteServer

    service = EngineService(
        EngineConfig(model="random:tiny", dtype="float32", num_kv_blocks=256, max_model_len=512)
    )
    server = BackgroundServer(create_app(service), port=0).start()
    demo = build_app(remote=RemoteServer.connect(server.url))
    port = tb._free_port()
    launch(demo, port=port, block=False)
    yield f"http://127.0.0.1:{port}/"
    demo.close()
    server.stop()
    service.shutdown()


def test_remote_load_test_panel_text_stays_inside_its_panel(remote_app_url):
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(60_000)
            page.goto(remote_app_url)
            page.wait_for_selector("#chat-input textarea")
            open_tab(page, "Load test")
            page.get_by_role("button", name="Run load test").first.click()
            wait_text(page, "#loadtest-progress", r"(\d+) / \1 requests done", 120)
            panel = page.locator("#loadtest-queue .js-plotly-plot").bounding_box()
            lines = page.locator("#loadtest-queue .annotation-text tspan")
            assert "does not expose" in page.locator("#loadtest-queue").inner_text()
            boxes = [lines.nth(i).bounding_box() for i in range(lines.count())]
        finally:
            browser.close()
    assert boxes, "no annotation lines drawn"
    for box in boxes:
        assert box["x"] >= panel["x"] and box["x"] + box["width"] <= panel["x"] + panel["width"]
