"""A fresh prompt's prefill as one CUDA graph (graphs/fresh_prefill.py, server/hooks/fresh_prefill.py) on the CPU.

- The radix cache's checkpoint of a prompt, computed on the device, is SGLang's own (its extend metadata's host
  arithmetic, run here on stand-ins) for every length around the 64-token chunks, tracked or not.
- The GDN layer's in-line prefill (qflash's recurrent kernel in Triton's interpreter, also standing in for FLA's chunks,
  which buckets past kernels/gdn_prefill.MAX_TOKENS call with the state pass's tile of their length;
  SGLang's conv, split and gating as torch stand-ins that leave the padding unwritten, as the conv does) gives a
  prompt padded to its bucket the output rows, states and checkpoint of the same prompt unpadded; the checkpoint
  equals the state of the prompt's first tokens up to it.
- Capture and replay with a stand-in graph: which buckets are captured, the body run eagerly in line and then
  captured, a failed capture leaving the breakable graphs, a replay only for one request with nothing cached, the
  live batch's tracking copied where the graph reads it before each replay (the runner's static batch has none
  under speculative decoding).
The whole graphs are checked against the breakable ones on the H200 (tests/test_fresh_prefill_gpu.py).
"""

import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from sglang.srt.layers.attention import hybrid_linear_attn_backend as hybrid
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.runner.shape_key import ShapeKey

from qflash.graphs import fresh_prefill
from qflash.graphs.policy import FRESH_PREFILL_MAX_TOKENS
from qflash.server.hooks import fresh_prefill as hook

CHUNK, CONV = 64, 3  # SGLang's mamba_cache_chunk_size (FLA's chunk, page size 1) and the conv state's width


def sglang_checkpoint(length: int, tracked: bool, seqlen: int, slot: int, dst: int, monkeypatch):
    """SGLang's extend metadata for one request with no prefix: (conv input positions, track slot) and
    (h chunk, h slot, final-state source, final-state slot), [] where nothing is tracked."""
    monkeypatch.setattr(hybrid, "get_server_args", lambda: SimpleNamespace(mamba_cache_chunk_size=CHUNK))
    backend = SimpleNamespace(conv_states_shape=(8, 16, CONV), device="cpu")
    batch = SimpleNamespace(mamba_track_seqlens=torch.tensor([seqlen]), extend_prefix_lens=torch.tensor([0]),
                            mamba_track_mask=torch.tensor([tracked]), extend_seq_lens=torch.tensor([length]),
                            mamba_track_indices=torch.tensor([dst]))
    conv = hybrid.MambaAttnBackendBase._init_track_conv_indices(backend, torch.tensor([0, length]), batch)
    ssm = hybrid.MambaAttnBackendBase._init_track_ssm_indices(backend, torch.tensor([slot]), batch)
    return conv.tolist(), [t.tolist() for t in ssm]


def plan(length: int, tracked: bool, seqlen: int, slot: int, dst: int):
    return hook.track_plan(torch.tensor([length]), torch.tensor([tracked]), torch.tensor([dst]), torch.tensor([seqlen]),
                           torch.tensor([slot], dtype=torch.int32), chunk=CHUNK, conv_len=CONV)


@pytest.mark.parametrize("length", [1, 3, 5, 63, 64, 65, 100, 127, 128, 129, 250, 256, 1000, 2040, 2048])
def test_the_checkpoint_is_sglangs(length, monkeypatch):
    slot, dst = 5, 7
    cases = [(False, -1)]  # SGLang's scheduler: untracked below one chunk (seqlen -1)
    if length >= CHUNK:
        aligned = length // CHUNK * CHUNK
        cases += [(True, length), (True, aligned + 1)]  # the prompt's own length; a forced chunk state (_force_track_h)
    for tracked, seqlen in cases:
        conv, (h_src, h_dst, final_src, final_dst) = sglang_checkpoint(length, tracked, seqlen, slot, dst, monkeypatch)
        got = plan(length, tracked, seqlen, slot, dst)
        if not tracked:  # SGLang copies nothing; qflash rewrites the request's own slot with its own final state
            assert conv == [] and h_src == final_src == [] and got.dst.tolist() == [slot] and got.final.tolist() == [True]
            continue
        assert got.conv_idx.tolist() == conv and got.dst.tolist() == [dst]
        if final_src:
            assert final_src == [slot] and final_dst == [dst] and got.final.tolist() == [True]
        else:
            assert h_dst == [dst] and got.final.tolist() == [False] and got.chunk_idx.tolist() == h_src


# A small GDN layer: a key head, 2 value heads of 8 (the recurrent kernel's tile needs powers of two; the
# interpreter's time grows with its programs, one per value head and 4 value columns).
H, HV, K, V = 1, 2, 8, 8
DIM = 2 * H * K + HV * V
SLOTS = 6


def stand_in_conv(x, weight, bias, *, activation, conv_states, has_initial_state, cache_indices, query_start_loc,
                  seq_lens_cpu):
    """SGLang's causal conv prefill for one request (x [DIM, tokens]): SiLU of the width-4 causal conv over the
    request's tokens from a zero state, its last 3 inputs kept as the slot's conv state; the padding is left
    unwritten (NaN here)."""
    assert not has_initial_state.any() and len(query_start_loc) == 2 and seq_lens_cpu == [x.shape[1]]
    n = int(query_start_loc[1])
    padded = F.pad(x[:, :n].float(), (weight.shape[1] - 1, 0))
    out = torch.full_like(x, float("nan"))
    out[:, :n] = F.silu(F.conv1d(padded[None], weight[:, None], groups=DIM)[0]).to(x.dtype)
    conv_states[cache_indices.long()] = padded[:, -CONV:].to(conv_states.dtype)[None]
    return out


def stand_in_split(x, nq, nk, nv, dq, dk, dv):
    n = x.shape[0]
    q, k, v = x.split([nq * dq, nk * dk, nv * dv], dim=-1)
    return q.reshape(1, n, nq, dq), k.reshape(1, n, nk, dk), v.reshape(1, n, nv, dv)


def stand_in_gating(A_log, a, b, dt_bias):
    """SGLang's GDN gating; in float64, so that a row's result does not depend on how many rows the CPU's
    vectorised exp and log see (SGLang's Triton kernel computes each element alike)."""
    g = -A_log.double().exp() * F.softplus(a.double() + dt_bias.double())
    return g.float()[None], torch.sigmoid(b.double()).float()[None]


def stand_in_chunks(calls: list):
    """FLA's chunks over one sequence, which the interpreter cannot run (it refuses fp32; its bf16 is wrong), as
    qflash's recurrent kernel, which keeps their contract; each call's length goes to `calls`."""
    from qflash.kernels import gdn_prefill

    def chunks(q, k, v, g, beta, *, initial_state, initial_state_indices, use_qk_l2norm_in_kernel):
        assert use_qk_l2norm_in_kernel
        calls.append(q.shape[1])
        return gdn_prefill.prefill(q, k, v, g, beta, initial_state, initial_state_indices,
                                   torch.tensor([0, q.shape[1]], dtype=torch.int32))
    return chunks


@pytest.fixture
def in_line(monkeypatch):
    """A fresh-prompt graph's warm-up in progress (its layers run in line), with SGLang's kernels stood in for; the
    lengths FLA's chunks were called for."""
    from sglang.kernels.ops.attention.fla import chunk, chunk_delta_h
    from sglang.srt.layers.attention.linear import gdn_backend

    calls = []
    monkeypatch.setattr(chunk, "chunk_gated_delta_rule", stand_in_chunks(calls))
    state_pass = chunk_delta_h.chunk_gated_delta_rule_fwd_kernel_h_blockdim64
    monkeypatch.setattr(state_pass, "configs", state_pass.configs)  # the tile the chunks' call sets, restored after
    monkeypatch.setattr(gdn_backend, "causal_conv1d_fn", stand_in_conv)
    monkeypatch.setattr(gdn_backend, "fused_qkv_split_gdn_prefill", stand_in_split, raising=False)
    monkeypatch.setattr(gdn_backend, "fused_gdn_gating", stand_in_gating)
    monkeypatch.setattr("sglang.srt.runtime_context.get_server_args", lambda: SimpleNamespace(mamba_cache_chunk_size=CHUNK))
    monkeypatch.setattr(fresh_prefill, "_capture", SimpleNamespace(active=True, metadata=None, broken=False))
    return calls


def gdn_prefill(prompt, a, b, layer, *, tokens, tracked, seqlen, slot=2, dst=4, seed=0):
    """One GDN layer's prefill of `prompt` ([n, DIM]) padded with noise to `tokens` rows; (output, pools)."""
    n = prompt.shape[0]
    gen = torch.Generator().manual_seed(seed)
    pad = lambda t: torch.cat([t, torch.randn(tokens - n, t.shape[1], generator=gen) * 100])  # padding rows: anything
    conv = torch.randn(SLOTS, DIM, CONV, generator=torch.Generator().manual_seed(1))
    ssm = torch.randn(SLOTS, HV, V, K, generator=torch.Generator().manual_seed(2))
    ssm[slot] = 0  # a fresh request's slot, cleared before its prefill as SGLang's scheduler clears it
    pool = SimpleNamespace(mamba2_layer_cache=lambda layer_id: SimpleNamespace(conv=[conv], temporal=ssm),
                           get_mamba_indices=lambda rows: torch.tensor([slot], dtype=torch.int32)[rows])
    backend = SimpleNamespace(req_to_token_pool=pool, conv_states_shape=conv.shape, _translate_mamba_indices=lambda i: i)
    untracked = tracked is None  # a server without prefix caching: the live batch has no tracking at all
    live = SimpleNamespace(mamba_track_mask=None if untracked else torch.tensor([tracked]),
                           mamba_track_indices=None if untracked else torch.tensor([dst]),
                           mamba_track_seqlens=None if untracked else torch.tensor([seqlen]))
    hook.load_track(live, hook.track_buffers(torch.device("cpu")))  # as before a replay
    # the runner's static batch, as under speculative decoding: no tracking buffers
    batch = SimpleNamespace(extend_seq_lens=torch.tensor([n]), req_pool_indices=torch.tensor([0]),
                            mamba_track_mask=None, mamba_track_indices=None, mamba_track_seqlens=None)
    fresh_prefill._capture.metadata = None  # a new forward
    out = hook._gdn_extend(None, backend, layer, batch, pad(prompt), pad(a), pad(b))
    return out, conv, ssm


def layer_and_prompt(n: int):
    gen = torch.Generator().manual_seed(n)
    layer = SimpleNamespace(layer_id=0, conv_weights=torch.randn(DIM, CONV + 1, generator=gen) * 0.5, bias=None,
                            activation="silu", num_q_heads=H, num_k_heads=H, num_v_heads=HV, head_q_dim=K,
                            head_k_dim=K, head_v_dim=V, A_log=torch.randn(HV, generator=gen) * 0.1,
                            dt_bias=torch.randn(HV, generator=gen) * 0.1)
    return layer, torch.randn(n, DIM, generator=gen), torch.randn(n, HV, generator=gen), torch.randn(n, HV, generator=gen)


@pytest.mark.parametrize("n, bucket", [(5, 16), (100, 112), (130, 144)])
@pytest.mark.parametrize("tracked", [None, False, True])
def test_a_padded_prompt_prefills_as_the_prompt_alone(in_line, n, bucket, tracked):
    if tracked and n < CHUNK:
        pytest.skip("SGLang tracks from one chunk on")
    layer, prompt, a, b = layer_and_prompt(n)
    seqlen = n if tracked else -1
    alone, conv, ssm = gdn_prefill(prompt, a, b, layer, tokens=n, tracked=tracked, seqlen=seqlen)
    padded, conv_p, ssm_p = gdn_prefill(prompt, a, b, layer, tokens=bucket, tracked=tracked, seqlen=seqlen)
    assert torch.equal(padded[:, :n], alone) and not padded[:, n:].any()
    assert torch.equal(conv_p, conv) and torch.equal(ssm_p, ssm)  # every slot: the request's, the track slot, others


@pytest.mark.parametrize("past", [0, 16])
def test_buckets_past_the_recurrent_kernels_limit_run_flas_chunks_on_the_tile_of_their_length(in_line, past,
                                                                                              monkeypatch):
    from sglang.kernels.ops.attention.fla import chunk_delta_h

    from qflash.kernels import gdn_prefill as kernel
    from qflash.server.hooks.gdn_prefill import STATE_PASS_TILES

    monkeypatch.setattr(kernel, "MAX_TOKENS", 64)  # as QFLASH_GDN_PREFILL_MAX_TOKENS=64 sets it: shorter prompts here
    bucket = kernel.MAX_TOKENS + past
    layer, prompt, a, b = layer_and_prompt(bucket - 5)
    gdn_prefill(prompt, a, b, layer, tokens=bucket, tracked=None, seqlen=-1)
    assert in_line == ([bucket] if past else [])
    if past:
        tile = chunk_delta_h.chunk_gated_delta_rule_fwd_kernel_h_blockdim64.configs[0]
        assert dict(tile.kwargs, num_warps=tile.num_warps, num_stages=tile.num_stages) == STATE_PASS_TILES["short"]


@pytest.mark.parametrize("n", [100, 128])
def test_the_checkpoint_holds_the_state_of_the_prompts_first_chunks(in_line, n):
    layer, prompt, a, b = layer_and_prompt(n)
    untouched_conv, untouched_ssm = gdn_prefill(prompt, a, b, layer, tokens=n, tracked=False, seqlen=-1)[1:]
    _, conv, ssm = gdn_prefill(prompt, a, b, layer, tokens=n + 14, tracked=True, seqlen=n, dst=4)
    aligned = n // CHUNK * CHUNK
    _, conv_head, ssm_head = gdn_prefill(prompt[:aligned], a[:aligned], b[:aligned], layer, tokens=aligned,
                                         tracked=False, seqlen=-1)
    torch.testing.assert_close(ssm[4], ssm_head[2], rtol=0, atol=0)  # the slot-2 final state of the first `aligned`
    torch.testing.assert_close(conv[4], conv_head[2], rtol=0, atol=0)
    others = [i for i in range(SLOTS) if i != 4]
    assert torch.equal(conv[others], untouched_conv[others]) and torch.equal(ssm[others], untouched_ssm[others])


class StandInGraph:
    fail = False
    made: list = []

    def __init__(self):
        self.replays, self.captured = 0, False
        StandInGraph.made.append(self)

    def capture_begin(self, pool, capture_error_mode):
        assert capture_error_mode == "thread_local" and pool == "the graph pool"

    def capture_end(self):
        if StandInGraph.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.captured = True

    def replay(self):
        self.replays += 1


class Backend:
    """A breakable graph backend stand-in: what the hooks read of it."""

    _pool, _capture_stream, _shared_output_buffer = "the graph pool", None, "the shared buffer"

    def __init__(self):
        self.copies, self._outputs = [], {}

    def _output_rows(self, out, size):
        return size

    def _copy_output_to_buffer(self, out, buffer, rows):
        self.copies.append((out, buffer, rows, fresh_prefill.capturing()))


@pytest.fixture
def graphs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", StandInGraph)
    monkeypatch.setattr(fresh_prefill, "GRAPHS", {})
    monkeypatch.setattr(fresh_prefill, "_REPLAYED", set())
    monkeypatch.setattr(fresh_prefill, "_capture", SimpleNamespace(active=False, metadata=None, broken=False))
    StandInGraph.fail, StandInGraph.made = False, []


def capture(backend, key) -> list:
    """The hook around SGLang's capture of `key`; what the original (SGLang's capture) was called with."""
    originals = []
    hook._capture_whole_too(lambda *args: originals.append(args[:2]), backend, key, lambda: "hidden states")
    return originals


def test_buckets_up_to_the_limit_are_captured_whole_after_sglangs_own(graphs):
    backend = Backend()
    for size in (16, FRESH_PREFILL_MAX_TOKENS, FRESH_PREFILL_MAX_TOKENS + 512):
        assert capture(backend, ShapeKey(size=size)) == [(backend, ShapeKey(size=size))]
    assert capture(backend, ShapeKey(size=64, variant_label="chunked_prefix")) and len(StandInGraph.made) == 2
    assert all(g.captured for g in StandInGraph.made) and set(fresh_prefill.GRAPHS) == {(id(backend), 16),
                                                                                         (id(backend), FRESH_PREFILL_MAX_TOKENS)}
    # each capture ran its body twice in line (the eager warm-up, then inside the capture), writing where SGLang's does
    assert backend.copies == [("hidden states", "the shared buffer", size, True)
                              for size in (16, 16, FRESH_PREFILL_MAX_TOKENS, FRESH_PREFILL_MAX_TOKENS)]
    assert not fresh_prefill.capturing()


def test_a_failed_capture_leaves_the_breakable_graphs(graphs, caplog):
    StandInGraph.fail = True
    with caplog.at_level(logging.WARNING):
        capture(Backend(), ShapeKey(size=2048))
    assert not fresh_prefill.GRAPHS and "cannot be captured whole" in caplog.text and not fresh_prefill.capturing()
    StandInGraph.fail = False
    capture(Backend(), ShapeKey(size=1024))  # no further bucket is tried
    assert len(StandInGraph.made) == 1 and not fresh_prefill.wanted(16)


def prefill(bs=1, prefix=0, mode=ForwardMode.EXTEND, mm=None):
    return SimpleNamespace(batch_size=bs, forward_mode=mode, extend_prefix_lens_cpu=[prefix] * bs, mm_inputs=[mm] * bs,
                           input_ids=torch.zeros(64, dtype=torch.long))


@pytest.mark.parametrize("batch, whole", [(prefill(), True), (prefill(bs=2), False), (prefill(prefix=256), False),
                                          (prefill(mode=ForwardMode.TARGET_VERIFY), False), (prefill(mm="an image"), False)])
def test_only_one_request_with_nothing_cached_replays_the_whole_graph(graphs, batch, whole):
    backend, key = Backend(), ShapeKey(size=64)
    capture(backend, key)
    backend._outputs[key] = "the bucket's output"
    sglang = []
    got = hook._replay_whole(lambda *args: sglang.append(args) or "breakable", backend, key, batch)
    (graph,) = StandInGraph.made
    assert (got, graph.replays, len(sglang)) == (("the bucket's output", 1, 0) if whole else ("breakable", 0, 1))


def live_batch(tracked: bool, index: int = 7, seqlen: int = 100) -> SimpleNamespace:
    return SimpleNamespace(mamba_track_mask=torch.tensor([tracked]), mamba_track_indices=torch.tensor([index]),
                           mamba_track_seqlens=torch.tensor([seqlen]))


def test_each_replay_first_copies_the_live_batchs_tracking_where_the_graph_reads_it(graphs):
    backend, key = Backend(), ShapeKey(size=64)
    capture(backend, key)
    backend._outputs[key] = "the bucket's output"
    buffers = hook.track_buffers(torch.device("cpu"))

    def execute(runner, forward_batch):  # the prefill runner's execute, down to the breakable backend's replay
        return hook._replay_whole(lambda *args: "breakable", backend, key, prefill())

    for live, expected in [(live_batch(True), ([True], [7], [100])), (live_batch(False, 3, 5), ([False], [3], [5]))]:
        assert hook._remember_live_batch(execute, "runner", live) == "the bucket's output"
        assert (buffers.mask.tolist(), buffers.index.tolist(), buffers.seqlen.tolist()) == expected
    no_cache = SimpleNamespace(mamba_track_mask=None, mamba_track_indices=None, mamba_track_seqlens=None)
    hook._remember_live_batch(execute, "runner", live_batch(True))
    hook._remember_live_batch(execute, "runner", no_cache)
    assert buffers.mask.tolist() == [False] and hook._live.batch is None  # the runner's batch is let go after


@pytest.mark.parametrize("batch, bucket, replays, expected", [
    (prefill(), 64, True, ["prepared", "whole"]),  # nothing of SGLang's metadata
    (prefill(), 64, False, ["prepared", "metadata", "breakable"]),  # the whole graph declined: made before the breakable
    (prefill(), 4096, True, ["metadata", "prepared", "breakable"]),  # no whole graph for the bucket
    (prefill(bs=2), 64, True, ["metadata", "prepared", "breakable"]),  # not a fresh prompt
])
def test_sglangs_attention_metadata_is_made_only_for_the_breakable_graph(graphs, monkeypatch, batch, bucket, replays,
                                                                         expected):
    backend, key = Backend(), ShapeKey(size=bucket)
    runner = SimpleNamespace(backend=backend)  # the prefill runner: its breakable graph backend
    capture(backend, ShapeKey(size=64))
    backend._outputs[key] = "whole"
    if not replays:
        monkeypatch.setattr(fresh_prefill, "replay", lambda key, graphed=True: False)
    events = []

    def metadata(runner_, forward_batch, static_forward_batch, num_tokens):
        assert (runner_, static_forward_batch, num_tokens) == (runner, batch, bucket)
        events.append("metadata")

    def execute(runner_, forward_batch):  # the runner's execute: load_batch's metadata, then the backend's replay
        hook._metadata_unless_whole(metadata, runner_, forward_batch, batch, bucket)
        events.append("prepared")
        out = hook._replay_whole(lambda *args: "breakable", backend, key, batch)
        return events.append(out)

    hook._remember_live_batch(execute, runner, live_batch(False))
    assert events == expected and hook._live.metadata is None


def test_put_off_metadata_does_not_outlive_its_forward(graphs):
    backend = Backend()
    capture(backend, ShapeKey(size=64))

    def failing(runner, forward_batch):
        hook._metadata_unless_whole(lambda *args: pytest.fail("made"), runner, forward_batch, prefill(), 64)
        raise RuntimeError("the forward failed before its replay")

    with pytest.raises(RuntimeError):
        hook._remember_live_batch(failing, SimpleNamespace(backend=backend), live_batch(False))
    assert hook._live.metadata is None


def test_the_switch_replays_the_breakable_graph(graphs, caplog):
    capture(Backend(), ShapeKey(size=64))
    key = next(iter(fresh_prefill.GRAPHS))
    with caplog.at_level(logging.INFO):
        assert fresh_prefill.replay(key) and not fresh_prefill.replay(key, graphed=False) and fresh_prefill.replay(key)
    assert StandInGraph.made[0].replays == 2
    assert caplog.text.count("prefill replayed whole for bucket 64") == 1  # each bucket's first replay
