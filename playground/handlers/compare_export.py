"""A finished compare as one JSON file: the workload, both sides' configurations and every
repeat's full result (summary and per-request timelines), and the side-by-side table as shown,
so a run can be kept, diffed or plotted elsewhere like a load test's download."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from playground.handlers.compare import COMPARE_HEADERS, SideOutcome
from playground.handlers.loadtest import write_download
from playground.loadgen import WorkloadSpec


def side_dict(outcome: SideOutcome) -> dict[str, Any]:
    return {
        "name": outcome.name,
        "label": outcome.label,
        # None for a remote server: its label names the URL and model.
        "config": dataclasses.asdict(outcome.config) if outcome.config is not None else None,
        "load_s": outcome.load_s,
        "weight_bytes": outcome.weight_bytes,
        "perplexity": outcome.perplexity,
        "error": outcome.error,
        "runs": [run.to_dict() for run in outcome.runs],
    }


def compare_dict(
    spec: WorkloadSpec, repeats: int, outcomes: Sequence[SideOutcome], rows: list[list[str]]
) -> dict[str, Any]:
    return {
        "kind": "compare",
        "spec": spec.to_dict(),
        "runs_per_side": repeats,
        "table": {"headers": COMPARE_HEADERS, "rows": rows},
        "sides": [side_dict(o) for o in outcomes],
    }


def write_compare_json(
    spec: WorkloadSpec, repeats: int, outcomes: Sequence[SideOutcome], rows: list[list[str]]
) -> str:
    """The compare in a fresh temp file; returns its path."""
    text = json.dumps(compare_dict(spec, repeats, outcomes, rows), indent=2, default=str)
    return write_download(text, "compare")
