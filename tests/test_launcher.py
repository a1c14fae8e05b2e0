"""`./launch.sh` / `qflash serve`: argument handling, the dummy model by default, and the no-GPU message."""

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

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
def test_without_a_gpu_it_says_so_in_one_line_before_building_anything(tmp_path):
    result = launch(cache=tmp_path)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == ["qflash serve: no CUDA GPU is visible; qflash serves on an NVIDIA GPU (sm80 or newer)"]
    assert result.stdout == "" and not (tmp_path / "dummy").exists()


@pytest.mark.parametrize("case, message", [
    ("missing", "--model-path {target} does not exist or is not a folder"),
    ("no config", "--model-path {target} has no config.json (not a Hugging Face model folder)"),
    ("bad config", "--model-path {target}/config.json is not valid JSON"),
    ("missing drafter", "--draft-model-path {drafter} does not exist or is not a folder"),
])
def test_a_model_folder_that_is_not_one_is_a_one_line_error(case, message, tmp_path):
    target, drafter = tmp_path / "target", tmp_path / "drafter"
    if case != "missing":
        target.mkdir()
    if case in ("bad config", "missing drafter"):
        (target / "config.json").write_text("{" if case == "bad config" else "{}")
    if case != "missing drafter":
        drafter.mkdir()
        (drafter / "config.json").write_text("{}")
    result = launch("--model-path", str(target), "--draft-model-path", str(drafter), cache=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    line, = result.stderr.strip().splitlines()
    assert line.startswith("qflash serve: " + message.format(target=target, drafter=drafter)), line


def test_the_api_key_reaches_sglang_and_other_hosts_without_one_are_warned(cache):
    result = launch("--api-key", "k3y", "--dry-run", cache=cache)
    assert result.returncode == 0 and result.stderr == ""
    argv = shlex.split(result.stdout.strip().splitlines()[-1])
    assert flag(argv, "--api-key") == "k3y"
    env = {**os.environ, "QFLASH_CACHE": str(cache), "PYTHON": sys.executable, "QFLASH_API_KEY": "from-env"}
    result = subprocess.run([str(REPO / "launch.sh"), "--dry-run"], capture_output=True, text=True, env=env, timeout=300)
    assert flag(shlex.split(result.stdout.strip().splitlines()[-1]), "--api-key") == "from-env"
    result = launch("--host", "0.0.0.0", "--dry-run", cache=cache)
    assert result.returncode == 0 and "--api-key" not in result.stdout
    assert result.stderr.startswith("qflash: warning: listening on 0.0.0.0 without --api-key")


def test_a_quantized_checkpoint_is_served_by_qflash_w8a8(cache, tmp_path):
    from qflash.quant.layout import quantized_config
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


def test_freeze_gc_posts_to_sglangs_route_with_the_api_key():
    """`qflash serve` freezes the server's start-up heap through SGLang's own route, which must exist as called, and
    which a server with an API key answers only with it."""
    import http.server
    import threading

    from sglang.srt.entrypoints.http_server import app
    from qflash.server.launcher import ServerProcess, freeze_gc

    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            seen.append(("POST", self.path, self.headers.get("Authorization")))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    stub = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=stub.handle_request, daemon=True).start()
    freeze_gc(ServerProcess([], {}, Path("log"), f"http://127.0.0.1:{stub.server_port}", api_key="k3y"))
    stub.server_close()
    assert seen == [("POST", "/freeze_gc", "Bearer k3y")]
    assert any(getattr(r, "path", None) == "/freeze_gc" and "POST" in r.methods for r in app.routes)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def test_a_server_that_dies_while_starting_is_reported_at_once_with_qflash_s_reason(tmp_path):
    from qflash.server.launcher import ServerDied, ServerProcess

    log = tmp_path / "log"
    log.write_text("qflash: refusing to start: an earlier run's line, which must not count\n")
    died = "import sys; print('[2026] qflash: refusing to start: found sglang 0.5.18', file=sys.stderr); sys.exit(1)"
    server = ServerProcess([sys.executable, "-c", died], dict(os.environ), log, f"http://127.0.0.1:{free_port()}").start()
    start = time.monotonic()
    with pytest.raises(ServerDied, match=r"^refusing to start: found sglang 0.5.18$"):
        server.wait_ready(timeout_s=60)
    assert time.monotonic() - start < 30  # not the timeout: the exit is noticed
    silent = ServerProcess([sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ), tmp_path / "log2",
                           f"http://127.0.0.1:{free_port()}").start()
    with pytest.raises(ServerDied, match="server exited with code 3"):
        silent.wait_ready(timeout_s=60)


SPAWNS_A_CHILD = "import subprocess, sys, time; print(subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']).pid, flush=True); time.sleep(120)"


def test_stop_ends_the_servers_children_too(tmp_path):
    """SGLang's scheduler and detokenizer are the server's children: stopping only the server would leave them
    holding the GPU."""
    from qflash.server.launcher import ServerProcess

    log = tmp_path / "log"
    server = ServerProcess([sys.executable, "-c", SPAWNS_A_CHILD], dict(os.environ), log, f"http://127.0.0.1:{free_port()}").start()
    deadline = time.monotonic() + 60
    while not log.read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.1)
    child = int(log.read_text().split()[0])
    server.stop()
    deadline = time.monotonic() + 30
    while gone(child) is False and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(child)


def gone(pid: int) -> bool:
    """True once `pid` has exited (a zombie left for init counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


STOPPED_BY_SIGTERM = """
import os, sys, time
from pathlib import Path
from qflash.server.launcher import ServerProcess, unwind_on_sigterm
unwind_on_sigterm()
server = ServerProcess([sys.executable, "-c", "import time; time.sleep(120)"], dict(os.environ), Path(sys.argv[1]),
                       "http://127.0.0.1:" + sys.argv[2])
try:
    server.start()
    print(server.proc.pid, flush=True)  # inside the try: a SIGTERM from here on stops the server
    time.sleep(120)
finally:
    server.stop()
"""


def test_sigterm_stops_the_started_server_too(tmp_path):
    """What `qflash serve`, `qflash bench` and `qflash profile` do when `timeout` or `kill` stops them."""
    import signal

    parent = subprocess.Popen([sys.executable, "-c", STOPPED_BY_SIGTERM, str(tmp_path / "log"), str(free_port())],
                              stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(timeout=60) != 0
    assert gone(child)  # stop() waited for the server's process group


STUB_SERVER = """
import http.server, os, sys, threading
if os.environ.get("STUB_PRINTS"):
    print("qflash: 21 hooks applied on sglang 0.5.17: ...", file=sys.stderr, flush=True)

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()

    def do_POST(self):  # the warm-up's requests, then /freeze_gc, the launcher's last call: then the server exits
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if os.environ.get("STUB_FAILS"):  # as SGLang does when its scheduler raises: gone, the request unanswered
            os._exit(1)
        self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
        if self.path == "/freeze_gc":
            threading.Thread(target=server.shutdown).start()

    def log_message(self, *args):
        pass

server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler)
server.serve_forever()
"""


@pytest.mark.parametrize("prints", [True, False], ids=["with qflash", "without qflash's plugin"])
def test_serve_reports_ready_only_once_the_server_says_qflash_is_in_place(prints, tmp_path, monkeypatch, capsys):
    from qflash.server import launcher
    from qflash.server.cli import parser

    port = free_port()
    monkeypatch.setattr(launcher, "require_gpu", lambda: None)
    monkeypatch.setattr(launcher, "dummy_model_dirs", lambda: (tmp_path, tmp_path))
    monkeypatch.setattr(launcher, "sglang_argv", lambda *args, **kwargs: [sys.executable, "-c", STUB_SERVER, str(port)])
    monkeypatch.setenv("STUB_PRINTS", "1" if prints else "")
    args = parser("serve").parse_args(["serve", "--port", str(port), "--log", str(tmp_path / "log")])
    assert launcher.run(args, []) == (0 if prints else 1)
    out, err = capsys.readouterr()
    if prints:
        assert "qflash: 21 hooks applied on sglang 0.5.17" in out and "ready in" in out
    else:
        assert "ready in" not in out
        assert err.strip().splitlines()[-1] == ("qflash: the server started without qflash's SGLang plugin "
                                                "(is qflash installed in this Python?)")


def test_a_server_that_fails_during_the_warm_up_is_one_line(tmp_path, monkeypatch, capsys):
    from qflash.server import launcher
    from qflash.server.cli import parser

    port = free_port()
    monkeypatch.setattr(launcher, "require_gpu", lambda: None)
    monkeypatch.setattr(launcher, "dummy_model_dirs", lambda: (tmp_path, tmp_path))
    monkeypatch.setattr(launcher, "sglang_argv", lambda *args, **kwargs: [sys.executable, "-c", STUB_SERVER, str(port)])
    monkeypatch.setenv("STUB_PRINTS", "1")
    monkeypatch.setenv("STUB_FAILS", "1")
    args = parser("serve").parse_args(["serve", "--port", str(port), "--log", str(tmp_path / "log")])
    assert launcher.run(args, []) == 1
    out, err = capsys.readouterr()
    assert "ready in" not in out and "Traceback" not in err
    [line] = err.strip().splitlines()  # the dropped request's error: which one depends on where the exit found it
    assert line.startswith("qflash: the server failed during the warm-up (") and line.endswith(f"log: {tmp_path / 'log'}")


def test_the_window_and_qflash_s_sglang_settings_reach_the_server_environment(monkeypatch):
    import argparse

    from qflash.server import launcher, window
    from qflash.server.preset import QFLASH_SERVER_ENV, WINDOW_CYCLES

    p = argparse.ArgumentParser()
    launcher.add_arguments(p)
    assert launcher.settings_env(p.parse_args([]))[window.ENV] == str(WINDOW_CYCLES)
    assert launcher.settings_env(p.parse_args(["--window-cycles", "1"]))[window.ENV] == "1"
    for bad in ("0", "9"):
        with pytest.raises(SystemExit):
            p.parse_args(["--window-cycles", bad])
    monkeypatch.delenv("SGLANG_ENABLE_OVERLAP_PLAN_STREAM", raising=False)
    assert all(launcher.plugin_env("qflash")[k] == v for k, v in QFLASH_SERVER_ENV.items())
    assert not any(k in launcher.plugin_env("qflash_text_only") for k in QFLASH_SERVER_ENV)  # stock stays stock
    monkeypatch.setenv("SGLANG_ENABLE_OVERLAP_PLAN_STREAM", "0")  # a user's own setting wins
    assert launcher.plugin_env("qflash")["SGLANG_ENABLE_OVERLAP_PLAN_STREAM"] == "0"


def test_a_window_length_out_of_range_is_a_one_line_error(cache):
    result = launch("--window-cycles", "12", "--dry-run", cache=cache)
    assert result.returncode == 2 and "--window-cycles: '12': choose 1 to 8" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_warm_up_batches_every_width_extends_a_cached_prefix_and_ends_start_up(monkeypatch):
    """server/warm_up.py against a stub server: each round's requests arrive together, or one after another where
    the round says so, with the API key; the last request is the marker that ends start-up in the compile watch;
    then the radix cache is flushed."""
    import http.server
    import threading
    from types import SimpleNamespace

    from qflash.server import warm_up, window
    from qflash.server.launcher import ServerProcess
    from qflash.server.preset import BLOCK_SIZE, CHUNKED_PREFILL_SIZE, MAX_RUNNING_REQUESTS

    seen, lock = [], threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            with lock:
                seen.append((self.path, self.headers.get("Authorization"), json.loads(body) if body else None))
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    waits = []
    monkeypatch.setattr(warm_up, "time", SimpleNamespace(sleep=waits.append, monotonic=time.monotonic))
    class Stub(http.server.ThreadingHTTPServer):
        request_queue_size = 64  # the staggered round connects 16 at once; past the default backlog (5) Linux resets some

    stub = Stub(("127.0.0.1", 0), Handler)
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    try:
        line = warm_up.run(ServerProcess([], {}, Path("log"), f"http://127.0.0.1:{stub.server_port}", api_key="k3y").post)
    finally:
        stub.shutdown()
        stub.server_close()
    rounds = warm_up.rounds()
    count = sum(len(r) for _, r in rounds)
    assert line.startswith(f"qflash: warm-up: {count} requests in ")
    assert [len(r) for _, r in rounds[:MAX_RUNNING_REQUESTS]] == list(range(1, MAX_RUNNING_REQUESTS + 1))
    generated = [body for path, _, body in seen if path == "/generate"]
    assert len(generated) == count and all(auth == "Bearer k3y" for _, auth, _ in seen)
    assert generated[-1]["rid"] == warm_up.DONE_RID and [path for path, _, _ in seen[-1:]] == ["/flush_cache"]
    # each batch decodes for a whole window of cycles that accept the whole block, after the prefill's token and
    # the first decode step's one cycle
    full_window = 1 + BLOCK_SIZE * (1 + window.MAX_CYCLES)
    assert all(b["sampling_params"]["max_new_tokens"] > full_window for _, r in rounds[:MAX_RUNNING_REQUESTS] for b in r)
    gap_s, staggered = next((gap_s, r) for gap_s, r in rounds if gap_s)
    assert len(staggered) > MAX_RUNNING_REQUESTS  # more than a batch runs: some queue
    assert all(len(b["input_ids"]) % 2 for b in staggered)
    # one after another: the n-th request of that round waits n gaps before it is sent, the others none
    assert sorted(filter(None, waits)) == pytest.approx([gap_s * n for n in range(1, len(staggered))])
    prefix = warm_up.prompt(600, 1)
    cached = [b["input_ids"] for b in generated if b.get("input_ids", [])[:600] == prefix]
    assert sorted(map(len, cached)) == [600, 616, 645, 900]  # a prefix, then three extends over it cached
    # a fresh prompt SGLang prefills eagerly, whose GEMMs' row count Triton specializes neither as 1 nor as 16-divisible
    from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import _MAX_PREFILL_CUDA_GRAPH_PADDING_FACTOR

    prompts = [b["input_ids"] for b in generated if isinstance(b.get("input_ids", [None])[0], int)]
    short = [len(ids) for ids in prompts if 1 < len(ids) < BLOCK_SIZE]
    assert short and all(n * _MAX_PREFILL_CUDA_GRAPH_PADDING_FACTOR < BLOCK_SIZE for n in short)
    # two prompts in one request, prefilled together: their first chunk holds more of FLA's 64-token chunks than
    # one prompt's can (128)
    first, second = next(b["input_ids"] for b in generated if isinstance(b.get("input_ids", [0])[0], list))
    assert len(first) + len(second) > CHUNKED_PREFILL_SIZE
    assert -(-len(first) // 64) + -(-(CHUNKED_PREFILL_SIZE - len(first)) // 64) > CHUNKED_PREFILL_SIZE // 64
    from sglang.srt.entrypoints.http_server import app

    assert any(getattr(r, "path", None) == "/flush_cache" and "POST" in r.methods for r in app.routes)


def test_a_warm_up_request_the_server_refuses_is_named_and_start_up_goes_on(monkeypatch):
    import io
    import urllib.error
    import urllib.request

    from qflash.server import warm_up

    def post(request, timeout):
        if b"regex" in (request.data or b""):
            raise urllib.error.HTTPError(request.full_url, 400, "Bad Request", {}, io.BytesIO(b'{"error": "no grammar"}'))
        return io.BytesIO(b"{}")

    from qflash.server.launcher import ServerProcess

    monkeypatch.setattr(urllib.request, "urlopen", post)
    line = warm_up.run(ServerProcess([], {}, Path("log"), "http://127.0.0.1:1").post)
    assert line.endswith('; warning: 1 refused, e.g. 400 {"error": "no grammar"}'), line
