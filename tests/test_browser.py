"""The playground in a real browser: Debian's Chromium driven by Playwright against the app
launched in-process with the embedded model. Takes a screenshot of each tab: into
assets/screenshots/<tab>.png (the README's) only with UPDATE_SCREENSHOTS=1 (`make screenshots`),
else into a temporary folder, so `make test` leaves the tracked PNGs alone.

Needs /usr/bin/chromium (`apt-get install chromium`); never downloads a browser.
"""

from __future__ import annotations

import os
import re
import socket
import time
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.browser,
    pytest.mark.filterwarnings("ignore:'future.no_silent_downcasting'"),
    pytest.mark.filterwarnings("ignore:The copy keyword is deprecated"),
]

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip
SCREENSHOTS = Path(__file__).resolve().parent.parent / "assets" / "screenshots"
UPDATE_SCREENSHOTS = os.environ.get("UPDATE_SCREENSHOTS") == "1"
NUM_KV_BLOCKS = 256

if not os.path.exists(CHROMIUM):
    pytest.skip(
        f"{CHROMIUM} is missing: install Debian's Chromium with `sudo apt-get install chromium` "
        "to run the browser tests (never `playwright install`)",
        allow_module_level=True,
    )
sync_api = pytest.importorskip("playwright.sync_api")
expect = sync_api.expect


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app_url():
    from engine import EngineConfig
    from engine.serving.service import EngineService
    from playground.app import build_app, launch

    service = EngineService(
        EngineConfig(
            model="smollm2-135m",
            dtype="bfloat16",
            num_kv_blocks=NUM_KV_BLOCKS,
            max_model_len=1024,
            enable_prefix_caching=True,  # as `make run` starts it
        )
    )
    demo = build_app(service)
    port = _free_port()
    launch(demo, port=port, block=False)
    yield f"http://127.0.0.1:{port}/"
    demo.close()
    service.shutdown()


@pytest.fixture(scope="module")
def page(app_url):
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        pg = browser.new_page(viewport={"width": 1400, "height": 1000})
        pg.set_default_timeout(60_000)
        pg.goto(app_url)
        pg.wait_for_selector("#chat-input textarea")
        yield pg
        browser.close()


def open_tab(page, name: str) -> None:
    page.get_by_role("tab", name=name, exact=True).click()


@pytest.fixture(scope="module")
def shot(tmp_path_factory):
    """shot(page, name) saves a full-page screenshot. Taken on every run (a page that cannot
    render fails here too); the tracked ones are overwritten only when asked."""
    folder = SCREENSHOTS if UPDATE_SCREENSHOTS else tmp_path_factory.mktemp("screenshots")
    folder.mkdir(parents=True, exist_ok=True)

    def save(page, name: str) -> None:
        path = folder / f"{name}.png"
        page.screenshot(path=str(path), full_page=True)
        assert path.stat().st_size > 0, path

    return save


def set_number(page, tab_id: str, label: str, value: object, nth: int = 0) -> None:
    box = page.locator(f"#{tab_id} input[aria-label='{label}']").nth(nth)
    box.fill(str(value))
    box.press("Tab")  # commit the value (Gradio reads numbers on blur)


def wait_text(page, selector: str, pattern: str, timeout_s: float = 60) -> str:
    """Waits until the element's text matches the regex; returns the text."""
    regex = re.compile(pattern)
    deadline = time.monotonic() + timeout_s
    text = ""
    while time.monotonic() < deadline:
        text = page.locator(selector).first.inner_text()
        if regex.search(text):
            return text
        time.sleep(0.2)
    raise AssertionError(f"{selector}: no /{pattern}/ within {timeout_s} s; last text: {text!r}")


def used_blocks(summary: str) -> int:
    return int(re.search(r"KV blocks used: (\d+) /", summary).group(1))


def test_chat_streams_and_the_block_map_follows_the_request(page, shot):
    set_number(page, "tab-chat", "number input for Max new tokens", 64)
    page.fill("#chat-input textarea", "Tell me a short story about a cat.")
    page.click("#chat-send")
    wait_text(page, "#chatbot", r"streaming · \d+ tokens", 30)
    shot(page, "chat_streaming")

    # While the reply streams its request owns blocks on the map; after it they are free.
    open_tab(page, "Engine (live)")
    summary = wait_text(page, "#live-summary", r"KV blocks used: [1-9]\d* /", 20)
    request_id = re.search(r"req-\d+", page.locator("#live-queue").inner_text()).group(0)
    legend = page.locator("#block-map .legendtext", has_text=request_id)
    expect(legend).to_have_count(1, timeout=10_000)
    assert used_blocks(summary) > 0
    wait_text(page, "#live-summary", r"KV blocks used: 0 /", 60)
    expect(legend).to_have_count(0, timeout=10_000)

    open_tab(page, "Chat")
    reply = wait_text(page, "#chatbot", r"TTFT \d+ ms[^·]* · TPOT \d+ ms", 10)
    assert re.search(r"\d+ tokens", reply)

    # The second turn's prompt starts with the first turn: prefix caching finds those blocks.
    set_number(page, "tab-chat", "number input for Max new tokens", 1000)
    page.fill("#chat-input textarea", "Now write a very long poem.")
    page.click("#chat-send")
    wait_text(page, "#chatbot", r"streaming · [1-9]\d* tokens", 30)
    open_tab(page, "Engine (live)")
    wait_text(page, "#live-summary", r"prefix cache: [1-9][\d,]* of [\d,]+ prompt tokens hit", 20)
    shot(page, "engine")

    # Stop aborts a long reply at once.
    open_tab(page, "Chat")
    page.click("#chat-stop")
    wait_text(page, "#chat-status", r"Stopped req-\d+", 10)
    wait_text(page, "#chatbot", r"tokens · stopped", 10)
    shot(page, "chat")


def test_chat_token_probabilities_render_as_shaded_spans_with_hover_text(page, shot):
    """The token view survives the chatbot's HTML sanitizer: one span per token with its
    shading (style) and its hover text (title)."""
    page.locator("#chat-clear").click()
    set_number(page, "tab-chat", "number input for Max new tokens", 48)
    page.locator("#chat-token-probs input").check()
    page.fill("#chat-input textarea", "Why is the sky blue?")
    page.click("#chat-send")
    wait_text(page, "#chatbot", r"perplexity \d", 60)
    spans = page.locator("#chatbot .pg-tokens .pg-tok")
    expect(spans).to_have_count(48)
    assert "rgba(" in (spans.first.get_attribute("style") or "")
    assert re.search(r"p \d\.\d{3} \(logprob", spans.first.get_attribute("title") or "")
    shot(page, "chat_token_probs")
    # A message's copy button copies its text, not the view's HTML or the stats line's markup
    # (playground/plain_copy.js).
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    reply = page.locator("#chatbot .pg-tokens").first
    expected = reply.evaluate("d => [...d.querySelectorAll('.pg-tok')].map(s => s.textContent)"
                              ".join('').replaceAll('↵', '\\n')")  # fmt: skip
    page.locator("#chatbot button[aria-label*='opy' i]").last.click()
    copied = page.evaluate("navigator.clipboard.readText()")
    assert copied == expected and "<" not in copied and "TTFT" not in copied, copied
    page.locator("#chat-token-probs input").uncheck()
    page.locator("#chat-clear").click()


def test_load_test_shows_a_results_table(page, shot):
    open_tab(page, "Load test")
    set_number(page, "tab-loadtest", "Requests", 8)
    page.locator("#tab-loadtest").get_by_label("all at once").check()
    set_number(page, "tab-loadtest", "max", 16, nth=1)  # output tokens
    page.click("#loadtest-run")
    wait_text(page, "#loadtest-status", r"Done in", 120)
    table = page.locator("#loadtest-results").inner_text()
    assert re.search(r"Successful requests\s+8", table)
    throughput = re.search(r"Output token throughput \(tok/s\)\s+([\d.]+)", table).group(1)
    assert float(throughput) > 0
    assert float(re.search(r"Mean TTFT \(ms\)\s+([\d.]+)", table).group(1)) > 0
    assert "8 / 8 requests done" in page.locator("#loadtest-progress").inner_text()
    shot(page, "load_test")


def test_compare_static_vs_continuous(page, shot):
    open_tab(page, "Compare")  # the default preset and workload: 16 short requests per side
    page.click("#compare-run")
    wait_text(page, "#compare-status", r"Done\.", 150)
    table = page.locator("#compare-results").inner_text()
    assert re.search(r"Successful requests\s+16\s+16", table)
    assert "batching=static" in page.locator("#compare-status").inner_text()
    for side in ("a", "b"):
        owners = page.locator(f"#compare-map-{side} .legendtext", has_text="req-")
        expect(owners.first).to_be_visible(timeout=10_000)
    expect(page.get_by_role("button", name="Download results (JSON)")).to_be_visible()
    shot(page, "compare")


def test_roofline_latency_and_kv_calculator(page, shot):
    open_tab(page, "Roofline")
    wait_text(page, "#roofline-caption", r"decode steps \(median", 90)
    legend = page.locator("#roofline-plot .legendtext", has_text="decode steps")
    expect(legend).to_have_count(1, timeout=10_000)
    assert page.locator("#roofline-plot .scatterlayer .point").count() > 10
    shot(page, "roofline")

    open_tab(page, "Latency")
    wait_text(page, "#latency-summary", r"finished requests", 20)
    shot(page, "latency")

    open_tab(page, "KV calculator")
    wait_text(page, "#kv-formula", r"17,179,869,184", 20)
    page.locator("#tab-kv").get_by_role("combobox", name="Model").click()
    page.get_by_role("option", name="the loaded model").click()
    wait_text(page, "#kv-engine", r"which matches the allocation", 20)
    # Llama-3-8B's 4,096-token context moved down to the embedded model's max_model_len.
    context = page.locator("#tab-kv").get_by_label("Context length (tokens per request)")
    expect(context).to_have_value("1024", timeout=10_000)
    wait_text(page, "#kv-formula", r"smollm2-135m \(loaded\)", 20)
    expect(page.locator("#kv-formula")).not_to_contain_text("Check the form")
    shot(page, "kv_calculator")
