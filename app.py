"""Entry point: parse flags -> EngineConfig -> EngineService -> playground UI -> launch.

python app.py                          # embedded SmolLM2-135M, CUDA if available, else CPU
python app.py --model /path/to/hf-folder --device cuda --dtype bfloat16 --port 7861
"""

from __future__ import annotations

import argparse
import logging
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="The inference playground: a Gradio UI over our own LLM inference engine."
    )
    p.add_argument(
        "--model",
        default="smollm2-135m",
        help="smollm2-135m (embedded), a local Hugging Face folder, a .gguf file, or "
        "random:<preset> (default: %(default)s)",
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto = CUDA when available, else CPU",
    )
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (%(default)s)")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--share", action="store_true", help="also open a public Gradio share link")
    p.add_argument("--max-model-len", type=int, default=None, help="context cap in tokens")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks")
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="CUDA: fraction of device memory for weights + KV (leave room for the Compare "
        "tab's engines with big models)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # gradio's own start-up pings
    # Imported after parsing so that --help answers at once.
    from engine import EngineConfig
    from engine.service import EngineService
    from playground.app import build_app, launch

    try:
        config = EngineConfig(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            num_kv_blocks=args.num_kv_blocks,
            gpu_memory_utilization=args.gpu_memory_utilization,
        )
        service = EngineService(config)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"engine ready: {service.model_name}; open http://{args.host}:{args.port}")
    try:
        launch(build_app(service), host=args.host, port=args.port, share=args.share)
    finally:
        service.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
