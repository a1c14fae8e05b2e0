"""The unoptimized baseline of the benchmark: Hugging Face transformers eager bf16 `generate`.

Same architecture as the served target, random weights, torch reference kernels for Gated-DeltaNet.
Run as a child process by `qflash bench`; it times its own requests and prints one JSON line each.
"""

import argparse
import sys
import time

import orjson
import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from qflash.server.preset import TEXT_CONFIG


class _FirstTokenClock:
    """A `generate` streamer that notes when the first new token arrives (the first put is the prompt)."""

    def __init__(self):
        self.puts, self.first_token_at = 0, None

    def put(self, value):
        self.puts += 1
        if self.puts == 2:
            torch.cuda.synchronize()
            self.first_token_at = time.perf_counter()

    def end(self):
        pass


def build_model() -> Qwen3_5ForCausalLM:
    config = Qwen3_5TextConfig(**TEXT_CONFIG)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    with torch.device("cuda"):
        torch.set_default_dtype(torch.bfloat16)
        model = Qwen3_5ForCausalLM(config)
        torch.set_default_dtype(torch.float32)
    return model.eval()


@torch.inference_mode()
def timed_generate(model, input_ids: list[int], output_len: int) -> dict:
    ids = torch.tensor([input_ids], device="cuda")
    clock = _FirstTokenClock()
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len, min_new_tokens=output_len,
        do_sample=False, streamer=clock,
    )
    torch.cuda.synchronize()
    end = time.perf_counter()
    return {
        "latency_ms": (end - start) * 1e3,
        "ttft_ms": (clock.first_token_at - start) * 1e3,
        "output_tokens": out.shape[1] - ids.shape[1],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qflash.server.baseline")
    p.add_argument("--requests", required=True, help="JSON list of {bucket, index, input_ids, warmup}")
    p.add_argument("--output-len", type=int, required=True)
    args = p.parse_args(argv)
    with open(args.requests, "rb") as f:
        requests = orjson.loads(f.read())
    model = build_model()
    print(orjson.dumps({"ready": True}).decode(), flush=True)
    for req in requests:
        sample = timed_generate(model, req["input_ids"], args.output_len)
        print(orjson.dumps({"bucket": req["bucket"], "warmup": req["warmup"], **sample}).decode(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
