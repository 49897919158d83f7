"""The Engine (live) tab's cost to the browser with a GPU-sized pool, measured in Chromium.

A tiny random model (so 50,000 KV blocks fit in memory) serves a load test while the tab's 1 s
timer redraws the block map. Chromium reports its long tasks (main-thread work over 50 ms)
through a PerformanceObserver; the JSON gives the longest and the fraction of wall time they
took. Before playground/tabs/plot_stream.py, gr.Plot re-mounted its Plotly div on every value:
230-450 ms tasks a second, ~25 % of wall time (AMD EPYC, 2 cores); with redraws in place
(Plotly.react) ~80-250 ms, ~5-17 % depending on what else the machine runs.

Also reported: whether the map's plot element survived every redraw (in place: the same DOM
node, a marker set on it after the first draw is still there) and whether its title moved on.
tests/test_browser_live.py asserts those two facts; the timings are only printed here, since a
2-core CI machine's scheduling decides them as much as our code does.

Needs the dev extra (playwright) and Debian's chromium: `make browser`.
Run: python -m benchmarks.ui_live [--measure-s 12] [--num-kv-blocks 50000] [--json out.json]
"""

from __future__ import annotations

import argparse
import re
import socket
import time
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip

LONG_TASKS_JS = """
window.__longTasks = [];
new PerformanceObserver((list) => {
  for (const e of list.getEntries()) window.__longTasks.push([e.startTime, e.duration]);
}).observe({type: "longtask", buffered: true});
"""
MAP_PLOT = "#block-map .js-plotly-plot"
# A marker on the mounted plot element: a remount (a new element) loses it, Plotly.react keeps it.
MARK_JS = f"() => {{ document.querySelector('{MAP_PLOT}').dataset.probe = 'kept'; }}"
MARK_KEPT_JS = f"() => document.querySelector('{MAP_PLOT}')?.dataset.probe === 'kept'"
RUNNING = re.compile(r"running \**[1-9]")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_running(page, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not RUNNING.search(page.locator("#live-summary").inner_text()):
        if time.monotonic() > deadline:
            raise TimeoutError("the load test never showed running requests on the Engine tab")
        time.sleep(0.25)


def measure_live_tab(num_kv_blocks: int = 50_000, measure_s: float = 12.0) -> dict:
    """Serve a load test on a `num_kv_blocks` pool, watch the Engine (live) tab for
    `measure_s` seconds; returns the long tasks and the in-place facts (see the docstring)."""
    from playwright import sync_api

    from engine import EngineConfig
    from engine.serving.service import EngineService
    from playground.app import build_app, launch
    from playground.handlers.loadtest import BackgroundRun, spec_from_form
    from playground.loadgen import EngineTarget

    config = EngineConfig(model="random:tiny", dtype="float32", num_kv_blocks=num_kv_blocks,
                          max_model_len=2048, max_num_seqs=64, enable_prefix_caching=True)  # fmt: skip
    service = EngineService(config)
    demo = build_app(service)
    port = _free_port()
    launch(demo, port=port, block=False)
    # 48 long requests at once: the pool fills and the map changes every tick for minutes.
    form = {"num_prompts": 48, "arrival": "all at once", "input_kind": "fixed", "input_mean": 200,
            "output_kind": "fixed", "output_mean": 1800, "ignore_eos": True}  # fmt: skip
    spec = spec_from_form(form, service.max_model_len)
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(60_000)
            page.add_init_script(LONG_TASKS_JS)
            page.goto(f"http://127.0.0.1:{port}/")
            page.wait_for_selector("#chat-input textarea")
            page.get_by_role("tab", name="Engine (live)", exact=True).click()
            run = BackgroundRun(spec, EngineTarget(service)).start()
            try:
                _wait_running(page, 60)
                time.sleep(2.0)  # past the first full draw
                page.wait_for_selector(MAP_PLOT)
                page.evaluate(MARK_JS)
                title = page.locator("#block-map .gtitle")
                first_title = title.text_content()
                start_ms = page.evaluate("performance.now()")
                time.sleep(measure_s)
                end_ms = page.evaluate("performance.now()")
                time.sleep(1.0)  # entries are delivered after the task: let the last ones arrive
                # Only tasks that started inside the window (the first load's come late).
                entries = page.evaluate("window.__longTasks")
                tasks_ms = [d for t, d in entries if start_ms <= t < end_ms]
                summary = page.locator("#live-summary").inner_text()
                last_title = title.text_content()
                plot_kept = page.evaluate(MARK_KEPT_JS)
            finally:
                run.stop()
                browser.close()
    finally:
        demo.close()
        service.shutdown()
    wall_ms = end_ms - start_ms
    return {
        "num_kv_blocks": num_kv_blocks,
        "measured_ms": round(wall_ms),
        "long_tasks": len(tasks_ms),
        "longest_task_ms": round(max(tasks_ms, default=0.0)),
        "long_task_fraction_of_wall": round(sum(tasks_ms) / wall_ms, 3),
        "long_tasks_ms": [round(t) for t in tasks_ms],
        "map_plot_redrawn_in_place": bool(plot_kept),
        "first_map_title": first_title,
        "last_map_title": last_title,
        "summary_at_end": summary,
    }


def main() -> None:
    from benchmarks.common import emit
    from engine.telemetry.ceilings import device_name

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-kv-blocks", type=int, default=50_000)
    p.add_argument("--measure-s", type=float, default=12.0)
    p.add_argument("--json", type=Path, help="also write the JSON here")
    args = p.parse_args()
    report = measure_live_tab(args.num_kv_blocks, args.measure_s)
    report["machine"] = device_name("cpu")
    emit(report, args.json)


if __name__ == "__main__":
    main()
