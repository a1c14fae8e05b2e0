"""The attention layers' q / k norm and rotary on qflash's kernel (kernels/qk_norm_rope.py), one launch a layer with
programmatic dependent launch.

SGLang 0.5.17 launches this step without PDL, between qflash kernels launched with it: in a verify each of its
launches waits for the kernel before it to drain, then pays its own launch (the target's: a 3.6 us gap a layer on an
H100, BENCHMARKS.md, 2026-12-05; the drafter's not measured).
- The target's gated attention calls `fused_qk_gemma_rmsnorm_rope_gate` (a Triton kernel): qflash's kernel computes
  the same q, k and gate. SGLang's Qwen3.5 imports and calls it on CUDA only.
- The DFlash drafter's attention calls `apply_qk_norm` (a JIT kernel normalising q and k in place), then its rotary
  embedding (another kernel, in place): while a drafter layer whose rotary runs SGLang's CUDA forward (hooked here)
  runs, the norm is deferred (q and k handed back as they are) and that rotary's call on those same q and k runs
  both in one launch. A deferred norm that no such call takes runs as SGLang's before anything else is deferred or
  rotated.
Calls the kernel does not cover keep SGLang's path. Retire when SGLang's kernels for these steps wait on the kernel
before them (griddepcontrol.wait) and launch with PDL.
"""

from typing import Optional

import torch

from qflash.server.hooks import Hook

_rotary = None  # the rotary embedding of the drafter layer that runs now, where its forward is the hooked CUDA one
_deferred: Optional[tuple] = None  # a drafter layer's norm until its rotary: (q, k, q_norm, k_norm, head_dim, SGLang's)


def _target_on_qflash(original, q_gate, k, q_weight, k_weight, cos_sin_cache, positions, eps, num_q_heads,
                      num_kv_heads, head_dim, rotary_dim, has_gate=True):
    from qflash.kernels import qk_norm_rope

    args = (q_gate, k, q_weight, k_weight, cos_sin_cache, positions, eps, num_q_heads, num_kv_heads, head_dim,
            rotary_dim, has_gate)
    if torch.compiler.is_compiling() or not qk_norm_rope.takes(q_gate, k, cos_sin_cache, positions, num_q_heads,
                                                                num_kv_heads, head_dim, rotary_dim, has_gate):
        return original(*args)
    return qk_norm_rope.qk_norm_rope(*args)


class _WhereSGLangCallsIt:
    """The target's hook, where SGLang's Qwen3.5 imports the kernel and calls it (CUDA): elsewhere neither is there."""

    target = "sglang.srt.models.qwen3_5.fused_qk_gemma_rmsnorm_rope_gate"

    def install(self):
        from sglang.srt.models import qwen3_5

        return Hook(self.target, _target_on_qflash, "AROUND").install() if qwen3_5._is_cuda else lambda: True


def _drafter_layer(original, self, *args, **kwargs):
    global _rotary
    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding

    rope = getattr(self, "rotary_emb", None)
    forward = getattr(getattr(rope, "_forward_method", None), "__func__", None)
    _rotary = rope if type(rope) is RotaryEmbedding and forward is RotaryEmbedding.forward_cuda else None
    try:
        return original(self, *args, **kwargs)
    finally:
        _rotary = None
        _run_deferred()


def _plain_head_norm(norm: torch.nn.Module, head_dim: int) -> bool:
    from sglang.srt.layers.layernorm import GemmaRMSNorm

    return (not isinstance(norm, GemmaRMSNorm) and norm.weight.shape == (head_dim,)
            and getattr(norm, "variance_size_override", None) is None
            and not getattr(norm, "cast_x_before_out_mul", False))


def _run_deferred() -> None:
    """SGLang's norm for a deferred call no rotary took, into q and k (which its caller holds) in place."""
    global _deferred
    if _deferred is not None:
        (q, k, q_norm, k_norm, head_dim, original), _deferred = _deferred, None
        for held, normed in zip((q, k), original(q, k, q_norm, k_norm, head_dim)):
            if normed.data_ptr() != held.data_ptr():
                held.copy_(normed)


def _defer_drafter_qk_norm(original, q, k, q_norm, k_norm, head_dim, *args, **kwargs):
    global _deferred
    _run_deferred()
    if (args or kwargs or _rotary is None or torch.compiler.is_compiling()
            or q_norm.variance_epsilon != k_norm.variance_epsilon
            or not (_plain_head_norm(q_norm, head_dim) and _plain_head_norm(k_norm, head_dim))):
        return original(q, k, q_norm, k_norm, head_dim, *args, **kwargs)
    _deferred = (q, k, q_norm, k_norm, head_dim, original)
    return q, k


def _norm_and_rotary(original, self, positions, query, key, offsets=None, fused_set_kv_buffer_arg=None):
    global _deferred
    from qflash.kernels import qk_norm_rope

    deferred, cache = _deferred, self.cos_sin_cache
    if (deferred is None or self is not _rotary or deferred[0] is not query or deferred[1] is not key
            or offsets is not None or fused_set_kv_buffer_arg is not None or not self.is_neox_style
            or self.head_size != deferred[4]
            or not qk_norm_rope.takes_in_place(query, key, cache, positions, self.head_size)):
        _run_deferred()
        return original(self, positions, query, key, offsets, fused_set_kv_buffer_arg)
    (_, _, q_norm, k_norm, head_dim, _), _deferred = deferred, None
    qk_norm_rope.qk_norm_rope_(query, key, q_norm.weight, k_norm.weight, cache, positions, q_norm.variance_epsilon,
                               head_dim)
    return query, key


CHANGES = [
    _WhereSGLangCallsIt(),
    Hook("sglang.srt.models.dflash.DFlashAttention.forward", _drafter_layer, "AROUND"),
    Hook("sglang.srt.models.dflash.apply_qk_norm", _defer_drafter_qk_norm, "AROUND"),
    Hook("sglang.srt.layers.rotary_embedding.base.RotaryEmbedding.forward_cuda", _norm_and_rotary, "AROUND"),
]
