"""What the benchmark scripts (bench.py, bench_prefix.py, bench_spec.py) share: the common
flags and printing the JSON report (and writing it with --json)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def bench_parser(doc: str) -> argparse.ArgumentParser:
    """A parser with --model, --device, --dtype and --json; the script adds its own flags.
    --help prints the script's whole docstring (what it measures and how)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--json", type=Path, help="also write the JSON here")
    return p


def emit(report: dict, path: Path | None) -> None:
    """Print the report as JSON; also write it to `path` when given."""
    text = json.dumps(report, indent=2)
    print(text)
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
