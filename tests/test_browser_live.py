"""The Engine (live) tab's cost to the browser with a GPU-sized pool: 50,000 KV blocks (a tiny
random model, so the pool fits in memory), a load test running, the 1 s timer redrawing the
block map. Chromium's long tasks (main-thread work over 50 ms) are recorded through a
PerformanceObserver and must stay bounded: none over 200 ms, under 20 % of wall time. The
timer's redraws go through Plotly.react in place (playground/tabs/plot_stream.py); gr.Plot's
remount on every value cost 230-450 ms tasks a second here (25 % of wall time, 2 cores)."""

from __future__ import annotations

import re
import time

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

NUM_KV_BLOCKS = 50_000
MEASURE_S = 12.0
MAX_LONG_TASK_MS = 200.0
MAX_BUSY_FRACTION = 0.20

LONG_TASKS = """
window.__longTasks = [];
new PerformanceObserver((list) => {
  for (const e of list.getEntries()) window.__longTasks.push([e.startTime, e.duration]);
}).observe({type: "longtask", buffered: true});
"""


@pytest.fixture(scope="module")
def big_pool_app():
    from engine import EngineConfig
    from engine.serving.service import EngineService
    from playground.app import build_app, launch

    service = EngineService(
        EngineConfig(
            model="random:tiny",
            dtype="float32",
            num_kv_blocks=NUM_KV_BLOCKS,
            max_model_len=2048,
            max_num_seqs=64,
            enable_prefix_caching=True,
        )
    )
    demo = build_app(service)
    port = tb._free_port()
    launch(demo, port=port, block=False)
    yield service, f"http://127.0.0.1:{port}/"
    demo.close()
    service.shutdown()


def test_live_tab_stays_responsive_with_a_50k_block_pool_under_load(big_pool_app):
    from playground.handlers.loadtest import BackgroundRun, spec_from_form
    from playground.loadgen import EngineTarget

    service, url = big_pool_app
    spec = spec_from_form({"num_prompts": 48, "arrival": "all at once", "input_kind": "fixed",
                           "input_mean": 200, "output_kind": "fixed", "output_mean": 1800,
                           "ignore_eos": True}, service.max_model_len)  # fmt: skip
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(60_000)
        page.add_init_script(LONG_TASKS)
        page.goto(url)
        page.wait_for_selector("#chat-input textarea")
        open_tab(page, "Engine (live)")
        run = BackgroundRun(spec, EngineTarget(service)).start()
        try:
            wait_text(page, "#live-summary", r"running \**[1-9]", 60)
            time.sleep(2.0)  # past the first full draw
            title = page.locator("#block-map .gtitle")
            first_title = title.text_content()
            start_ms = page.evaluate("performance.now()")
            time.sleep(MEASURE_S)
            end_ms = page.evaluate("performance.now()")
            time.sleep(1.0)  # entries are delivered after the task: let the last ones arrive
            wall_ms = end_ms - start_ms
            # Only tasks that started inside the window (the first load's are reported late).
            entries = page.evaluate("window.__longTasks")
            tasks = [d for t, d in entries if start_ms <= t < end_ms]
            summary = page.locator("#live-summary").inner_text()
            last_title = title.text_content()
        finally:
            run.stop()
            browser.close()
    assert re.search(r"running \*?\*?[1-9]", summary), summary  # still under load at the end
    assert f"/ {NUM_KV_BLOCKS}" in summary
    # The timer's redraws land in place (plot_stream.py): the map moved on while measured.
    assert f"/ {NUM_KV_BLOCKS} blocks held" in last_title and last_title != first_title
    busy_ms = sum(tasks)
    print(f"long tasks: {len(tasks)}, longest {max(tasks, default=0):.0f} ms, "
          f"{busy_ms:.0f} ms of {wall_ms:.0f} ms")  # fmt: skip
    assert max(tasks, default=0.0) < MAX_LONG_TASK_MS, tasks
    assert busy_ms < MAX_BUSY_FRACTION * wall_ms, tasks
