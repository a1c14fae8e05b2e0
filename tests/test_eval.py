"""`qflash eval`: gates, table, CLI, the offline failure, and lm-eval's plumbing against a local stub.

The stub is a minimal OpenAI chat server on this machine answering the tiny local task (tests/data/eval);
it checks that qflash drives the real lm-eval (task loading, chat requests, filtering, scoring) end to end.
It is not the server path: tests/test_eval_gpu.py runs the same command against the served model.
"""

import contextlib
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import REPO
from qflash.server.tools.eval import GATES, Gate, parse_gate, results_table

TINY = REPO / "tests" / "data" / "eval"
ANSWERS = {json.loads(line)["question"]: json.loads(line)["answer"] for line in (TINY / "qflash_tiny.jsonl").open()}
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def test_the_three_gates():
    assert GATES["mmlu_pro"] == Gate("mmlu_pro", "exact_match,custom-extract", 0.621)
    assert GATES["ifeval"] == Gate("ifeval", "prompt_level_strict_acc,none", 0.814)
    assert GATES["gpqa_diamond"] == Gate("gpqa_diamond_cot_zeroshot", "exact_match,flexible-extract", 0.630)
    assert parse_gate("qflash_tiny:exact_match,none=0.75") == Gate("qflash_tiny", "exact_match,none", 0.75)
    with pytest.raises(ValueError):
        parse_gate("qflash_tiny=0.5")


def test_table_passes_only_when_every_gate_is_met():
    gates = list(GATES.values())
    scores = {"mmlu_pro": {"exact_match,custom-extract": 0.65}, "ifeval": {"prompt_level_strict_acc,none": 0.814},
              "gpqa_diamond_cot_zeroshot": {"exact_match,flexible-extract": 0.70}}
    table, passed = results_table(gates, scores)
    assert passed and table.count("| pass |") == 3 and "0.8140" in table
    scores["ifeval"]["prompt_level_strict_acc,none"] = 0.8139
    table, passed = results_table(gates, scores)
    assert not passed and "| ifeval | prompt_level_strict_acc,none | 0.8139 | >= 0.814 | FAIL |" in table
    assert not results_table(gates, {})[1]  # a missing score fails


class Stub(BaseHTTPRequestHandler):
    """`/v1/models` and `/v1/chat/completions`: the tiny task's answer (or a wrong one) to its question."""

    right = True

    def _send(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send({"object": "list", "data": [{"id": "stub-model", "object": "model"}]})

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert request["model"] == "stub-model" and request["temperature"] == 0
        answer = ANSWERS.get(request["messages"][-1]["content"].strip(), "?") if self.right else "no idea"
        self._send({"id": "x", "object": "chat.completion", "model": "stub-model",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def stub(right: bool):
    handler = type("Handler", (Stub,), {"right": right})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def qflash_eval(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qflash.server.cli", "eval", *args], capture_output=True, text=True,
                          timeout=600, env={**os.environ, **OFFLINE_ENV})


TINY_ARGS = ["--tasks", "qflash_tiny", "--include-path", str(TINY), "--threshold", "qflash_tiny:exact_match,none=0.75"]


@pytest.mark.parametrize("right", [True, False])
def test_lm_eval_runs_the_tiny_local_task_through_the_chat_api(tmp_path, right):
    with stub(right) as url:
        result = qflash_eval("--base-url", url, *TINY_ARGS, "--output", str(tmp_path / "eval.json"))
    assert result.returncode == (0 if right else 1), result.stdout + result.stderr[-3000:]
    score = 1.0 if right else 0.0
    assert f"| qflash_tiny | exact_match,none | {score:.4f} | >= 0.75 | {'pass' if right else 'FAIL'} |" in result.stdout
    saved = json.loads((tmp_path / "eval.json").read_text())
    assert saved["model"] == "stub-model" and saved["results"]["qflash_tiny"]["exact_match,none"] == score


def test_offline_datasets_fail_with_a_clear_message():
    with stub(True) as url:
        result = qflash_eval("--base-url", url, "--limit", "2")
    assert result.returncode == 2, result.stdout + result.stderr[-3000:]
    assert "qflash eval: could not load the datasets of mmlu_pro, ifeval, gpqa_diamond_cot_zeroshot" in result.stderr
    assert "Traceback" not in result.stderr


def test_an_absent_server_or_gate_is_a_clear_message():
    result = qflash_eval("--base-url", "http://127.0.0.1:9", *TINY_ARGS)
    assert result.returncode == 2 and "qflash eval: no OpenAI server answers at http://127.0.0.1:9" in result.stderr
    result = qflash_eval("--base-url", "http://127.0.0.1:9", "--tasks", "qflash_tiny")
    assert result.returncode == 2 and "no gate for qflash_tiny" in result.stderr
