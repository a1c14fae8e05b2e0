"""The one place qflash's model facts and serving flags live: Qwen3.5-4B + z-lab DFlash drafter, K=16.

Values are those of the published checkpoints (see shared/reference/qwen35-4b-dflash-facts.md);
every 4B value is written out because the library defaults are the 9B shapes.
"""

from qflash.graphs.policy import graph_flags
from qflash.quant.layout import METHOD_NAME

TARGET_ARCH = "Qwen3_5ForConditionalGeneration"
VOCAB_SIZE = 248320
HIDDEN_SIZE = 2560
NUM_LAYERS = 32
FULL_ATTENTION_INTERVAL = 4

# Special tokens of the Qwen3.5 tokenizer, at their real ids.
EOS_TOKEN_ID = 248044
SPECIAL_TOKENS = {"<|endoftext|>": 248044, "<|im_start|>": 248045, "<|im_end|>": 248046}

BLOCK_SIZE = 16
MASK_TOKEN_ID = 248077
TARGET_LAYER_IDS = [1, 5, 9, 13, 17, 21, 25, 29]

TEXT_CONFIG = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_output_gate": True,
    "bos_token_id": None,
    "dtype": "bfloat16",
    "eos_token_id": EOS_TOKEN_ID,
    "full_attention_interval": FULL_ATTENTION_INTERVAL,
    "head_dim": 256,
    "hidden_act": "silu",
    "hidden_size": HIDDEN_SIZE,
    "initializer_range": 0.02,
    "intermediate_size": 9216,
    "layer_types": [
        "full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
        for i in range(NUM_LAYERS)
    ],
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "mamba_ssm_dtype": "float32",
    "max_position_embeddings": 262144,
    "mlp_only_layers": [],
    "model_type": "qwen3_5_text",
    "mtp_num_hidden_layers": 1,
    "mtp_use_dedicated_embeddings": False,
    "num_attention_heads": 16,
    "num_hidden_layers": NUM_LAYERS,
    "num_key_value_heads": 4,
    "pad_token_id": None,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {
        "mrope_interleaved": True,
        "mrope_section": [11, 11, 10],
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000000,
        "rope_type": "default",
    },
    "tie_word_embeddings": True,
    "use_cache": True,
    "vocab_size": VOCAB_SIZE,
}

TARGET_CONFIG = {
    "architectures": [TARGET_ARCH],
    "image_token_id": 248056,
    "model_type": "qwen3_5",
    "text_config": TEXT_CONFIG,
    "tie_word_embeddings": True,
    "video_token_id": 248057,
    "vision_config": {
        "deepstack_visual_indexes": [],
        "depth": 24,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1024,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": 4096,
        "model_type": "qwen3_5_vision",
        "num_heads": 16,
        "num_position_embeddings": 2304,
        "out_hidden_size": HIDDEN_SIZE,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
    "vision_end_token_id": 248054,
    "vision_start_token_id": 248053,
}

DRAFTER_CONFIG = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "dflash_config": {
        "block_size": BLOCK_SIZE,
        "mask_token_id": MASK_TOKEN_ID,
        "target_layer_ids": TARGET_LAYER_IDS,
    },
    "hidden_size": HIDDEN_SIZE,
    "intermediate_size": 9216,
    "num_hidden_layers": 6,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    "sliding_window": 4096,
    "use_sliding_window": True,
    "max_window_layers": 6,
    "num_target_layers": NUM_LAYERS,
    "rope_parameters": {"rope_theta": 10000000, "rope_type": "default"},
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-06,
    "vocab_size": VOCAB_SIZE,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "hidden_act": "silu",
    "dtype": "bfloat16",
    "eos_token_id": EOS_TOKEN_ID,
}

# Context length served by default: the benchmark's longest prompt plus room for answers.
CONTEXT_LENGTH = 16384
MAX_RUNNING_REQUESTS = 8
MEM_FRACTION_STATIC = 0.6  # of the GPU's memory for weights and KV cache; replicas sharing a GPU split it
CHUNKED_PREFILL_SIZE = 8192  # SGLang's own default on an H200; fixed here so the graph buckets end on it

# SGLang flags every DFlash system shares; they match the stock runs of the benchmark protocol.
# fa3 is not in the GPU machine's offline bundle, so attention is triton; sampling stays in torch.
DFLASH_FLAGS = [
    "--speculative-algorithm", "DFLASH",
    "--speculative-dflash-block-size", str(BLOCK_SIZE),
    "--attention-backend", "triton",
    "--sampling-backend", "pytorch",
    "--max-running-requests", str(MAX_RUNNING_REQUESTS),
    "--mem-fraction-static", str(MEM_FRACTION_STATIC),
    "--context-length", str(CONTEXT_LENGTH),
]

# The benchmark protocol's prompt lengths (shared/reference/benchmark-protocol.md): the scoreboard's buckets, and
# the prefill M at which the GEMM tables are tuned.
PROMPT_BUCKETS = (64, 2048, 8192)

# What one request may ask for (server/hooks/requests.py); `qflash serve --max-n N` etc. raise them. `n` expands
# into n sub-requests and `top_logprobs` into a top-k in the scheduler, so both are bounded.
REQUEST_LIMITS = {"max_n": 16, "max_top_logprobs": 20, "max_request_bytes": 32 << 20}

# Prefix caching (SGLang's radix cache). On the hybrid GDN model the radix cache also checkpoints the GDN
# state every 256 tokens (`extra_buffer`: keeps overlap scheduling on, which `no_buffer` would turn off; it
# needs the triton linear-attention backend, the default), made correct under DFLASH by
# server/hooks/radix_cache.py (tests/test_prefix_cache_gpu.py). On by default (`./launch.sh
# --no-prefix-cache` turns it off); stock systems always run without it, as the protocol has them.
PREFIX_CACHE = True
PREFIX_CACHE_FLAGS = {True: ["--mamba-radix-cache-strategy", "extra_buffer"], False: ["--disable-radix-cache"]}

# How a qflash W8A8 checkpoint is served: the body and int8 lm_head by qflash's method (quant/method.py),
# the bf16 DFlash drafter quantized at load by the same method.
QFLASH_W8A8_FLAGS = ["--quantization", METHOD_NAME, "--speculative-draft-model-quantization", METHOD_NAME]

# The Gated-DeltaNet verify keeps each draft step's raw inputs and the commit replays the accepted ones into
# the state (SGLang's ReplaySSM spec-verify, in place of 16 full-state snapshots per layer, 32 MB written per
# layer per cycle). server/hooks/gdn_verify.py gives DFLASH the replay and runs both on qflash's kernels.
GDN_VERIFY_FLAGS = ["--enable-linear-replayssm-spec"]

# What qflash adds to SGLang's serving beyond the quantization method: CUDA graphs for every batch size
# the server admits and piecewise prefill graphs on block multiples (graphs/policy.py), and the GDN verify above.
QFLASH_SERVING_FLAGS = graph_flags(BLOCK_SIZE, MAX_RUNNING_REQUESTS, CHUNKED_PREFILL_SIZE) + GDN_VERIFY_FLAGS

# Speculative cycles per scheduler step (server/window.py): the scheduler's per-step Python runs once per window.
# The most the radix cache allows; it ran the shortest requests of 1, 2, 4 and 8 (BENCHMARKS.md, 2026-12-01).
WINDOW_CYCLES = 8

# SGLang's environment for qflash's server: the overlap scheduler's preparation of each step (KV slot reservation,
# req_to_token writes) on a stream of its own (0.5.17's SGLANG_ENABLE_OVERLAP_PLAN_STREAM, off by default).
QFLASH_SERVER_ENV = {"SGLANG_ENABLE_OVERLAP_PLAN_STREAM": "1"}

HOST = "127.0.0.1"
PORT = 30000
