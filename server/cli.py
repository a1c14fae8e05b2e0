"""The `qflash` command. Each subcommand lives in its own module (its `add_arguments` and `run`), imported only
when that subcommand runs, so `qflash serve` never loads a measurement tool and `--help` answers at once."""

import argparse
import importlib
import sys

from qflash.server.errors import UserError

# name: (module, one line of help). (GPU) marks the subcommands that need a CUDA GPU.
COMMANDS = {
    "serve": ("qflash.server.launcher", "start the server (GPU); flags it does not know go to sglang.launch_server"),
    "make-dummy": ("qflash.server.dummy", "write an offline Qwen3.5-4B + DFlash model: configs, tokenizer, optional random or stable-choice weights"),
    "quantize": ("qflash.quant.quantize", "a Qwen3.5 checkpoint to qflash's W8A8 body + W8A16 lm_head text checkpoint"),
    "quality": ("qflash.server.tools.quality", "relative error of hidden states and logits, W8A8 checkpoint vs its bf16 source"),
    "bench": ("qflash.server.tools.bench", "latency scoreboard against stock SGLang (GPU); other flags go to every SGLang system"),
    "profile": ("qflash.server.tools.profile", "GPU time of one speculative cycle by kernel family and launch (GPU)"),
    "bench-kernels": ("qflash.server.tools.bench_kernels", "qflash's kernels against cuBLAS, torch and SGLang's (GPU)"),
    "tune": ("qflash.server.tools.tune", "time candidate launch configs, rewrite the kernels' static tables (GPU)"),
    "eval": ("qflash.server.tools.eval", "quality gates: lm-evaluation-harness against a server's OpenAI API"),
}


def parser(command: str | None) -> argparse.ArgumentParser:
    """The CLI's parser, with the arguments of `command` alone (its module imported) and the others' help lines."""
    p = argparse.ArgumentParser(prog="qflash", description="Qwen3.5-4B + DFlash on SGLang, as fast as one GPU allows.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_line) in COMMANDS.items():
        s = sub.add_parser(name, help=help_line, description=help_line)
        if name == command:
            module = importlib.import_module(module_name)
            module.add_arguments(s)
            s.set_defaults(run=module.run, passthrough=getattr(module, "PASSTHROUGH", False))
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    p = parser(command if command in COMMANDS else None)
    args, extra = p.parse_known_args(argv)
    if extra and not args.passthrough:
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.run(args, extra)
    except UserError as exc:
        print(f"qflash {args.command}: {exc}", file=sys.stderr)
        return exc.code


if __name__ == "__main__":
    sys.exit(main())
