"""Entry point: parse flags -> EngineConfig -> EngineService -> playground UI -> launch.
With --base-url: remote mode, the UI over an OpenAI-compatible server and no engine loaded.

python app.py                          # embedded SmolLM2-135M, CUDA if available, else CPU
python app.py --model /path/to/hf-folder --device cuda --dtype bfloat16 --port 7861
python app.py --base-url http://127.0.0.1:8000 --tokenizer smollm2-135m   # vLLM, SGLang, ...
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from engine.cli import add_engine_args, config_from_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="The inference playground: a Gradio UI over our own LLM inference engine."
    )
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (%(default)s)")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--share", action="store_true", help="also open a public Gradio share link")
    # The playground differs from EngineConfig in one default: a chat's earlier turns are
    # cached, as every serving engine does today.
    add_engine_args(p, defaults={"enable_prefix_caching": True})
    remote = p.add_argument_group(
        "remote mode",
        "point the playground at an OpenAI-compatible server instead (our "
        "engine.serving.server, vLLM, SGLang, llama.cpp): no local engine is started, no weights loaded",
    )
    remote.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000")
    remote.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="sent as Authorization: Bearer KEY (default: $OPENAI_API_KEY)",
    )
    remote.add_argument(
        "--served-model",
        default=None,
        help="the model to request (default: the first of GET /v1/models)",
    )
    remote.add_argument(
        "--tokenizer",
        default=None,
        help="builds the load test's random prompts: a HF folder or name, or an engine model "
        "spec like smollm2-135m (default: the served model's name); must be the served model's",
    )
    return p


def run_remote(args: argparse.Namespace) -> int:
    """Remote mode: ask the server what it serves, then the UI over it."""
    from playground.app import build_app, launch
    from playground.remote.client import RemoteServer

    try:
        remote = RemoteServer.connect(
            args.base_url, args.api_key, args.served_model, args.tokenizer
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"remote mode: {remote.label}; open http://{args.host}:{args.port}")
    launch(build_app(remote=remote), host=args.host, port=args.port, share=args.share)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # gradio's own start-up pings
    if args.base_url:
        return run_remote(args)
    # Imported after parsing so that --help answers at once.
    from engine.serving.service import EngineService
    from playground.app import build_app, launch

    try:
        config = config_from_args(args)
        service = EngineService(config)
    except (ValueError, OSError) as e:  # a bad flag or --model path: one line, no traceback
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
