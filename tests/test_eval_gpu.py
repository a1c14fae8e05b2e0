"""`qflash eval --base-url` against the served dummy model, on the tiny local task (GPU only).

The plumbing of the quality gates on the real server path: lm-eval loads the local task, sends its
prompts through the server's `/v1/chat/completions` and scores the answers (a random model's answers,
so the gate is 0). The offline GPU machine lacks lm-eval: tests/run_gpu.sh installs it with EVAL_DEPS=1
(tests/install_eval_deps.sh) and names the folder in QFLASH_EVAL_SITE, which only this command sees.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO, SERVED as BASE, SERVED_KEY

SITE = os.environ.get("QFLASH_EVAL_SITE")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
       **({"PYTHONPATH": os.pathsep.join(filter(None, [SITE, os.environ.get("PYTHONPATH")]))} if SITE else {})}


def has_lm_eval() -> bool:
    return subprocess.run([sys.executable, "-c", "import lm_eval"], env=ENV, capture_output=True).returncode == 0


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(torch.cuda.is_available() and not has_lm_eval(),
                                 reason="lm-eval is not installed (offline GPU machine: tests/run_gpu.sh with EVAL_DEPS=1)")]


@pytest.fixture(scope="module")
def server(served):
    """`./launch.sh` with no arguments (conftest.served)."""
    return served


def qflash_eval(threshold: float, out) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qflash.server.cli", "eval", "--base-url", BASE, "--tasks", "qflash_tiny",
         "--include-path", str(REPO / "tests" / "data" / "eval"), "--threshold", f"qflash_tiny:exact_match,none={threshold}",
         "--output", str(out), "--api-key", SERVED_KEY], capture_output=True, text=True, timeout=300, env=ENV)


def test_qflash_eval_runs_lm_eval_against_the_server_and_gates_on_its_score(server, tmp_path):
    out = tmp_path / "eval.json"
    result = qflash_eval(0, out)
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    saved = json.loads(out.read_text())
    assert saved["model"] == "Qwen3.5-4B" and saved["passed"]
    score = saved["results"]["qflash_tiny"]["exact_match,none"]
    assert "| qflash_tiny | exact_match,none |" in result.stdout
    # the same run gated just above the score it got must fail, with exit status 1
    above = qflash_eval(score + 0.01, tmp_path / "above.json")
    assert above.returncode == 1, above.stdout + above.stderr[-3000:]
    assert not json.loads((tmp_path / "above.json").read_text())["passed"] and "FAIL" in above.stdout
