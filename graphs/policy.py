"""Which shapes get CUDA graphs, derived from the speculative block and the served batch limit.

A DFlash cycle runs two fixed-shape forwards per running request: the draft (one block of K tokens) and
the target verify (the same K tokens), so every batch size the server admits gets a graph of
`bs * K` tokens; nothing in decoding is ever padded to a larger batch. Prefill runs SGLang's
piecewise ("breakable") graphs in token buckets that are multiples of K, dense where prompts are short
(padding is a large share of a short prompt) and at most 1/8 padding above 4,096 tokens, up to the
chunked-prefill size (longer prompts are prefilled in chunks of that size).
"""

# (bucket upper bound, step between buckets up to it); every step is a multiple of the block size 16.
PREFILL_STEPS = ((256, 16), (1024, 64), (4096, 256), (1 << 30, 512))
# Buckets up to this many tokens also get a fresh prompt's prefill as one graph (graphs/fresh_prefill.py): up to
# here the host's per-layer work outlasts the GPU's (BENCHMARKS.md); beyond, the GPU bounds the prefill anyway.
FRESH_PREFILL_MAX_TOKENS = 2048


def decode_batch_sizes(max_running_requests: int) -> list[int]:
    """Every batch size the server admits: verify and draft graphs of bs x K tokens."""
    return list(range(1, max_running_requests + 1))


def prefill_token_buckets(block_size: int, chunked_prefill_size: int) -> list[int]:
    """Token counts with a piecewise prefill graph: multiples of the block size, up to the chunk size."""
    if chunked_prefill_size % block_size:
        raise ValueError(f"chunked prefill size {chunked_prefill_size} is not a multiple of the block size {block_size}")
    sizes, size = [], 0
    for bound, step in PREFILL_STEPS:
        step = max(block_size, step // block_size * block_size)
        while size + step <= min(bound, chunked_prefill_size):
            size += step
            sizes.append(size)
    if sizes[-1] != chunked_prefill_size:
        sizes.append(chunked_prefill_size)
    return sizes


def graph_flags(block_size: int, max_running_requests: int, chunked_prefill_size: int) -> list[str]:
    """SGLang flags that capture exactly these graphs."""
    return [
        "--chunked-prefill-size", str(chunked_prefill_size),
        "--cuda-graph-bs-decode", *map(str, decode_batch_sizes(max_running_requests)),
        "--cuda-graph-bs-prefill", *map(str, prefill_token_buckets(block_size, chunked_prefill_size)),
    ]
