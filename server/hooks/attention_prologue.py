"""The gated attention layers' q / k norm and rotary on qflash's kernel (kernels/qk_norm_rope.py), launched with
programmatic dependent launch.

SGLang 0.5.17's Qwen3.5 attention calls `fused_qk_gemma_rmsnorm_rope_gate`, a Triton kernel launched without PDL,
between two qflash kernels launched with it: in a verify it waits for the qkv GEMM to drain, then pays its own launch
(3.6 us a layer on an H100, BENCHMARKS.md, 2026-12-05). qflash's kernel computes the same q, k and gate; calls it
does not cover keep SGLang's. Retire when SGLang's kernel waits on the kernel before it (griddepcontrol.wait) and
launches with PDL.
"""

from qflash.server.hooks import Hook


def _on_qflash(original, q_gate, k, q_weight, k_weight, cos_sin_cache, positions, eps, num_q_heads, num_kv_heads,
               head_dim, rotary_dim, has_gate=True):
    from qflash.kernels import qk_norm_rope

    args = (q_gate, k, q_weight, k_weight, cos_sin_cache, positions, eps, num_q_heads, num_kv_heads, head_dim,
            rotary_dim, has_gate)
    if not qk_norm_rope.takes(q_gate, k, cos_sin_cache, positions, num_q_heads, num_kv_heads, head_dim, rotary_dim,
                              has_gate):
        return original(*args)
    return qk_norm_rope.qk_norm_rope(*args)


class _WhereSGLangCallsIt:
    """The hook, where SGLang's Qwen3.5 imports the kernel and calls it (CUDA): elsewhere neither is there."""

    target = "sglang.srt.models.qwen3_5.fused_qk_gemma_rmsnorm_rope_gate"

    def install(self):
        from sglang.srt.models import qwen3_5

        return Hook(self.target, _on_qflash, "AROUND").install() if qwen3_5._is_cuda else lambda: True


CHANGES = [_WhereSGLangCallsIt()]
