"""Remote mode (`python app.py --base-url ...`) builds the whole UI without torch or the model
runner: it runs on a laptop next to a remote vLLM/SGLang server. Checked in a fresh process,
since pytest's own process has long imported torch."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODEL_LIST = {"object": "list", "data": [{"id": "smollm2-135m", "max_model_len": 1024}]}


class _ModelsOnly(BaseHTTPRequestHandler):
    """A stand-in OpenAI server that answers GET /v1/models, all that building the remote UI
    asks of a server (chat and load tests are covered against our real server in
    test_ui_remote.py; loading an engine here would import torch in the parent anyway)."""

    def do_GET(self) -> None:
        if self.path.rstrip("/") != "/v1/models":
            self.send_error(404)
            return
        body = json.dumps(MODEL_LIST).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:  # keep pytest's output clean
        pass


@pytest.fixture
def models_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ModelsOnly)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


# app.main's remote path, with launch() replaced so the built UI is inspected, not served.
CHILD = """
import json, sys
import playground.app

built = []
playground.app.launch = lambda demo, **kwargs: built.append(demo)
import app

rc = app.main(["--base-url", sys.argv[1], "--port", "7999"])
ctx = built[0].playground_context if built else None
print(json.dumps({
    "rc": rc,
    "built": len(built),
    "remote_model": getattr(getattr(ctx, "remote", None), "model", None),
    "loaded": sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "engine")),
}))
"""


def test_remote_mode_builds_the_ui_without_torch_or_the_model_runner(models_server):
    out = subprocess.run(
        [sys.executable, "-c", CHILD, models_server],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["rc"] == 0 and result["built"] == 1
    assert result["remote_model"] == "smollm2-135m"  # the UI was built over our stand-in
    loaded = result["loaded"]
    assert "torch" not in loaded, [m for m in loaded if m.startswith("torch")][:10]
    assert "engine.runner.model_runner" not in loaded, loaded


# A load test's prompts in remote mode: the tokenizer chain (here the served id is a path that
# is not on this machine, so the embedded model's tokenizer) and build_requests, torch-free.
PROMPTS_CHILD = """
import json, sys
from playground.context import AppContext
from playground.loadgen import WorkloadSpec, build_requests
from playground.remote.client import RemoteServer

ctx = AppContext.for_remote(RemoteServer.connect(sys.argv[1], model="/not/here/model.gguf"))
target = ctx.load_test_target()
requests = build_requests(WorkloadSpec(num_prompts=3, input_len=16), target.tokenizer)
print(json.dumps({
    "lengths": [len(r.prompt) for r in requests],
    "prompts": target.notes["prompts"],
    "loaded": sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "engine")),
}))
"""


def test_remote_load_test_prompts_build_without_torch(models_server):
    out = subprocess.run(
        [sys.executable, "-c", PROMPTS_CHILD, models_server],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["lengths"] == [16, 16, 16]
    assert result["prompts"].startswith("the embedded model's tokenizer")
    loaded = result["loaded"]
    assert "torch" not in loaded, [m for m in loaded if m.startswith("torch")][:10]
    assert not [m for m in loaded if m.startswith("engine.runner")], loaded
