"""qflash's attention kernels behind SGLang's Triton attention backend.

- The speculative block (DFlash's verify and its draft block, TARGET_VERIFY forwards): SGLang's Triton backend
  runs it through its extend kernel, which walks the cached prefix serially with one program per (request,
  head). The backend has a hook for a split-KV verify kernel (`use_verify_splitkv`, switched on for AMD gfx95
  only); qflash plugs kernels/block_attention.py in there, which declines (returns False) what it does not serve.
- Fresh prefills (plain causal, nothing cached: a prompt, or a batch of them): the backend keeps its extend kernel
  as an attribute, `extend_attention_fwd`, which is wrapped by kernels/flash_prefill.py (torch's fused SDPA and
  flash attention); every other extend (cached prefixes, masks, windows, caps, scaled KV, and batches while a CUDA
  graph is captured) reaches SGLang's kernel unchanged.
Both are set on each backend as it is built. Retire when SGLang's Triton backend has split-KV verify on CUDA and a
flash prefill path of its own.
"""

import functools

import torch

from qflash.server.hooks import Hook


def _use_qflash_attention(result, self, *args, **kwargs):
    from qflash.kernels.block_attention import block_attention
    from qflash.kernels.flash_prefill import flash_prefill

    if self.page_size == 1:  # block_attention reads one KV slot per token
        self.use_verify_splitkv = True
        self.verify_splitkv_fwd = torch.compiler.disable(block_attention)
    self.extend_attention_fwd = torch.compiler.disable(functools.partial(flash_prefill, self.extend_attention_fwd))
    return result


CHANGES = [Hook("sglang.srt.layers.attention.triton_backend.TritonAttnBackend.__init__", _use_qflash_attention, "AFTER")]
