"""Plotly figures of engine snapshots; no engine state, no Gradio."""
