"""`./launch.sh` / `qflash serve`: argument handling, the dummy model by default, and the no-GPU message."""

import json
import os
import shlex
import subprocess
import sys

import pytest
import torch

from conftest import REPO


def launch(*args: str, cache, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "QFLASH_CACHE": str(cache), "PYTHON": sys.executable}
    return subprocess.run([str(REPO / "launch.sh"), *args], capture_output=True, text=True, timeout=timeout, env=env)


def flag(argv: list[str], name: str) -> str:
    return argv[len(argv) - 1 - argv[::-1].index(name) + 1]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("qflash-cache")


def test_no_arguments_builds_and_serves_the_dummy_model(cache):
    result = launch("--dry-run", cache=cache)
    assert result.returncode == 0, result.stderr
    argv = shlex.split(result.stdout.strip().splitlines()[-1])
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    # qflash's W8A8 layout of the target, served by qflash's method; the drafter quantized by it at load
    assert flag(argv, "--model-path") == str(cache / "dummy" / "w8a8" / "Qwen3.5-4B")
    assert flag(argv, "--speculative-draft-model-path") == str(cache / "dummy" / "Qwen3.5-4B-DFlash")
    assert (cache / "dummy" / "w8a8" / "Qwen3.5-4B" / "tokenizer.json").exists()
    assert flag(argv, "--quantization") == "qflash_w8a8" and flag(argv, "--speculative-draft-model-quantization") == "qflash_w8a8"
    assert flag(argv, "--load-format") == "dummy" and flag(argv, "--speculative-draft-load-format") == "dummy"
    assert flag(argv, "--speculative-algorithm") == "DFLASH" and flag(argv, "--speculative-dflash-block-size") == "16"
    assert (flag(argv, "--host"), flag(argv, "--port")) == ("127.0.0.1", "30000")
    assert flag(argv, "--served-model-name") == "Qwen3.5-4B"
    assert flag(argv, "--cuda-graph-bs-decode") == "1"  # graphs/ shapes
    # prefix caching with the GDN state checkpoints
    assert "--disable-radix-cache" not in argv and flag(argv, "--mamba-radix-cache-strategy") == "extra_buffer"


def test_prefix_cache_can_be_turned_off(cache):
    result = launch("--no-prefix-cache", "--dry-run", cache=cache)
    assert result.returncode == 0, result.stderr
    argv = shlex.split(result.stdout.strip().splitlines()[-1])
    assert "--disable-radix-cache" in argv and "--mamba-radix-cache-strategy" not in argv


def test_real_checkpoints_and_passthrough_flags(cache, tmp_path):
    target, drafter = tmp_path / "my-qwen", tmp_path / "my-drafter"
    for d in (target, drafter):
        d.mkdir()
        (d / "config.json").write_text("{}")
        (d / "tokenizer.json").write_text("{}")
        (d / "model.safetensors").write_bytes(b"")
    result = launch("--model-path", str(target), "--draft-model-path", str(drafter), "--port", "31000",
                    "--mem-fraction-static", "0.8", "--dry-run", cache=cache)
    assert result.returncode == 0, result.stderr
    argv = shlex.split(result.stdout.strip().splitlines()[-1])
    assert flag(argv, "--model-path") == str(target) and "--load-format" not in argv
    assert "--quantization" not in argv  # a bf16 checkpoint is served as it is
    assert flag(argv, "--speculative-draft-load-format") == "auto"
    assert flag(argv, "--port") == "31000" and flag(argv, "--served-model-name") == "my-qwen"
    assert argv[-2:] == ["--mem-fraction-static", "0.8"]  # given flags come last, so they win


def test_target_without_drafter_is_refused(cache, tmp_path):
    result = launch("--model-path", str(tmp_path), cache=cache)
    assert result.returncode == 2
    assert "--draft-model-path" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown on a machine without a GPU")
def test_without_a_gpu_it_says_so_in_one_line(cache):
    result = launch(cache=cache)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == ["qflash: no CUDA GPU is visible; qflash serves on an NVIDIA GPU (sm80 or newer)"]
    assert result.stdout == ""


def test_a_quantized_checkpoint_is_served_by_qflash_w8a8(cache, tmp_path):
    from qflash.quant.quantize import quantized_config
    from qflash.server.preset import TARGET_CONFIG

    target, drafter = tmp_path / "Qwen3.5-4B-W8A8", tmp_path / "drafter"
    for d, config in ((target, quantized_config(TARGET_CONFIG)), (drafter, {})):
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
        (d / "model.safetensors").write_bytes(b"")
    result = launch("--model-path", str(target), "--draft-model-path", str(drafter), "--dry-run", cache=cache)
    assert result.returncode == 0, result.stderr
    argv = shlex.split(result.stdout.strip().splitlines()[-1])
    assert flag(argv, "--quantization") == "qflash_w8a8" and flag(argv, "--speculative-draft-model-quantization") == "qflash_w8a8"
    assert "--load-format" not in argv and flag(argv, "--served-model-name") == "Qwen3.5-4B-W8A8"


def test_freeze_gc_posts_to_sglangs_route():
    """`qflash serve` freezes the server's start-up heap through SGLang's own route, which must exist as called."""
    import http.server
    import threading

    from sglang.srt.entrypoints.http_server import app
    from qflash.server.launcher import freeze_gc

    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            seen.append(("POST", self.path))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    stub = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=stub.handle_request, daemon=True).start()
    freeze_gc(f"http://127.0.0.1:{stub.server_port}")
    stub.server_close()
    assert seen == [("POST", "/freeze_gc")]
    assert any(getattr(r, "path", None) == "/freeze_gc" and "POST" in r.methods for r in app.routes)


def test_a_port_already_serving_is_refused_before_anything_starts(tmp_path):
    """Another server on the port would answer the new one's /health checks in its place."""
    import socket

    from qflash.server.launcher import ServerDied, ServerProcess

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        server = ServerProcess([sys.executable, "-c", "pass"], dict(os.environ), tmp_path / "log", f"http://127.0.0.1:{port}")
        with pytest.raises(ServerDied, match=f"127.0.0.1:{port} is already in use"):
            server.start()
    assert server.proc is None


STOPPED_BY_SIGTERM = """
import os, sys, time
from pathlib import Path
from qflash.server.launcher import ServerProcess, unwind_on_sigterm
unwind_on_sigterm()
server = ServerProcess([sys.executable, "-c", "import time; time.sleep(120)"], dict(os.environ), Path(sys.argv[1]),
                       "http://127.0.0.1:" + sys.argv[2]).start()
print(server.proc.pid, flush=True)
try:
    time.sleep(120)
finally:
    server.stop()
"""


def test_sigterm_stops_the_started_server_too(tmp_path):
    """What `qflash serve`, `qflash bench` and `qflash profile` do when `timeout` or `kill` stops them."""
    import signal
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    parent = subprocess.Popen([sys.executable, "-c", STOPPED_BY_SIGTERM, str(tmp_path / "log"), str(port)],
                              stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(timeout=60) != 0
    with pytest.raises(ProcessLookupError):  # the server's process group is gone (reaped by stop())
        os.kill(child, 0)
