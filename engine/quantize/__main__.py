"""python -m engine.quantize --method awq --group-size 64 [--out DIR] [--model SPEC]

Writes an AutoAWQ GEMM checkpoint (loadable here with quantization="awq", and by vLLM or
AutoAWQ) calibrated on local text. Without --out, the embedded model's checkpoint goes to the
cache folder the engine loads it from (what `make quantize` does); with --out, any local float
Hugging Face Llama folder (--model) is quantized into DIR. Prints a JSON report.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from engine.quantize.awq_produce import AwqSettings, quantize_awq
from engine.tokenizer import EMBEDDED_MODEL


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    defaults = AwqSettings()
    p.add_argument("--method", choices=["awq"], default="awq", help="only AutoAWQ for now")
    p.add_argument("--group-size", type=int, default=defaults.group_size, choices=[32, 64, 128])
    p.add_argument("--out", type=Path, help="output folder (default: the engine's cache)")
    p.add_argument("--model", default=EMBEDDED_MODEL, help="embedded model or a float HF folder")
    p.add_argument("--calib-samples", type=int, default=defaults.calib_samples,
                   help="blocks of calibration text")  # fmt: skip
    p.add_argument("--calib-seq-len", type=int, default=defaults.calib_seq_len_tokens,
                   help="tokens per calibration block")  # fmt: skip
    p.add_argument("--clip", action="store_true", help="also AutoAWQ's clipping search (slower)")
    args = p.parse_args(argv)
    settings = AwqSettings(args.group_size, args.calib_samples, args.calib_seq_len, args.clip)
    try:
        report = _run(args, settings)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2))
    return 0


def _run(args: argparse.Namespace, settings: AwqSettings) -> dict:
    from engine.runner.model_loader import resolve_model

    if args.out is None:
        if args.model != EMBEDDED_MODEL:
            raise ValueError("out: needed for a model other than the embedded one")
        if settings != AwqSettings(group_size=settings.group_size):
            raise ValueError("out: the cached checkpoint uses the default calibration settings")
        from engine.quantize import embedded_awq_dir, embedded_awq_name
        from engine.tokenizer import cache_dir

        existed = (cache_dir() / "models" / embedded_awq_name(args.group_size)).is_dir()
        folder = embedded_awq_dir(args.group_size)
        return {"out": str(folder), "already_cached": existed}
    source = resolve_model(args.model)
    if source.weights_dir is None or source.quant_config:
        raise ValueError(f"model: {args.model} is not a float Hugging Face folder")
    report = quantize_awq(source.weights_dir, args.out, settings)
    return {"out": str(args.out), "model": args.model, **report}


if __name__ == "__main__":
    raise SystemExit(main())
