"""Short prompts' Gated-DeltaNet prefill as one recurrent kernel.

SGLang prefills each GDN layer with FLA's chunked kernels, launched eagerly between the prefill graph's pieces:
their host launch time per layer does not shrink with the prompt, so a short prompt waits on launches. Prompts
up to kernels/gdn_prefill.MAX_TOKENS (all requests of the batch together) take qflash's one-launch recurrent
prefill, which keeps the chunked path's contract (state in place, output, chunk states for the prefix cache);
prefills that checkpoint intermediate states (`num_state_checkpoints`) stay on SGLang's path.
Retire when SGLang's GDN prefill launches in a CUDA graph or a single kernel.
"""

from qflash.server.hooks import Hook


def _short_gdn_prefill(original, self, q, k, v, g, beta, **kwargs):
    from qflash.kernels import gdn_prefill

    if q.shape[1] > gdn_prefill.MAX_TOKENS or kwargs.get("num_state_checkpoints"):
        return original(self, q, k, v, g, beta, **kwargs)
    return gdn_prefill.prefill(q, k, v, g, beta, kwargs["ssm_states"], kwargs["cache_indices"], kwargs["query_start_loc"])


CHANGES = [Hook("sglang.srt.layers.attention.linear.kernels.gdn_triton.TritonGDNKernel.extend", _short_gdn_prefill, "AROUND")]
