"""A fresh prompt's prefill as one CUDA graph (graphs/fresh_prefill.py): each small bucket's breakable prefill graph
is captured once more with its Gated-DeltaNet and attention layers in line, and replayed for a prompt that allows it.

- capture: after SGLang captures a bucket's breakable graph (one holding prompts that `checkpointed` lets through),
  its body is captured again with the layers' eager breaks run where they stand (outside a breakable capture,
  SGLang's break wrapper calls straight through). The attention layers need nothing else: one request with nothing cached is plain causal attention over the bucket
  (kernels/flash_prefill.py decides so on the host, once), its K/V written at the runner's static slots (padding
  at slot 0, SGLang's dummy). The GDN layers' eager path reads lengths and state slots from host lists;
  `_gdn_extend` runs its kernels from the runner's static buffers on the device instead, with the bucket's padding
  made inert (zero q, k, v, beta and log-decay past the prompt). It writes no radix-cache checkpoint: prompts that
  take one keep the breakable graph (`checkpointed`).
- replay: a bucket with such a graph replays it for one request with no cached prefix whose state the radix cache
  does not checkpoint (`checkpointed`); every other prefill keeps the breakable graph.
Retire when SGLang's prefill graphs hold the linear-attention and attention layers of a plain prompt.
"""

from types import SimpleNamespace

from qflash.graphs import fresh_prefill
from qflash.server.hooks import Hook


def _capture_whole_too(original, self, shape_key, forward_fn, *args, **kwargs):
    original(self, shape_key, forward_fn, *args, **kwargs)
    size = shape_key.size
    chunk = checkpoint_chunk()
    if shape_key.variant_label is not None or not fresh_prefill.wanted(size) or chunk is not None and size > chunk:
        return  # a bucket past one chunk holds only prompts that `checkpointed` keeps from a whole graph

    def body():  # the bucket's forward, its output where the breakable graph's replay leaves it
        out = forward_fn()
        self._copy_output_to_buffer(out, self._shared_output_buffer, self._output_rows(out, size))

    fresh_prefill.capture((id(self), size), body, pool=self._pool, stream=self._capture_stream)


def plain_prompt(batch) -> bool:
    """One text request with nothing cached (SGLang lists each request's multimodal inputs, None for text): what a
    fresh-prompt graph computes."""
    return (batch.batch_size == 1 and batch.forward_mode.is_extend() and not batch.forward_mode.is_target_verify()
            and list(batch.extend_prefix_lens_cpu or ()) == [0] and not any(batch.mm_inputs or ()))


def checkpoint_chunk():
    """The radix cache's checkpoint chunk: the scheduler checkpoints the GDN state of a prefill of at least that many
    tokens (with its extra-buffer tracking on); None when it checkpoints no prefill."""
    from sglang.srt.runtime_context import get_server_args

    args = get_server_args()
    return args.mamba_cache_chunk_size if args.enable_mamba_extra_buffer() else None


def checkpointed(batch) -> bool:
    """Whether the radix cache checkpoints this prefill's GDN state (`checkpoint_chunk`). Such prompts keep the
    breakable graph, whose GDN layers copy the state at the checkpoint. A whole graph cannot: with speculative
    decoding on, SGLang's prefill runner keeps no static buffers for the tracking (`_is_mamba_track_enabled`), so
    the graph, captured from those, never writes the checkpoint that the radix cache then serves (a request
    continuing the prompt by up to 32 tokens answered otherwise than on an empty cache: BENCHMARKS.md, 2026-12-04,
    twenty-sixth session)."""
    chunk = checkpoint_chunk()
    return chunk is not None and batch.extend_seq_lens_cpu[0] >= chunk


def _replay_whole(original, self, shape_key, static_forward_batch, **kwargs):
    if (shape_key.variant_label is None and plain_prompt(static_forward_batch) and not checkpointed(static_forward_batch)
            and fresh_prefill.replay((id(self), shape_key.size), graphed=True)):
        return self._outputs[shape_key]
    return original(self, shape_key, static_forward_batch, **kwargs)


def _metadata(backend, forward_batch, tokens: int) -> SimpleNamespace:
    """What each GDN layer reads, from the prefill runner's static buffers (its capture batch holds them)."""
    import torch

    length = forward_batch.extend_seq_lens[:1]
    slot = backend._translate_mamba_indices(backend.req_to_token_pool.get_mamba_indices(forward_batch.req_pool_indices[:1]))
    return SimpleNamespace(padded=torch.arange(tokens, device=length.device) >= length, slot=slot,
                           query_start_loc=torch.cat([torch.zeros_like(length), length]).to(torch.int32),
                           no_initial_state=torch.zeros(1, dtype=torch.bool, device=length.device))


def _gdn_extend(original, self, layer, forward_batch, mixed_qkv, a, b, **kwargs):
    if not fresh_prefill.capturing():
        return original(self, layer, forward_batch, mixed_qkv, a, b, **kwargs)
    from sglang.kernels.ops.attention.fla.chunk import chunk_gated_delta_rule
    from sglang.srt.layers.attention.linear import gdn_backend

    from qflash.kernels import gdn_prefill

    tokens = mixed_qkv.shape[0]
    m = fresh_prefill.metadata(lambda: _metadata(self, forward_batch, tokens))
    cache = self.req_to_token_pool.mamba2_layer_cache(layer.layer_id)
    conv_states, ssm_states = cache.conv[0], cache.temporal
    if not (conv_states.is_contiguous() and ssm_states.is_contiguous()):
        raise RuntimeError("the GDN state pool is strided: its prefill kernels gather and scatter on the host")
    x = gdn_backend.causal_conv1d_fn(mixed_qkv.transpose(0, 1), layer.conv_weights, layer.bias,
                                     activation=layer.activation, conv_states=conv_states,
                                     has_initial_state=m.no_initial_state, cache_indices=m.slot,
                                     query_start_loc=m.query_start_loc, seq_lens_cpu=[tokens]).transpose(0, 1)
    x = x.masked_fill(m.padded[:, None], 0)  # the conv leaves the padding unwritten
    q, k, v = gdn_backend.fused_qkv_split_gdn_prefill(x, layer.num_q_heads, layer.num_k_heads, layer.num_v_heads,
                                                       layer.head_q_dim, layer.head_k_dim, layer.head_v_dim)
    g, beta = gdn_backend.fused_gdn_gating(layer.A_log, a, b, layer.dt_bias)
    # past the prompt no decay and no update (k = v = beta = 0): FLA's chunks then carry the prompt's state through
    g, beta = (t.masked_fill(m.padded[None, :, None], 0) for t in (g, beta))
    if tokens <= gdn_prefill.MAX_TOKENS:  # the recurrent kernel steps through the prompt alone
        o = gdn_prefill.prefill(q, k, v, g, beta, ssm_states, m.slot, m.query_start_loc)[0]
    else:  # FLA's chunks over the whole bucket, as one sequence: no host-side chunk index
        o = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=ssm_states, initial_state_indices=m.slot,
                                   use_qk_l2norm_in_kernel=True)[0]
    return o.masked_fill(m.padded[None, :, None, None], 0)


BACKEND = "sglang.srt.model_executor.runner_backend.breakable_cuda_graph_backend.BreakableCudaGraphBackend."
CHANGES = [
    Hook(BACKEND + "capture_one", _capture_whole_too, "AROUND"),
    Hook(BACKEND + "replay", _replay_whole, "AROUND"),
    Hook("sglang.srt.layers.attention.linear.gdn_backend.GDNAttnBackend.forward_extend", _gdn_extend, "AROUND"),
]
