"""Compare, Load test and KV calculator in a real browser (Debian's Chromium through
Playwright, as tests/test_browser.py, whose app and page fixtures this reuses): switching
presets resets the form (the KV preset sets side B to int8; n and prompt sharing included; the
LM-head preset sets the weight toggles);
Stop in the Load test reports the aborted requests; the KV memory fraction typed + Enter never
raises. Needs /usr/bin/chromium; never downloads a browser."""

from __future__ import annotations

import re

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

PREFIX = "prefix caching off vs on (shared prompt prefix)"
STATIC = "static vs continuous batching"
SHARING = "n=4 with vs without prompt sharing"


def _number(page, tab_id: str, label: str, nth: int = 0):
    return page.locator(f"#{tab_id} input[aria-label='{label}']").nth(nth)


def _weight_format(page, label: str) -> list:
    """The weight-format radio `label` of side A and of side B."""
    return [page.locator(f"#compare-{s}-weights").get_by_label(label, exact=True) for s in "ab"]


def _pick(page, tab_id: str, combobox: str, option: str) -> None:
    page.locator(f"#{tab_id}").get_by_role("combobox", name=combobox).click()
    page.get_by_role("option", name=option, exact=True).click()


def _pick_toggle_preset(page, preset: str, formats: list, toggle, headline: str) -> None:
    """Pick a Compare preset that sets one weight format on both sides and a toggle on B only:
    both `formats` radios checked, `toggle` off on A and on on B, the headline row named."""
    _pick(page, "tab-compare", "Preset", preset)
    for radio in formats:
        expect(radio).to_be_checked()
    expect(toggle.nth(0)).not_to_be_checked()
    expect(toggle.nth(1)).to_be_checked()
    expect(page.locator("#compare-headline")).to_contain_text(headline)


def test_switching_presets_sets_every_field_and_resets_the_others(page):
    open_tab(page, "Compare")
    prefix = _number(page, "tab-compare", "Shared prefix (tokens)")
    requests = _number(page, "tab-compare", "Requests")
    expect(prefix).to_have_value("0")
    output_max = _number(page, "tab-compare", "max", 1)
    expect(output_max).to_have_value("48")  # the page opens with the default preset's workload
    _pick(page, "tab-compare", "Preset", PREFIX)
    expect(prefix).to_have_value("192")
    expect(page.locator("#compare-headline")).to_contain_text("Prompt tokens computed")
    set_number(page, "tab-compare", "Requests", 99)  # a hand edit, gone with the next preset
    _pick(page, "tab-compare", "Preset", STATIC)
    expect(prefix).to_have_value("0")  # the 192-token prefix does not carry over
    expect(requests).to_have_value("16")
    expect(page.locator("#compare-headline")).to_contain_text("Mean requests per step")
    # The side forms follow: A is static, and both get the preset's 4 slots.
    side_a = page.locator("#tab-compare").get_by_label("static").first
    expect(side_a).to_be_checked()
    expect(_number(page, "tab-compare", "max_num_seqs", 0)).to_have_value("4")
    expect(_number(page, "tab-compare", "max_num_seqs", 1)).to_have_value("4")
    # The parallel-sampling preset sets n and unticks B's prompt sharing; the next resets n.
    _pick(page, "tab-compare", "Preset", SHARING)
    samples = _number(page, "tab-compare", "n (samples per prompt)")
    expect(samples).to_have_value("4")
    sharing = page.locator("#tab-compare").get_by_label("Prompt sharing")
    expect(sharing.nth(0)).to_be_checked()
    expect(sharing.nth(1)).not_to_be_checked()
    expect(page.locator("#compare-headline")).to_contain_text("Peak KV blocks held")
    _pick(page, "tab-compare", "Preset", STATIC)
    expect(samples).to_have_value("1")
    expect(sharing.nth(1)).to_be_checked()
    # Fields the distribution does not use are hidden (uniform lengths: no "mean").
    expect(_number(page, "tab-compare", "tokens (fixed) / mean")).to_be_hidden()


def test_kv_preset_sets_int8_on_side_b_and_the_budget(page):
    """The KV-cache dtype toggle is in both side forms; the preset sets A auto, B int8."""
    open_tab(page, "Compare")
    # The KV dtype radios (the weights radio of each side has an "int8" too).
    a_int8, b_int8 = (page.locator(f"#compare-{s}-kv-dtype").get_by_label("int8", exact=True)
                      for s in ("a", "b"))  # fmt: skip
    expect(a_int8).not_to_be_checked()  # the default preset: both sides "auto"
    expect(b_int8).not_to_be_checked()
    _pick(page, "tab-compare", "Preset", "KV 16-bit vs int8 at the same memory budget")
    expect(a_int8).not_to_be_checked()
    expect(b_int8).to_be_checked()
    expect(page.locator("#compare-headline")).to_contain_text("Most requests running at once")
    budget = "KV budget (tokens at the model dtype; the same bytes on both sides)"
    expect(_number(page, "tab-compare", budget)).to_have_value("1152")


def test_lm_head_preset_sets_the_weight_toggles_of_both_sides(page):
    """The weight format and the LM-head toggle are in both side forms (issue 13): the preset
    sets awq on both, the head 16-bit on A and quantized on B; the next preset resets them."""
    open_tab(page, "Compare")
    awq = _weight_format(page, "awq")
    head = page.locator("#tab-compare").get_by_label("Quantized weights: the LM head too")
    expect(awq[0]).not_to_be_checked()
    expect(head.nth(0)).to_be_checked()  # default: quantized with the rest
    _pick_toggle_preset(page, "AWQ weights: LM head 16-bit vs int4", awq, head, "Mean TPOT")
    _pick(page, "tab-compare", "Preset", STATIC)
    expect(awq[0]).not_to_be_checked()
    expect(head.nth(0)).to_be_checked()


def test_int8_activations_preset_ticks_side_bs_toggle(page):
    """The int8-activations toggle is in both side forms: the W4A8 preset sets int4 on both
    and ticks B's; the next preset unticks it."""
    open_tab(page, "Compare")
    int4 = _weight_format(page, "int4")
    a8 = page.locator("#tab-compare").get_by_label("Quantized weights: int8 activations")
    expect(a8.nth(0)).not_to_be_checked()
    expect(a8.nth(1)).not_to_be_checked()
    preset = "int4 weights: bf16 vs int8 activations (W4A8), 32 requests"
    _pick_toggle_preset(page, preset, int4, a8, "Output token throughput")
    _pick(page, "tab-compare", "Preset", STATIC)
    expect(a8.nth(1)).not_to_be_checked()


def test_stop_in_the_load_test_reports_the_aborted_requests(page):
    open_tab(page, "Load test")
    tab = page.locator("#tab-loadtest")
    set_number(page, "tab-loadtest", "Requests", 24)
    tab.get_by_label("all at once").check()
    set_number(page, "tab-loadtest", "Max concurrent (0 = any)", 1)  # one at a time
    page.click("#loadtest-run")
    wait_text(page, "#loadtest-progress", r"\b[1-9]\d* / 24 requests done", 120)
    tab.get_by_role("button", name="Stop").click()
    status = wait_text(page, "#loadtest-status", r"Done in", 60)
    counts = re.search(r"(\d+) succeeded, (\d+) failed, (\d+) aborted", status)
    assert counts, status
    succeeded, failed, aborted = map(int, counts.groups())
    assert aborted > 0 and succeeded + failed + aborted == 24, status


def test_the_kv_memory_fraction_never_raises(page):
    open_tab(page, "KV calculator")
    wait_text(page, "#kv-formula", r"17,179,869,184", 30)
    box = page.locator("#kv-fraction input")
    for typed, shown in (("0.3", r"30% of 80 GB"), ("1.5", r"Check the form: memory fraction"),
                         ("0", r"Check the form: memory fraction"), ("0.95", r"95% of 80 GB")):  # fmt: skip
        box.fill(typed)
        box.press("Enter")
        wait_text(page, "#kv-formula", shown, 20)
        # No red "Error" badge on any output, no error toast.
        assert page.locator("#tab-kv .error").count() == 0
        assert page.locator(".toast-body.error").count() == 0
