"""`qflash eval`: the quality gates, run by lm-evaluation-harness against a running server's OpenAI API.

lm-eval (the `lm-eval` package) does all of the evaluation: it loads each task's dataset, prompts the
server through `/v1/chat/completions` (model `local-chat-completions`, the chat template applied by the
server), filters the answers and scores them. qflash only picks the tasks and metrics and compares them
with the gates:

- MMLU-Pro: `mmlu_pro` (5-shot chain of thought, the answer letter extracted), `exact_match,custom-extract`.
- IFEval: `ifeval`, `prompt_level_strict_acc,none`: the share of prompts whose every instruction is
  followed, checked strictly (the loose variant forgives formatting such as markdown around the answer).
- GPQA-Diamond: `gpqa_diamond_cot_zeroshot`, `exact_match,flexible-extract`: zero-shot chain of thought
  over the chat endpoint (the log-likelihood variants need a completions endpoint with prompt logprobs,
  which DFLASH does not return); the last "(A)".."(D)" in the answer is taken.
"""

import json
import os
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Gate:
    task: str
    metric: str
    threshold: float


GATES = {
    "mmlu_pro": Gate("mmlu_pro", "exact_match,custom-extract", 0.621),
    "ifeval": Gate("ifeval", "prompt_level_strict_acc,none", 0.814),
    "gpqa_diamond": Gate("gpqa_diamond_cot_zeroshot", "exact_match,flexible-extract", 0.630),
}
OFFLINE = 2  # exit code when a dataset or the server cannot be reached


class EvalError(RuntimeError):
    pass


def parse_gate(text: str) -> Gate:
    """`TASK:METRIC=THRESHOLD` (METRIC as lm-eval reports it, e.g. `exact_match,none`) for a custom task."""
    task, sep, rest = text.partition(":")
    metric, eq, value = rest.rpartition("=")
    if not (sep and eq and task and metric):
        raise ValueError(f"expected TASK:METRIC=THRESHOLD, got {text!r}")
    return Gate(task, metric, float(value))


def served_model(base_url: str, api_key: str | None = None) -> str:
    """The model the server serves (its `/v1/models`); raise EvalError if it does not answer."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(base_url.rstrip("/") + "/v1/models", headers=headers), timeout=30) as resp:
            return json.load(resp)["data"][0]["id"]
    except (urllib.error.URLError, OSError, KeyError, IndexError, ValueError) as exc:
        raise EvalError(f"no OpenAI server answers at {base_url} ({exc})") from exc


def load_tasks(tasks: list[str], include_path: Path | None):
    """lm-eval's TaskManager, after loading every task's dataset once (lm-eval caches it for the run);
    raise EvalError with the reason when a dataset cannot be fetched or a task's extras are missing."""
    from lm_eval.tasks import TaskManager, get_task_dict

    manager = TaskManager(include_path=str(include_path) if include_path else None)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise EvalError(f"lm-eval knows no task {', '.join(unknown)}")
    try:
        get_task_dict(tasks, manager)
    except Exception as exc:  # datasets, huggingface_hub and import errors have no common base
        raise EvalError(
            f"could not load the datasets of {', '.join(tasks)}: {type(exc).__name__}: {exc}\n"
            "The gates need the Hugging Face hub (GPQA is gated: accept its terms and set HF_TOKEN) and "
            "lm-eval's task extras (pip install 'lm-eval[ifeval]')."
        ) from exc
    return manager


def results_table(gates: list[Gate], results: dict) -> tuple[str, bool]:
    """The pass/fail table of `gates` over lm-eval's `results["results"]`, and whether every gate passed."""
    lines = ["| task | metric | score | gate | result |", "| --- | --- | ---: | ---: | --- |"]
    passed = True
    for gate in gates:
        score = results.get(gate.task, {}).get(gate.metric)
        ok = score is not None and score >= gate.threshold
        passed &= ok
        shown = "missing" if score is None else f"{score:.4f}"
        lines.append(f"| {gate.task} | {gate.metric} | {shown} | >= {gate.threshold} | {'pass' if ok else 'FAIL'} |")
    return "\n".join(lines), passed


def run_eval(base_url: str, tasks: list[str], limit: float | None, output: Path | None, include_path: Path | None,
             extra_gates: list[Gate], num_concurrent: int, gen_kwargs: str | None, api_key: str | None = None) -> int:
    """Evaluate the server on the gated tasks (names from GATES, or lm-eval task names with their own
    gates); print the table; 0 if every gate passed, 1 if one failed, 2 if it could not run."""
    try:
        import lm_eval
    except ImportError:
        print("qflash eval: needs lm-evaluation-harness: pip install 'lm-eval[api,ifeval]'", file=sys.stderr)
        return OFFLINE
    gates = [GATES[t] if t in GATES else None for t in tasks]
    custom = {g.task: g for g in extra_gates}
    gates = [g or custom.get(t) for g, t in zip(gates, tasks)]
    missing = [t for g, t in zip(gates, tasks) if g is None]
    if missing:
        print(f"qflash eval: no gate for {', '.join(missing)}; give --threshold TASK:METRIC=VALUE", file=sys.stderr)
        return OFFLINE
    names = [g.task for g in gates]
    try:
        model = served_model(base_url, api_key)
        manager = load_tasks(names, include_path)
    except EvalError as exc:
        print(f"qflash eval: {exc}", file=sys.stderr)
        return OFFLINE
    if api_key:
        os.environ["OPENAI_API_KEY"] = api_key  # where lm-eval's API models read their bearer key
    out = lm_eval.simple_evaluate(
        model="local-chat-completions",
        model_args={"model": model, "base_url": base_url.rstrip("/") + "/v1/chat/completions",
                    "num_concurrent": num_concurrent, "max_retries": 1, "timeout": 600},
        tasks=names, task_manager=manager, limit=limit, apply_chat_template=True, fewshot_as_multiturn=True,
        gen_kwargs=gen_kwargs, log_samples=False,
    )
    table, passed = results_table(gates, out["results"])
    print(table)
    if output:
        Path(output).write_text(json.dumps({"model": model, "base_url": base_url, "limit": limit, "passed": passed,
                                            "gates": [g.__dict__ for g in gates], "results": out["results"]},
                                           indent=2, default=str))
    return 0 if passed else 1


def add_arguments(p) -> None:
    p.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:30000")
    p.add_argument("--tasks", type=lambda s: s.split(","), default=list(GATES),
                   help=f"comma list: gated tasks ({','.join(GATES)}, the default) or lm-eval task names")
    p.add_argument("--limit", type=float, help="examples per task (lm-eval's --limit; a fraction if < 1)")
    p.add_argument("--output", type=Path, help="write the scores and gates here as JSON")
    p.add_argument("--include-path", type=Path, help="a folder of extra lm-eval task YAMLs")
    p.add_argument("--threshold", type=parse_gate, action="append", default=[], metavar="TASK:METRIC=VALUE",
                   help="the gate of a task not in the default set (repeatable)")
    p.add_argument("--num-concurrent", type=int, default=16, help="requests in flight (default 16)")
    p.add_argument("--gen-kwargs", help="lm-eval generation overrides for every task, e.g. max_gen_toks=4096")
    p.add_argument("--api-key", default=os.environ.get("QFLASH_API_KEY"),
                   help="the server's API key, if it has one (default: $QFLASH_API_KEY)")


def run(args, extra) -> int:
    return run_eval(args.base_url, args.tasks, args.limit, args.output, args.include_path, args.threshold,
                    args.num_concurrent, args.gen_kwargs, args.api_key)
