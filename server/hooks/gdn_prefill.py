"""Gated-DeltaNet prefill: short prompts as one recurrent kernel, longer ones on SGLang's chunks with a tile by length.

SGLang prefills each GDN layer with FLA's chunked kernels, launched eagerly between the prefill graph's pieces:
their host launch time per layer does not shrink with the prompt, so a short prompt waits on launches. Prompts
up to kernels/gdn_prefill.MAX_TOKENS (all requests of the batch together) take qflash's one-launch recurrent
prefill, which keeps the chunked path's contract (state in place, output, chunk states for the prefix cache);
prefills that checkpoint intermediate states (`num_state_checkpoints`) stay on SGLang's path.
Longer prefills run the chunks, whose state pass (`chunk_gated_delta_rule_fwd_h`, a walk over the prompt's 64-token
chunks) has one tile for every length; it gets the tile measured fastest for the prefill's length
(`STATE_PASS_TILES`), unless SGLang's own knobs for that tile (`SGLANG_GDN_CHUNK_H_*`) are set. A fresh prompt's
whole prefill graph (server/hooks/fresh_prefill.py) calls the chunks itself and takes the tile here too.
Retire when SGLang's GDN prefill launches in a CUDA graph or a single kernel, and FLA's state pass picks its tile by
length (its autotune key already holds the length's bucket; one config per bucket would do).
"""

import functools
import os

from qflash.server.hooks import Hook

# FLA's state pass at Qwen3.5-4B's shapes on an H100, alone (BENCHMARKS.md, 2026-12-06, forty-seventh session, call 3):
# SGLang's tile (BV 32, 4 warps, 2 stages) takes 83.0 us a layer at 2,048 tokens and 302.2 at 8,192; BV 16 with 3
# stages 61.4 at 2,048, BV 32 with 3 stages 180.1 at 8,192. Up to SHORT_TOKENS (FLA's own first length bucket: 32
# chunks) the short tile, beyond it the long one.
SHORT_TOKENS = 2048
STATE_PASS_TILES = {"short": dict(BV=16, num_warps=4, num_stages=3), "long": dict(BV=32, num_warps=4, num_stages=3)}
# a user's own knobs for SGLang's tile: any set keeps it
USER_TILE = any(knob in os.environ for knob in ("SGLANG_GDN_CHUNK_H_BV", "SGLANG_GDN_CHUNK_H_NUM_WARPS",
                                                "SGLANG_GDN_CHUNK_H_NUM_STAGES"))


def _gdn_prefill(original, self, q, k, v, g, beta, **kwargs):
    from qflash.kernels import gdn_prefill

    tokens = q.shape[1]
    if gdn_prefill.serves(tokens) and not kwargs.get("num_state_checkpoints"):
        return gdn_prefill.prefill(q, k, v, g, beta, kwargs["ssm_states"], kwargs["cache_indices"],
                                   kwargs["query_start_loc"])
    take_state_pass_tile(tokens)
    return original(self, q, k, v, g, beta, **kwargs)


def take_state_pass_tile(tokens: int) -> None:
    """Give FLA's state pass the tile of a `tokens`-long prefill, unless a user set SGLang's knobs for it."""
    if not USER_TILE:
        from sglang.kernels.ops.attention.fla import chunk_delta_h

        # The state pass's autotuner runs its only config as it is (no timing runs, which would update the state pool
        # in place more than once): that config is the tile.
        chunk_delta_h.chunk_gated_delta_rule_fwd_kernel_h_blockdim64.configs = [
            _state_pass_config("short" if tokens <= SHORT_TOKENS else "long")]


@functools.cache
def _state_pass_config(length: str):
    import triton

    tile = dict(STATE_PASS_TILES[length])
    return triton.Config({"BV": tile.pop("BV")}, **tile)


CHANGES = [Hook("sglang.srt.layers.attention.linear.kernels.gdn_triton.TritonGDNKernel.extend", _gdn_prefill, "AROUND")]
