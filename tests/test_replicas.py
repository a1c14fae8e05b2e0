"""`qflash serve --replicas N` (server/replicas.py): where the replicas go, the commands, and the launcher's run
against stub servers and a stub router (the real ones need a GPU and the `scale` extra)."""

import importlib.util
import os
import shlex
import signal
import socket
import subprocess
import sys

import pytest

from qflash.server.errors import UserError
from qflash.server.preset import MEM_FRACTION_STATIC
from qflash.server.replicas import plan, visible_gpus
from test_launcher import cache, flag, gone, launch  # noqa: F401 (cache: a fixture)


def test_one_replica_per_gpu_by_default():
    replicas = plan(2, ["0", "1"], share_gpus=False, router_port=30000)
    assert [(r.device, r.port, r.mem_fraction) for r in replicas] == [("0", 30001, 0.6), ("1", 30002, 0.6)]


def test_shared_gpus_start_their_replicas_in_waves():
    replicas = plan(3, ["0", "1"], share_gpus=True, router_port=40000)
    assert [(r.device, r.port, r.wave, r.mem_fraction) for r in replicas] == [
        ("0", 40001, 0, 0.3), ("1", 40002, 0, 0.3), ("0", 40003, 1, 0.429)]


@pytest.mark.parametrize("replicas", [2, 3, 4])
def test_replicas_sharing_a_gpu_each_get_an_even_share_of_it(replicas):
    """SGLang takes --mem-fraction-static of the memory free when a server starts; the waves start in turn."""
    free, taken = 1.0, []
    for r in plan(replicas, ["0"], share_gpus=True, router_port=30000):
        taken.append(free * r.mem_fraction)
        free -= taken[-1]
    assert taken == pytest.approx([MEM_FRACTION_STATIC / replicas] * replicas, abs=1e-3)


@pytest.mark.parametrize("replicas, gpus, message", [
    (3, ["0", "1"], "--replicas 3 needs 3 GPUs, 2 visible: add --share-gpus to run several on one GPU (its memory split "
                    "between them), or ask for fewer"),
    (0, ["0"], "--replicas 0: give 1 or more"),
    (2, [], "--replicas 2: no GPU is visible to place them on"),
])
def test_a_plan_that_cannot_be_is_a_user_error(replicas, gpus, message):
    with pytest.raises(UserError, match="^" + message.replace("(", r"\(").replace(")", r"\)") + "$"):
        plan(replicas, gpus, share_gpus=False, router_port=30000)


def test_the_visible_gpus_are_this_process_s_own():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 3"}, lambda: 8) == ["2", "3"]
    assert visible_gpus({}, lambda: 2) == ["0", "1"]


def test_dry_run_prints_each_replica_and_the_router(cache, monkeypatch):  # noqa: F811
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    result = launch("--replicas", "2", "--share-gpus", "--api-key", "k3y", "--port", "31000", "--dry-run", cache=cache)
    assert result.returncode == 0, result.stderr
    *workers, router = result.stdout.strip().splitlines()[-3:]
    for i, line in enumerate(workers):
        env, *argv = shlex.split(line)
        assert env == "CUDA_VISIBLE_DEVICES=0" and argv[1:3] == ["-m", "sglang.launch_server"]
        assert (flag(argv, "--host"), flag(argv, "--port")) == ("127.0.0.1", str(31001 + i))
        assert flag(argv, "--mem-fraction-static") == ["0.3", "0.429"][i] and flag(argv, "--api-key") == "k3y"
        assert flag(argv, "--speculative-algorithm") == "DFLASH"
    argv = shlex.split(router)
    assert argv[1:3] == ["-m", "sglang_router.launch_router"] and flag(argv, "--port") == "31000"
    assert argv[argv.index("--worker-urls") + 1:][:2] == ["http://127.0.0.1:31001", "http://127.0.0.1:31002"]
    assert flag(argv, "--policy") == "cache_aware" and flag(argv, "--api-key") == "k3y"


def test_more_replicas_than_gpus_is_one_line_and_a_non_zero_exit(cache, monkeypatch):  # noqa: F811
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    result = launch("--replicas", "2", "--dry-run", cache=cache)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == ("qflash serve: --replicas 2 needs 2 GPUs, 1 visible: add --share-gpus to run several on "
                             "one GPU (its memory split between them), or ask for fewer\n")


# A replica: says qflash is in place, answers every route, writes its pid and when the launcher's last start-up
# call (/freeze_gc) came; with "die", exits 1 s after it. The router: writes its pid and start, answers /health and
# lists the worker URLs after its arguments as healthy, exits after `extra` seconds.
STUB = """
import http.server, json, os, sys, threading, time
role, port, pids, extra = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
open(os.path.join(pids, f"{role}-{port}"), "w").write(str(os.getpid()))
if role == "router":
    open(os.path.join(pids, "t-router"), "w").write(str(time.time()))
print("qflash: 39 hooks applied on sglang 0.5.17: ...", flush=True)

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
        if self.path == "/workers":  # the router's list: the replicas it was given, healthy
            self.wfile.write(json.dumps({"workers": [{"url": u, "is_healthy": True} for u in sys.argv[5:]]}).encode())

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
        if self.path == "/freeze_gc":
            open(os.path.join(pids, f"t-ready-{port}"), "w").write(str(time.time()))
            if extra == "die":
                threading.Timer(1.0, os._exit, (3,)).start()

    def log_message(self, *args):
        pass

if role == "router":
    threading.Timer(float(extra), os._exit, (0,)).start()
http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def free_ports(count: int) -> int:
    """The first of `count` consecutive ports nothing listens on."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count < 65536 and all(socket.socket().connect_ex(("127.0.0.1", p)) != 0 for p in range(base, base + count)):
            return base
    raise RuntimeError("no free ports")


def stub_pids(folder) -> list[int]:
    return [int(p.read_text()) for p in folder.iterdir() if p.name.startswith(("replica-", "router-"))]


def test_every_replica_is_ready_before_the_router_starts_and_the_router_outlives_a_lost_replica(
        tmp_path, monkeypatch, capsys):
    from qflash.server import launcher, replicas
    from qflash.server.cli import parser

    port, pids, started = free_ports(3), tmp_path / "pids", []
    pids.mkdir()
    stub = lambda role, port, extra: [sys.executable, "-c", STUB, role, str(port), str(pids), extra]

    def replica_argv(target, drafter, extra, host, port, **kwargs):
        started.append((port, extra))
        return stub("replica", port, "die" if len(started) == 1 else "")

    def router_argv(urls, host, port, key):
        assert urls == [f"http://127.0.0.1:{p}" for p, _ in started]
        return stub("router", port, "6") + urls

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(launcher, "require_gpu", lambda: None)
    monkeypatch.setattr(launcher, "require_pinned_sglang", lambda: None)
    monkeypatch.setattr(launcher, "dummy_model_dirs", lambda: (tmp_path, tmp_path))
    monkeypatch.setattr(launcher, "sglang_argv", replica_argv)
    monkeypatch.setattr(replicas, "router_argv", router_argv)
    monkeypatch.setattr(replicas, "require_router", lambda: None)
    args = parser("serve").parse_args(["serve", "--replicas", "2", "--share-gpus", "--port", str(port), "--log",
                                       str(tmp_path / "logs" / "server.log")])
    assert launcher.run(args, []) == 1  # the stub router exits after 6 s
    out, err = capsys.readouterr()
    assert [p for p, _ in started] == [port + 1, port + 2]
    assert [extra[extra.index("--mem-fraction-static") + 1] for _, extra in started] == ["0.3", "0.429"]
    assert "qflash: replica 0 ready in" in out and "qflash: replica 1 ready in" in out
    assert f"qflash: 2 replicas ready behind SGLang's router at http://127.0.0.1:{port}" in out
    assert f"qflash: replica 0 (http://127.0.0.1:{port + 1}) exited with code 3; the router serves on with 1" in err
    assert "qflash: the router exited with code 0" in err
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [f"router-{port}.log", f"server-{port + 1}.log",
                                                                    f"server-{port + 2}.log"]
    ready = [float((pids / f"t-ready-{p}").read_text()) for p, _ in started]
    assert float((pids / "t-router").read_text()) > max(ready)  # every replica warmed up before the router started
    assert (pids / f"replica-{port + 2}").stat().st_mtime > ready[0]  # the GPU's second replica after its first
    assert len(stub_pids(pids)) == 3 and all(map(gone, stub_pids(pids)))  # nothing left behind


def test_sigterm_stops_every_replica_and_the_router(tmp_path):
    """What `kill` or `timeout` does to `qflash serve --replicas 2` while it serves."""
    code = f"""
import sys
sys.path.insert(0, {str(os.path.dirname(__file__))!r})
import test_replicas as t
from qflash.server import launcher, replicas
from qflash.server.cli import parser
port, pids = int(sys.argv[1]), sys.argv[2]
stub = lambda role, port, extra: [sys.executable, "-c", t.STUB, role, str(port), pids, extra]
launcher.require_gpu = launcher.require_pinned_sglang = replicas.require_router = lambda: None
launcher.dummy_model_dirs = lambda: (pids, pids)
launcher.sglang_argv = lambda target, drafter, extra, host, port, **kw: stub("replica", port, "")
replicas.router_argv = lambda urls, host, port, key: stub("router", port, "600") + urls
args = parser("serve").parse_args(["serve", "--replicas", "2", "--share-gpus", "--port", str(port), "--log", pids + "/logs/x"])
sys.exit(launcher.run(args, []))
"""
    pids = tmp_path / "pids"
    pids.mkdir()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0"}
    parent = subprocess.Popen([sys.executable, "-c", code, str(free_ports(3)), str(pids)], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        for line in parent.stdout:
            if "replicas ready behind" in line:
                break
        assert len(stub_pids(pids)) == 3
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(timeout=120) == 130
        assert all(map(gone, stub_pids(pids)))  # stop() waits for each process group
    finally:
        parent.kill()


ROUTED = """
import http.server, json, os, sys
port, log = int(sys.argv[1]), sys.argv[2]

class Handler(http.server.BaseHTTPRequestHandler):
    def answer(self, body):
        data = json.dumps(body).encode()
        self.send_response(200); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data))); self.end_headers(); self.wfile.write(data)

    def do_GET(self):
        self.answer({"model_path": "Qwen3.5-4B", "is_generation": True})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with open(log, "a") as f:
            f.write(f"{self.path} {self.headers.get('Authorization')}\\n")
        self.answer({"text": str(port), "meta_info": {}})

    def log_message(self, *args):
        pass

http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


@pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None, reason="needs the scale extra (sglang-router)")
def test_sglang_s_router_with_qflash_s_command_routes_by_prefix_and_outlives_a_replica(tmp_path):
    import requests

    from qflash.server.launcher import ServerProcess, wait_routing
    from qflash.server.replicas import router_argv

    port = free_ports(3)
    urls = [f"http://127.0.0.1:{port + i}" for i in (1, 2)]
    router = ServerProcess(router_argv(urls, "127.0.0.1", port, "k3y"), dict(os.environ), tmp_path / "router.log",
                           f"http://127.0.0.1:{port}", "k3y")
    url, key, workers = f"http://127.0.0.1:{port}/generate", {"Authorization": "Bearer k3y"}, []

    def generate(text, headers=key):
        return requests.post(url, json={"text": text}, headers=headers, timeout=30)

    try:
        router.start().wait_ready(timeout_s=90)
        # The router answers /health before it has taken up its workers (here: before they even listen); the
        # launcher waits until it routes to them all, and then the first request is served.
        workers += [subprocess.Popen([sys.executable, "-c", ROUTED, str(port + i), str(tmp_path / f"w{i}")],
                                     start_new_session=True) for i in (1, 2)]
        wait_routing(router, urls)
        assert generate("first").status_code == 200
        assert generate("no key", headers={}).status_code == 401
        prefix = "a long conversation that every turn of it repeats from the start " * 8
        served = {generate(prefix + f"turn {i}").json()["text"] for i in range(4)}
        assert len(served) == 1, "one conversation's turns reach one replica"
        assert all(line.endswith("Bearer k3y") for w in (0, 1) if (tmp_path / f"w{w}").exists()
                   for line in (tmp_path / f"w{w}").read_text().splitlines())
        os.killpg(workers[int(served.pop()) - port - 1].pid, signal.SIGKILL)
        answers = [generate(prefix + f"after {i}") for i in range(4)]
        assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]  # retried on the live one
    finally:
        router.stop()
        for p in workers:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
