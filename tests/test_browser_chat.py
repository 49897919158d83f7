"""Chat in a real browser (Debian's Chromium through Playwright, as tests/test_browser.py):
typing during a stream keeps the draft; Send during a stream is visibly refused; Clear and the
chatbot's trash icon reset the kept conversation and stop the reply; numeric fields are
refused visibly, never rounded. Needs /usr/bin/chromium; never downloads a browser."""

from __future__ import annotations

import re
import time

import pytest
import test_browser as tb
from test_browser import open_tab, set_number, wait_text

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:'future.no_silent_downcasting'"),
    pytest.mark.filterwarnings("ignore:The copy keyword is deprecated"),
]
expect = pytest.importorskip("playwright.sync_api").expect
app_url, page = tb.app_url, tb.page  # the app with the embedded model, one Chromium page

DRAFT = "my next question, typed while the reply streams"


def _start_long_reply(page, prompt: str) -> None:
    set_number(page, "tab-chat", "number input for Max new tokens", 600)
    page.fill("#chat-input textarea", prompt)
    page.click("#chat-send")
    wait_text(page, "#chatbot", r"streaming · [1-9]\d* tokens", 60)


def _tokens_streamed(page) -> int:
    return int(re.search(r"streaming · (\d+) tokens", page.locator("#chatbot").inner_text())[1])


def _engine_idle(page) -> None:
    """The Engine tab says nothing runs any more: the reply really stopped."""
    open_tab(page, "Engine (live)")
    wait_text(page, "#live-summary", r"running \*?\*?0\b", 20)
    open_tab(page, "Chat")


def test_draft_stays_send_is_refused_and_clear_stops_the_reply(page):
    _start_long_reply(page, "Write a very long story about a lighthouse keeper.")
    box = page.locator("#chat-input textarea")
    box.fill(DRAFT)
    # Several streaming updates later the draft is still there.
    first = _tokens_streamed(page)
    deadline = time.monotonic() + 30
    while _tokens_streamed(page) < first + 10 and time.monotonic() < deadline:
        time.sleep(0.3)
    assert _tokens_streamed(page) >= first + 10
    expect(box).to_have_value(DRAFT)

    # Send is off, and says why; Enter is refused with a visible reason; the draft stays.
    send = page.locator("#chat-send")
    expect(send).to_be_disabled()
    expect(send).to_contain_text("Streaming")
    box.press("Enter")
    wait_text(page, "#chat-status", r"Not sent.*still streaming", 10)
    expect(box).to_have_value(DRAFT)
    shown = page.locator("#chatbot").inner_text()  # not sent: one user turn, no draft
    assert shown.count("Write a very long story") == 1 and DRAFT not in shown

    # Clear during the stream: the display and the kept turns go, the reply stops.
    page.click("#chat-clear")
    wait_text(page, "#chat-status", r"Cleared; the streaming reply was stopped", 10)
    time.sleep(2.0)  # a reply that kept streaming would redraw the old conversation here
    assert "lighthouse" not in page.locator("#chatbot").inner_text()
    expect(send).to_be_enabled()
    _engine_idle(page)

    # The next message starts a new conversation: only it and its reply are shown.
    set_number(page, "tab-chat", "number input for Max new tokens", 8)
    box.fill("Say hi.")
    page.click("#chat-send")
    wait_text(page, "#chatbot", r"TTFT \d+ ms", 60)
    assert "lighthouse" not in page.locator("#chatbot").inner_text()
    assert page.locator("#chatbot").inner_text().count("Say hi.") == 1


def test_trash_icon_resets_the_conversation_and_stops_the_reply(page):
    _start_long_reply(page, "Write a very long poem about the sea.")
    page.locator("#chatbot").get_by_role("button", name=re.compile("clear", re.I)).click()
    time.sleep(2.0)
    assert "the sea" not in page.locator("#chatbot").inner_text()
    expect(page.locator("#chat-send")).to_be_enabled()
    _engine_idle(page)
    set_number(page, "tab-chat", "number input for Max new tokens", 8)
    page.fill("#chat-input textarea", "Say hello.")
    page.click("#chat-send")
    wait_text(page, "#chatbot", r"TTFT \d+ ms", 60)
    assert "the sea" not in page.locator("#chatbot").inner_text()


def test_numeric_fields_are_refused_visibly_not_rounded(page):
    page.locator("#chat-clear").click()
    for elem_id, value, field in (("chat-top-k", 2.5, "top_k"), ("chat-top-k", 0, "top_k"),
                                  ("chat-seed", -5, "seed")):  # fmt: skip
        box = page.locator(f"#{elem_id} input")
        box.fill(str(value))
        box.press("Tab")  # Gradio reads numbers on blur; the check runs then
        wait_text(page, "#chat-status", rf"Fix before sending: {field}", 10)
        expect(box).to_have_value(str(value))  # never silently rounded
        page.fill("#chat-input textarea", "hello")
        page.click("#chat-send")
        wait_text(page, "#chat-status", rf"Not sent: {field}", 10)
        expect(page.locator("#chat-input textarea")).to_have_value("hello")
        box.fill("-1")
        box.press("Tab")
        wait_text(page, "#chat-status", r"^\s*$", 10)


def test_n_replies_show_side_by_side(page):
    """The n control: three replies to one message, laid out in three columns (the chatbot
    keeps the classes theme.css styles)."""
    page.locator("#chat-clear").click()
    set_number(page, "tab-chat", "number input for Replies (n, side by side)", 3)
    set_number(page, "tab-chat", "number input for Max new tokens", 8)
    page.fill("#chat-input textarea", "Name a color.")
    page.click("#chat-send")
    wait_text(page, "#chatbot", r"TTFT \d+ ms", 60)
    columns = page.locator("#chatbot .pg-replies .pg-reply")
    expect(columns).to_have_count(3)
    boxes = [columns.nth(i).bounding_box() for i in range(3)]
    assert boxes[0]["x"] < boxes[1]["x"] < boxes[2]["x"], boxes  # side by side
    assert abs(boxes[0]["y"] - boxes[2]["y"]) < 2, boxes  # on one row
    expect(columns.nth(0)).to_contain_text("Reply 1 (continues)")
    # Copying the message gives the three replies as text (playground/plain_copy.js).
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    page.locator("#chatbot button[aria-label*='opy' i]").last.click()
    copied = page.evaluate("navigator.clipboard.readText()")
    assert copied.startswith("Reply 1 (continues)\n") and "\n\nReply 3\n" in copied, copied
    assert "<" not in copied and "TTFT" not in copied, copied
    set_number(page, "tab-chat", "number input for Replies (n, side by side)", 1)
