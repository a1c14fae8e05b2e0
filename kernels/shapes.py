"""The GEMMs of Qwen3.5-4B and its DFlash drafter as SGLang runs them (after its weight fusions).

(name, N, K): y[M, N] = x[M, K] @ w[N, K]^T. M is 16 per request in verify and draft (block 16),
the prompt length in prefill. Tuning, tests and `qflash bench-kernels` all read this list. The drafter's
qkv_proj is not here (it stays bf16 for SGLang's fused context-KV path: quant/method.py, DRAFTER_BF16), nor
its fc (a plain `nn.Linear` in SGLang's DFlash model, which no quantization method reaches).
"""

TARGET = [
    ("gdn.in_proj_qkvz", 12288, 2560),
    ("gdn.in_proj_ba", 64, 2560),
    ("gdn.out_proj", 2560, 4096),
    ("attn.qkv_proj", 10240, 2560),
    ("attn.o_proj", 2560, 4096),
    ("mlp.gate_up_proj", 18432, 2560),
    ("mlp.down_proj", 2560, 9216),
]
DRAFTER = [
    ("draft.o_proj", 2560, 4096),
    ("draft.gate_up_proj", 18432, 2560),
    ("draft.down_proj", 2560, 9216),
]
LM_HEAD = ("lm_head", 248320, 2560)

# How often each target GEMM runs in one forward: 24 Gated-DeltaNet layers, 8 attention layers, 32 MLPs.
TARGET_COUNT = {"gdn.in_proj_qkvz": 24, "gdn.in_proj_ba": 24, "gdn.out_proj": 24,
                "attn.qkv_proj": 8, "attn.o_proj": 8, "mlp.gate_up_proj": 32, "mlp.down_proj": 32}

DECODE_M = (16, 32, 64, 128)    # verify / draft at 1-8 requests
PREFILL_M = (64, 2048, 8192)    # the benchmark's prompt lengths
