"""A fresh prompt's prefill as one CUDA graph (graphs/fresh_prefill.py): each small bucket's breakable prefill graph
is captured once more with its Gated-DeltaNet and attention layers in line, and replayed for a prompt that allows it.

- capture: after SGLang captures a bucket's breakable graph, its body is captured again with the layers' eager
  breaks run where they stand (outside a breakable capture, SGLang's break wrapper calls straight through). The
  attention layers need nothing else: one request with nothing cached is plain causal attention over the bucket
  (kernels/flash_prefill.py decides so on the host, once), its K/V written at the runner's static slots (padding
  at slot 0, SGLang's dummy). The GDN layers' eager path reads lengths, state slots and the radix cache's
  checkpoint from host lists; `_gdn_extend` runs its kernels from the runner's static buffers on the device
  instead (the checkpoint from qflash's own, `track_buffers`), with the bucket's padding made inert (zero q, k, v,
  beta and log-decay past the prompt).
- replay: a bucket with such a graph replays it for one request with no cached prefix; every other prefill keeps
  the breakable graph. SGLang's attention metadata for the replay (the linear-attention backend's with its host
  syncs, the full-attention backend's), which only the breakable graph's eager layers read, is put off until a
  replay falls back to the breakable graph.
Retire when SGLang's prefill graphs hold the linear-attention and attention layers of a plain prompt.
"""

from types import SimpleNamespace

from qflash.graphs import fresh_prefill
from qflash.server.hooks import Hook


def _capture_whole_too(original, self, shape_key, forward_fn, *args, **kwargs):
    original(self, shape_key, forward_fn, *args, **kwargs)
    size = shape_key.size
    if shape_key.variant_label is not None or not fresh_prefill.wanted(size):
        return

    def body():  # the bucket's forward, its output where the breakable graph's replay leaves it
        out = forward_fn()
        self._copy_output_to_buffer(out, self._shared_output_buffer, self._output_rows(out, size))

    fresh_prefill.capture((id(self), size), body, pool=self._pool, stream=self._capture_stream)


def plain_prompt(batch) -> bool:
    """One text request with nothing cached (SGLang lists each request's multimodal inputs, None for text): what a
    fresh-prompt graph computes."""
    return (batch.batch_size == 1 and batch.forward_mode.is_extend() and not batch.forward_mode.is_target_verify()
            and list(batch.extend_prefix_lens_cpu or ()) == [0] and not any(batch.mm_inputs or ()))


# the forward batch the prefill runner is executing now, and its attention metadata where it was put off
_live = SimpleNamespace(batch=None, metadata=None)
_TRACK: dict = {}  # device -> the whole graphs' copy of the live batch's tracking (`track_buffers`)


def _remember_live_batch(original, self, forward_batch, **kwargs):
    _live.batch = forward_batch
    try:
        return original(self, forward_batch, **kwargs)
    finally:
        _live.batch = _live.metadata = None


def _whole(backend, size: int, batch):
    """The key of the fresh-prompt graph that replays for `batch` on `backend`'s bucket of `size` tokens, or None."""
    key = (id(backend), size)
    return key if plain_prompt(batch) and key in fresh_prefill.GRAPHS else None


def _metadata_unless_whole(original, self, forward_batch, static_forward_batch, num_tokens):
    if _whole(self.backend, num_tokens, static_forward_batch) is not None:
        _live.metadata = lambda: original(self, forward_batch, static_forward_batch, num_tokens)
        return None
    return original(self, forward_batch, static_forward_batch, num_tokens)


def track_buffers(device) -> SimpleNamespace:
    """Where a whole graph reads the radix cache's tracking of its request ([1] each: tracked, track slot, tracked
    length). SGLang's prefill runner keeps static buffers for it only without a speculative algorithm
    (`_is_mamba_track_enabled`), while the scheduler tracks either way; so qflash keeps its own, filled from the
    live batch before each replay (`load_track`)."""
    import torch

    if device not in _TRACK:
        _TRACK[device] = SimpleNamespace(mask=torch.zeros(1, dtype=torch.bool, device=device),
                                         index=torch.zeros(1, dtype=torch.int64, device=device),
                                         seqlen=torch.zeros(1, dtype=torch.int64, device=device))
    return _TRACK[device]


def load_track(batch, buffers: SimpleNamespace) -> None:
    """The live batch's tracking of its one request into `buffers` (untracked: no radix cache, or none asked)."""
    if getattr(batch, "mamba_track_mask", None) is None:
        buffers.mask.fill_(False)
        return
    buffers.mask.copy_(batch.mamba_track_mask[:1])
    buffers.index.copy_(batch.mamba_track_indices[:1])
    buffers.seqlen.copy_(batch.mamba_track_seqlens[:1])


def _replay_whole(original, self, shape_key, static_forward_batch, **kwargs):
    key = _whole(self, shape_key.size, static_forward_batch) if shape_key.variant_label is None else None
    if key is not None:
        load_track(_live.batch, track_buffers(static_forward_batch.input_ids.device))
        if fresh_prefill.replay(key, graphed=True):
            return self._outputs[shape_key]
    if _live.metadata is not None:  # put off for a whole graph that did not replay: the breakable one reads it
        put_off, _live.metadata = _live.metadata, None
        put_off()
    return original(self, shape_key, static_forward_batch, **kwargs)


def track_plan(length, mask, index, seqlen, slot, *, chunk: int, conv_len: int) -> SimpleNamespace:
    """The radix cache's checkpoint of one prompt with no cached prefix (all [1] tensors: its length, whether it is
    tracked, the track slot, the tracked length as SGLang's scheduler sets it, its state slot), as SGLang's extend
    metadata computes it on the host (`_init_track_conv_indices`, `_init_track_ssm_indices`), here on the device:
    the conv inputs to copy, the slot they and the recurrent state go to (the request's own when untracked: the
    conv prefill then overwrites it, and the recurrent copy writes its own final state back), whether that state
    is the final one (a tracked length on a chunk boundary) or else which chunk's."""
    import torch

    aligned = seqlen // chunk * chunk
    conv = (aligned - conv_len + torch.arange(conv_len, device=length.device)).clamp(min=0)
    return SimpleNamespace(conv_idx=torch.minimum(conv, length - 1)[None], dst=torch.where(mask, index, slot.to(index.dtype)),
                           final=(seqlen % chunk == 0) | ~mask, chunk_idx=torch.where(mask, seqlen // chunk, 0))


def _metadata(backend, forward_batch, tokens: int) -> SimpleNamespace:
    """What each GDN layer reads, from the prefill runner's static buffers (its capture batch holds them)."""
    import torch
    from sglang.srt.runtime_context import get_server_args

    length = forward_batch.extend_seq_lens[:1]
    slot = backend._translate_mamba_indices(backend.req_to_token_pool.get_mamba_indices(forward_batch.req_pool_indices[:1]))
    live = track_buffers(length.device)
    track = track_plan(length, live.mask, live.index, live.seqlen, slot, chunk=get_server_args().mamba_cache_chunk_size,
                       conv_len=backend.conv_states_shape[-1])
    return SimpleNamespace(padded=torch.arange(tokens, device=length.device) >= length, slot=slot, track=track,
                           query_start_loc=torch.cat([torch.zeros_like(length), length]).to(torch.int32),
                           no_initial_state=torch.zeros(1, dtype=torch.bool, device=length.device))


def _gdn_extend(original, self, layer, forward_batch, mixed_qkv, a, b, **kwargs):
    if not fresh_prefill.capturing():
        return original(self, layer, forward_batch, mixed_qkv, a, b, **kwargs)
    import torch
    from sglang.kernels.ops.attention.fla.chunk import chunk_gated_delta_rule
    from sglang.srt.layers.attention.linear import gdn_backend

    from qflash.kernels import gdn_prefill
    from qflash.server.hooks.gdn_prefill import take_state_pass_tile

    tokens = mixed_qkv.shape[0]
    m = fresh_prefill.metadata(lambda: _metadata(self, forward_batch, tokens))
    cache = self.req_to_token_pool.mamba2_layer_cache(layer.layer_id)
    conv_states, ssm_states = cache.conv[0], cache.temporal
    if not (conv_states.is_contiguous() and ssm_states.is_contiguous()):
        raise RuntimeError("the GDN state pool is strided: its prefill kernels gather and scatter on the host")
    x = mixed_qkv.transpose(0, 1)
    conv_states[m.track.dst] = x[:, m.track.conv_idx].transpose(0, 1)  # before the conv writes its final state
    x = gdn_backend.causal_conv1d_fn(x, layer.conv_weights, layer.bias, activation=layer.activation,
                                     conv_states=conv_states, has_initial_state=m.no_initial_state, cache_indices=m.slot,
                                     query_start_loc=m.query_start_loc, seq_lens_cpu=[tokens]).transpose(0, 1)
    x = x.masked_fill(m.padded[:, None], 0)  # the conv leaves the padding unwritten
    q, k, v = gdn_backend.fused_qkv_split_gdn_prefill(x, layer.num_q_heads, layer.num_k_heads, layer.num_v_heads,
                                                       layer.head_q_dim, layer.head_k_dim, layer.head_v_dim)
    g, beta = gdn_backend.fused_gdn_gating(layer.A_log, a, b, layer.dt_bias)
    # past the prompt no decay and no update (k = v = beta = 0): FLA's chunks then carry the prompt's state through
    g, beta = (t.masked_fill(m.padded[None, :, None], 0) for t in (g, beta))
    if gdn_prefill.serves(tokens):  # the recurrent kernel steps through the prompt alone
        o, _, h = gdn_prefill.prefill(q, k, v, g, beta, ssm_states, m.slot, m.query_start_loc)
    else:  # FLA's chunks over the whole bucket, as one sequence: no host-side chunk index
        take_state_pass_tile(tokens)
        o, _, h = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=ssm_states, initial_state_indices=m.slot,
                                         use_qk_l2norm_in_kernel=True)
    chunk = h.squeeze(0)[m.track.chunk_idx.clamp(max=h.shape[1] - 1)].to(ssm_states.dtype)
    ssm_states[m.track.dst] = torch.where(m.track.final[:, None, None, None], ssm_states[m.slot], chunk)
    return o.masked_fill(m.padded[None, :, None, None], 0)


BACKEND = "sglang.srt.model_executor.runner_backend.breakable_cuda_graph_backend.BreakableCudaGraphBackend."
RUNNER = "sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner."
CHANGES = [
    Hook(RUNNER + "execute", _remember_live_batch, "AROUND"),
    Hook(RUNNER + "_prepare_forward_metadata_for_replay", _metadata_unless_whole, "AROUND"),
    Hook(BACKEND + "capture_one", _capture_whole_too, "AROUND"),
    Hook(BACKEND + "replay", _replay_whole, "AROUND"),
    Hook("sglang.srt.layers.attention.linear.gdn_backend.GDNAttnBackend.forward_extend", _gdn_extend, "AROUND"),
]
