"""The `qflash` command: serve, make-dummy, quantize, quality, bench, profile, bench-kernels, eval."""

import argparse
import sys
from pathlib import Path

from qflash.server.preset import HOST, PORT, PREFIX_CACHE


def _serve(args: argparse.Namespace, extra: list[str]) -> int:
    from qflash.server.launcher import DEFAULT_CACHE, serve

    log = args.log or DEFAULT_CACHE / "logs" / f"server-{args.port}.log"
    return serve(args.model_path, args.draft_model_path, extra, args.host, args.port, log, args.dry_run, args.prefix_cache)


def _make_dummy(args: argparse.Namespace, extra: list[str]) -> int:
    from qflash.server.dummy import make_dummy

    target, drafter = make_dummy(args.dir, weights=args.weights)
    print(f"target:  {target}\ndrafter: {drafter}")
    return 0


def _quantize(args: argparse.Namespace, extra: list[str]) -> int:
    from qflash.quant.quantize import CheckpointError, quantize_checkpoint

    try:
        ids = None
        if args.smooth:
            from transformers import AutoTokenizer

            text = args.smooth.read_text()
            ids = AutoTokenizer.from_pretrained(args.src)(text, return_tensors="pt").input_ids[0, :args.calibration_tokens]
        print(f"wrote {quantize_checkpoint(args.src, args.dst, args.force, ids, args.alpha, args.device)}")
        return 0
    except CheckpointError as exc:
        print(f"qflash quantize: {exc}", file=sys.stderr)
        return 2


def _quality(args: argparse.Namespace, extra: list[str]) -> int:
    import json

    from qflash.quant.quality import compare

    print(json.dumps(compare(args.bf16, args.w8a8, args.positions, args.device), indent=2))
    return 0


def _bench(args: argparse.Namespace, extra: list[str]) -> int:
    from qflash.server.bench import run_bench

    return run_bench(args.systems, args.out, args.buckets, args.timed, args.acc_len, extra, profile_steps=args.profile_steps,
                     prefix_cache=args.prefix_cache, profile_with_stack=args.profile_with_stack,
                     profile_prefill=args.profile_prefill)


def _profile(args: argparse.Namespace, extra: list[str]) -> int:
    from qflash.server.profile import run_profile

    return run_profile(args.system, args.out, args.prompt_len, args.steps, args.acc_len, extra, prefill=args.prefill,
                       with_stack=args.with_stack, prefix_cache=args.prefix_cache)


def _bench_kernels(args: argparse.Namespace, extra: list[str]) -> int:
    from qflash.kernels.bench import run_bench_kernels

    return run_bench_kernels(args.out, skip_gemms=args.skip_gemms)


def _eval(args: argparse.Namespace, extra: list[str]) -> int:
    from qflash.server.eval import run_eval

    return run_eval(args.base_url, args.tasks, args.limit, args.output, args.include_path, args.threshold,
                    args.num_concurrent, args.gen_kwargs)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qflash", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="start the server (other flags go to sglang.launch_server)")
    s.add_argument("--model-path", type=Path, help="Qwen3.5-4B checkpoint directory (default: the dummy model)")
    s.add_argument("--draft-model-path", type=Path, help="Qwen3.5-4B-DFlash drafter directory")
    s.add_argument("--host", default=HOST)
    s.add_argument("--port", type=int, default=PORT)
    s.add_argument("--log", type=Path, help="server log file")
    s.add_argument("--dry-run", action="store_true", help="print the SGLang command and exit")
    s.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=PREFIX_CACHE,
                   help="SGLang's radix cache with qflash's DFLASH fixes (default: on)")
    s.set_defaults(func=_serve, passthrough=True)

    d = sub.add_parser("make-dummy", help="write an offline Qwen3.5-4B + DFlash model (config + tokenizer)")
    d.add_argument("dir", type=Path)
    d.add_argument("--weights", action="store_true", help="also write random bf16 target weights (~9.3 GB)")
    d.set_defaults(func=_make_dummy, passthrough=False)

    q = sub.add_parser("quantize", help="Qwen3.5 checkpoint -> W8A8 body + W8A16 lm_head text checkpoint")
    q.add_argument("src", type=Path)
    q.add_argument("dst", type=Path)
    q.add_argument("--force", action="store_true", help="overwrite DST if it exists")
    q.add_argument("--smooth", type=Path, metavar="CALIB.txt", help="SmoothQuant from this calibration text first")
    q.add_argument("--alpha", type=float, default=0.5, help="SmoothQuant migration strength (default 0.5)")
    q.add_argument("--calibration-tokens", type=int, default=512, help="tokens of the text to use (default 512)")
    q.add_argument("--device", default="cpu", help="where the calibration forward runs (cpu or cuda)")
    q.set_defaults(func=_quantize, passthrough=False)

    r = sub.add_parser("quality", help="relative error of hidden states and logits, W8A8 checkpoint vs its bf16 source")
    r.add_argument("bf16", type=Path, help="the bf16 checkpoint that was quantized")
    r.add_argument("w8a8", type=Path, help="its `qflash quantize` output")
    r.add_argument("--positions", type=int, default=256)
    r.add_argument("--device", default="cpu")
    r.set_defaults(func=_quality, passthrough=False)

    from qflash.server.bench import add_bench_args

    b = sub.add_parser("bench", help="latency scoreboard: each system started, measured and stopped in turn "
                       "(other flags go to every SGLang system, for trials)")
    add_bench_args(b)
    b.set_defaults(func=_bench, passthrough=True)

    from qflash.server.bench import ACCEPT_LEN, SGLANG_SYSTEMS

    from qflash.server.bench import positive_csv

    f = sub.add_parser("profile", help="GPU time of one speculative cycle by kernel family and launch (SGLang's "
                       "profiler); other flags go to the SGLang server")
    f.add_argument("--system", choices=list(SGLANG_SYSTEMS), default="qflash")
    f.add_argument("--prompt-len", type=positive_csv, default=[2048], help="comma list of prompt lengths (one server)")
    f.add_argument("--steps", type=int, default=10, help="cycles to record (default 10)")
    f.add_argument("--prefill", action="store_true", help="record the request's first steps (its prefill) instead")
    f.add_argument("--acc-len", type=float, default=ACCEPT_LEN, help="SGLANG_SIMULATE_ACC_LEN (default 6.5)")
    f.add_argument("--with-stack", action="store_true", help="also record Python call stacks (host time, inflated)")
    f.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=PREFIX_CACHE,
                   help="qflash's prefix caching, as `qflash serve` has it (default: on)")
    f.add_argument("--out", type=Path, required=True, help="folder for the trace, profile.md and profile.json")
    f.set_defaults(func=_profile, passthrough=True)

    k = sub.add_parser("bench-kernels", help="qflash GEMMs vs cuBLAS bf16, torch._int_mm and SGLang int8, and the GDN "
                                             "verify, fold and prefill and the prefill attention vs SGLang's (GPU)")
    k.add_argument("--out", type=Path, required=True, help="folder for kernels.md and kernels.json")
    k.add_argument("--skip-gemms", action="store_true",
                   help="all but the GEMM and lm_head tables: GDN verify, fold and prefill, prefill attention")
    k.set_defaults(func=_bench_kernels, passthrough=False)

    from qflash.server.eval import GATES, parse_gate

    e = sub.add_parser("eval", help="quality gates: lm-evaluation-harness against a server's OpenAI API, "
                       "pass/fail per task (exit 1 on a fail, 2 if datasets or server cannot be reached)")
    e.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:30000")
    e.add_argument("--tasks", type=lambda s: s.split(","), default=list(GATES),
                   help=f"comma list: gated tasks ({','.join(GATES)}, the default) or lm-eval task names")
    e.add_argument("--limit", type=float, help="examples per task (lm-eval's --limit; a fraction if < 1)")
    e.add_argument("--output", type=Path, help="write the scores and gates here as JSON")
    e.add_argument("--include-path", type=Path, help="a folder of extra lm-eval task YAMLs")
    e.add_argument("--threshold", type=parse_gate, action="append", default=[], metavar="TASK:METRIC=VALUE",
                   help="the gate of a task not in the default set (repeatable)")
    e.add_argument("--num-concurrent", type=int, default=16, help="requests in flight (default 16)")
    e.add_argument("--gen-kwargs", help="lm-eval generation overrides for every task, e.g. max_gen_toks=4096")
    e.set_defaults(func=_eval, passthrough=False)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args, extra = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    if extra and not args.passthrough:
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    return args.func(args, extra)


if __name__ == "__main__":
    sys.exit(main())
