"""Two steps of each DFLASH cycle's eager glue replayed as CUDA graphs (graphs/glue.py), per batch size.

After the verify, SGLang 0.5.17's worker runs two steps eagerly whose host time outweighs their GPU time:
- the Gated-DeltaNet commit (`_update_target_mamba_state_after_verify`): the tracking arithmetic, the fold of every
  GDN layer and the conv-window scatters of each of the 24 layers;
- the drafter's context-KV write (`_append_target_hidden_fused`): the stacked K/V projection, norm and RoPE, and a
  prefix-valid write into each drafter layer's cache.
Their inputs live in buffers whose addresses repeat from cycle to cycle (the verify graph's outputs, the
worker's rotating buffers, the pools), except a few fresh tensors per cycle, which are copied into buffers of the
hook's own first; a graph is keyed by the addresses and shapes of everything else the step reads that can move.
The commit's key holds the verify's state slots (`forward_metadata`), the write's the fused helper's
workspaces and RoPE cache, which grow when a longer prefill needs them. Inside a whole cycle's capture
(server/hooks/cycle_graphs.py) every address is that graph's: the steps run as SGLang's, without copies.
Retire when SGLang captures its speculative glue (or the whole cycle) in graphs.
"""

from types import SimpleNamespace

from qflash.graphs.glue import GlueGraphs, capturing, layout, static_copies
from qflash.server.hooks import Hook

GDN_COMMIT = GlueGraphs("the GDN commit after a verify")
DRAFTER_KV = GlueGraphs("the drafter's context-KV write after a verify")
_STATIC: dict = {}  # (step, layout of the fresh inputs) -> the buffers they are copied into


def _gdn_commit_in_a_graph(original, self, *, batch, seq_lens_pre_verify, commit_lens):
    linear = getattr(self.target_worker.model_runner.attn_backend, "linear_attn_backend", None)
    metadata = getattr(linear, "forward_metadata", None)
    if metadata is None or capturing():
        return original(self, batch=batch, seq_lens_pre_verify=seq_lens_pre_verify, commit_lens=commit_lens)
    bs = commit_lens.shape[0]
    s = static_copies(_STATIC, "gdn", seq_lens=batch.seq_lens[:bs], track=batch.mamba_track_indices,
                       pool=batch.req_pool_indices[:bs], pre=seq_lens_pre_verify, commit=commit_lens)
    stand_in = SimpleNamespace(seq_lens=s.seq_lens, mamba_track_indices=s.track, req_pool_indices=s.pool)
    key = layout(s.seq_lens, s.track, s.pool, s.pre, s.commit, metadata.mamba_cache_indices)
    GDN_COMMIT.run(key=key, fn=lambda: original(self, batch=stand_in, seq_lens_pre_verify=s.pre, commit_lens=s.commit))


def drafter_kv_buffers(helper) -> tuple:
    """The fused drafter-KV write's workspaces and RoPE cache (the last), which a longer prefill reallocates."""
    rope = getattr(getattr(helper, "rotary_emb", None), "cos_sin_cache", None)
    return tuple(getattr(helper, name, None) for name in ("_proj_workspace", "_k_workspace", "_v_workspace")) + (rope,)


def _drafter_kv_in_a_graph(original, self, ctx_hidden, ctx_positions, ctx_cache_loc, ctx_cache_loc_2d=None,
                           commit_lens=None):
    buffers = drafter_kv_buffers(self._fused_kv_helper)
    # a prefill's write (any length), or one a whole cycle's capture holds
    if ctx_cache_loc_2d is None or commit_lens is None or buffers[-1] is None or capturing():
        return original(self, ctx_hidden, ctx_positions, ctx_cache_loc, ctx_cache_loc_2d, commit_lens)
    hidden = static_copies(_STATIC, "drafter_kv", ctx_hidden=ctx_hidden).ctx_hidden  # fresh from the projection each cycle
    key = layout(hidden, ctx_positions, ctx_cache_loc, ctx_cache_loc_2d, commit_lens, *buffers)
    DRAFTER_KV.run(key=key, fn=lambda: original(self, hidden, ctx_positions, ctx_cache_loc, ctx_cache_loc_2d, commit_lens))


WORKER = "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2."
CHANGES = [
    Hook(WORKER + "_update_target_mamba_state_after_verify", _gdn_commit_in_a_graph, "AROUND"),
    Hook(WORKER + "_append_target_hidden_fused", _drafter_kv_in_a_graph, "AROUND"),
]
