"""Timer redraws of Plotly figures in place, for the tabs that refresh every second.

Why: Gradio 6's gr.Plot re-mounts its Plotly div on every new value (its Svelte component is
keyed on a counter bumped whenever the figure JSON changes), so each refresh is a Plotly
newPlot from scratch: DOM, SVG, legend, axes. Measured on the Engine (live) tab with a 50k-block
pool under load (2 cores): main-thread long tasks of 230-450 ms every second, 25 % of wall
time, ~90 % of it inside Plotly's newPlot.

How: the first draw of a tab (tab select, "Refresh now", a changed option) still goes through
gr.Plot, which loads Plotly and mounts the div. The timer's ticks instead put the changed
figures' JSON into one hidden textbox, and a browser-only step (`js`, no server round trip)
hands each to Plotly.react on the div gr.Plot mounted: Plotly diffs the figure and redraws
only what changed, one plot per browser task so input is handled in between (measured: 10-60 ms
a plot instead of one 100-450 ms task). If a div is missing (not drawn yet), the step clicks the tab's refresh
button for a full draw instead of dropping the update.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import gradio as gr
import plotly.graph_objects as go

# payload: {"<elem_id of a gr.Plot>": <figure JSON>, ...}. Mirrors what Gradio's PlotlyPlot
# does to a figure before drawing it (responsive, autosize, auto-expanding margins), so a react
# call sees the same config as the mounted plot and does not fall back to a full newPlot.
REACT_JS = """
(payload, refreshId) => {
  if (!payload) return;
  const queue = Object.entries(JSON.parse(payload));
  const drawNext = () => {
    const next = queue.shift();
    if (!next) return;
    const [elemId, fig] = next;
    const div = document.querySelector(`#${elemId} .js-plotly-plot`);
    if (!window.Plotly || !div) {
      document.querySelector(`#${refreshId}`)?.click();
      return;
    }
    const layout = fig.layout || {};
    layout.autosize = true;
    layout.margin = Object.assign({}, layout.margin, {autoexpand: true});
    const config = Object.assign({}, fig.config, {responsive: true});
    window.Plotly.react(div, fig.data || [], layout, config);
    setTimeout(drawNext, 0);  // one task per plot: the page stays responsive in between
  };
  drawNext();
}
"""


class PlotStream:
    """One tab's in-place redraws: create inside the tab's layout, encode() in the tick
    handler (it returns the textbox's new value), attach() to the tick event."""

    def __init__(self, refresh_button_elem_id: str) -> None:
        self.refresh_button_elem_id = refresh_button_elem_id
        self.payload = gr.Textbox(visible="hidden", lines=1, max_lines=1, show_label=False)
        self._refresh_id = gr.Textbox(refresh_button_elem_id, visible="hidden", show_label=False)

    @staticmethod
    def encode(figures: Mapping[str, go.Figure | None]) -> str:
        """The changed figures by elem_id (None: unchanged, not sent); "" when none changed."""
        parts = [
            f"{json.dumps(elem_id)}: {fig.to_json()}"
            for elem_id, fig in figures.items()
            if fig is not None
        ]
        return "{" + ", ".join(parts) + "}" if parts else ""

    def attach(self, tick: gr.events.Dependency) -> None:
        """After each tick, draw what it sent, in the browser."""
        tick.then(None, [self.payload, self._refresh_id], None, js=REACT_JS, show_progress="hidden")
