"""Short prompts' Gated-DeltaNet prefill as one recurrent kernel.

SGLang prefills each GDN layer with FLA's chunked kernels, launched eagerly between the prefill graph's pieces:
their host launch time per layer does not shrink with the prompt, so a short prompt waits on launches. Prompts
up to kernels/gdn_prefill.MAX_TOKENS (all requests of the batch together) take qflash's one-launch recurrent
prefill, which keeps the chunked path's contract (state in place, output, chunk states for the prefix cache);
prefills that checkpoint intermediate states (`num_state_checkpoints`) stay on SGLang's path.

Before it, SGLang copies q, k and v out of the conv output's rows (one split kernel a layer) for FLA's chunked
prefill, which wants them contiguous; qflash's prefill reads rows through a token stride, and FLA's chunked path
copies strided inputs itself, so where the conv output's rows are channel-contiguous the split hands out views of
them. gdn_backend binds the split on CUDA only; elsewhere the hook binds it first, so every platform installs the
same hooks.
Retire when SGLang's GDN prefill launches in a CUDA graph or a single kernel and reads q, k, v through strides.
"""

from qflash.server.hooks import Hook


def _short_gdn_prefill(original, self, q, k, v, g, beta, **kwargs):
    from qflash.kernels import gdn_prefill

    if q.shape[1] > gdn_prefill.MAX_TOKENS or kwargs.get("num_state_checkpoints"):
        return original(self, q, k, v, g, beta, **kwargs)
    return gdn_prefill.prefill(q, k, v, g, beta, kwargs["ssm_states"], kwargs["cache_indices"], kwargs["query_start_loc"])


def _prefill_reads_conv_rows(original, mixed_qkv, num_q_heads, num_k_heads, num_v_heads, head_q, head_k, head_v):
    widths = [num_q_heads * head_q, num_k_heads * head_k, num_v_heads * head_v]
    if mixed_qkv.stride(-1) != 1 or mixed_qkv.shape[-1] != sum(widths):
        return original(mixed_qkv, num_q_heads, num_k_heads, num_v_heads, head_q, head_k, head_v)
    heads = zip(mixed_qkv.split(widths, dim=-1), ((num_q_heads, head_q), (num_k_heads, head_k), (num_v_heads, head_v)))
    return tuple(rows.unflatten(-1, shape)[None] for rows, shape in heads)  # [1, T, heads, dim], a token's row apart


class _SplitHook(Hook):
    """The split's hook, installed where gdn_backend did not bind the split (off CUDA) by binding it first."""

    def install(self):
        from sglang.kernels.ops.attention import triton_gdn_fused_proj
        from sglang.srt.layers.attention.linear import gdn_backend

        if not hasattr(gdn_backend, "fused_qkv_split_gdn_prefill"):
            gdn_backend.fused_qkv_split_gdn_prefill = triton_gdn_fused_proj.fused_qkv_split_gdn_prefill
        return super().install()


CHANGES = [
    Hook("sglang.srt.layers.attention.linear.kernels.gdn_triton.TritonGDNKernel.extend", _short_gdn_prefill, "AROUND"),
    _SplitHook("sglang.srt.layers.attention.linear.gdn_backend.fused_qkv_split_gdn_prefill", _prefill_reads_conv_rows,
               "AROUND"),
]
