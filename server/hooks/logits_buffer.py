"""The int8 lm_head writes SGLang's fp32 logits buffer itself.

SGLang's LogitsProcessor computes the logits in the activations' dtype (bf16) and then copies them into the fp32
`next_token_logits_buffer` that its CUDA graphs keep (`_copy_logits_to_buffer`): at a verify's 16 x 248,320 logits
that copy is the cycle's largest glue kernel (12 us on the H200). Where nothing comes between the lm_head and the
copy (no bias, logit scale, tensor-parallel gather or vocab padding), qflash's W8A16 GEMM writes the buffer, each
logit rounded to bf16 first (the copy's bits). SGLang's `copy_` of the buffer onto itself then launches nothing:
torch returns early when the source is the destination.
Retire when SGLang's LogitsProcessor hands its buffer to the lm_head's quantization method.
"""

import torch

from qflash.server.hooks import Hook


def _lm_head_writes_the_buffer(original, self, hidden_states, lm_head, logits_metadata, *args, **kwargs):
    from qflash.quant.method import W8A16LMHeadMethod

    embedding_bias = kwargs.get("embedding_bias", args[0] if args else None)
    use_buffer = kwargs.get("use_logits_buffer", args[1] if len(args) > 1 else True)
    method, buffer = getattr(lm_head, "quant_method", None), getattr(logits_metadata, "next_token_logits_buffer", None)
    if not (isinstance(method, W8A16LMHeadMethod) and use_buffer and buffer is not None and embedding_bias is None
            and self.logit_scale is None and not self.do_tensor_parallel_all_gather
            and not self.do_tensor_parallel_all_gather_dp_attn and lm_head.weight.shape[0] == self.vocab_size
            and buffer.dtype == torch.float32 and buffer.is_contiguous()
            and tuple(buffer.shape) == (hidden_states.shape[0], self.vocab_size)):
        return original(self, hidden_states, lm_head, logits_metadata, *args, **kwargs)
    method.logits_buffer = buffer
    try:
        return original(self, hidden_states, lm_head, logits_metadata, *args, **kwargs)
    finally:
        method.logits_buffer = None


CHANGES = [Hook("sglang.srt.layers.logits_processor.LogitsProcessor._get_logits", _lm_head_writes_the_buffer, "AROUND")]
