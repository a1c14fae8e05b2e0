"""A fresh prompt's prefill as one CUDA graph (graphs/fresh_prefill.py, server/hooks/fresh_prefill.py) on the CPU.

- The GDN layer's in-line prefill (qflash's recurrent kernel in Triton's interpreter; SGLang's conv, split and
  gating as torch stand-ins that leave the padding unwritten, as the conv does) gives a prompt padded to its bucket
  the output rows and states of the same prompt unpadded, and leaves every other slot alone.
- Capture and replay with a stand-in graph: which buckets are captured, the body run eagerly in line and then
  captured, a failed capture leaving the breakable graphs, a replay only for one request with nothing cached whose
  prefill the radix cache does not checkpoint (the whole graph writes no checkpoint: SGLang's prefill runner keeps
  no tracking buffers under speculative decoding).
The whole graphs are checked against the breakable ones on the H200 (tests/test_fresh_prefill_gpu.py).
"""

import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.runner.shape_key import ShapeKey

from qflash.graphs import fresh_prefill
from qflash.graphs.policy import FRESH_PREFILL_MAX_TOKENS
from qflash.server.hooks import fresh_prefill as hook

CHUNK, CONV = 64, 3  # SGLang's mamba_cache_chunk_size (FLA's chunk, page size 1) and the conv state's width


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


@pytest.fixture
def in_line(monkeypatch):
    """A fresh-prompt graph's warm-up in progress (its layers run in line), with SGLang's kernels stood in for."""
    from sglang.srt.layers.attention.linear import gdn_backend

    monkeypatch.setattr(gdn_backend, "causal_conv1d_fn", stand_in_conv)
    monkeypatch.setattr(gdn_backend, "fused_qkv_split_gdn_prefill", stand_in_split, raising=False)
    monkeypatch.setattr(gdn_backend, "fused_gdn_gating", stand_in_gating)
    monkeypatch.setattr("sglang.srt.runtime_context.get_server_args", lambda: SimpleNamespace(mamba_cache_chunk_size=CHUNK))
    monkeypatch.setattr(fresh_prefill, "_capture", SimpleNamespace(active=True, metadata=None, broken=False))


def pools(slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The conv and recurrent state pools before a prefill: other requests' states in every slot but the fresh
    request's, cleared before its prefill as SGLang's scheduler clears it."""
    conv = torch.randn(SLOTS, DIM, CONV, generator=torch.Generator().manual_seed(1))
    ssm = torch.randn(SLOTS, HV, V, K, generator=torch.Generator().manual_seed(2))
    ssm[slot] = 0
    return conv, ssm


def gdn_prefill(prompt, a, b, layer, *, tokens, slot=2, seed=0):
    """One GDN layer's prefill of `prompt` ([n, DIM]) padded with noise to `tokens` rows; (output, pools)."""
    n = prompt.shape[0]
    gen = torch.Generator().manual_seed(seed)
    pad = lambda t: torch.cat([t, torch.randn(tokens - n, t.shape[1], generator=gen) * 100])  # padding rows: anything
    conv, ssm = pools(slot)
    pool = SimpleNamespace(mamba2_layer_cache=lambda layer_id: SimpleNamespace(conv=[conv], temporal=ssm),
                           get_mamba_indices=lambda rows: torch.tensor([slot], dtype=torch.int32)[rows])
    backend = SimpleNamespace(req_to_token_pool=pool, conv_states_shape=conv.shape, _translate_mamba_indices=lambda i: i)
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
def test_a_padded_prompt_prefills_as_the_prompt_alone_in_its_own_slot(in_line, n, bucket):
    layer, prompt, a, b = layer_and_prompt(n)
    alone, conv, ssm = gdn_prefill(prompt, a, b, layer, tokens=n)
    padded, conv_p, ssm_p = gdn_prefill(prompt, a, b, layer, tokens=bucket)
    assert torch.equal(padded[:, :n], alone) and not padded[:, n:].any()
    assert torch.equal(conv_p, conv) and torch.equal(ssm_p, ssm)
    before_conv, before_ssm = pools(2)
    others = [i for i in range(SLOTS) if i != 2]
    assert torch.equal(conv[others], before_conv[others]) and torch.equal(ssm[others], before_ssm[others])
    assert not torch.equal(conv[2], before_conv[2]) and ssm[2].any()  # the request's slot (2) holds its states


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


def server_args(checkpoints: bool) -> SimpleNamespace:
    """SGLang's server arguments as the hooks read them: whether the radix cache checkpoints GDN states."""
    return SimpleNamespace(mamba_cache_chunk_size=CHUNK, enable_mamba_extra_buffer=lambda: checkpoints)


@pytest.fixture
def graphs(monkeypatch):
    monkeypatch.setattr("sglang.srt.runtime_context.get_server_args", lambda: server_args(False))
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


def test_with_the_radix_cache_checkpointing_only_buckets_up_to_one_chunk_are_captured_whole(graphs, monkeypatch):
    monkeypatch.setattr("sglang.srt.runtime_context.get_server_args", lambda: server_args(True))
    backend = Backend()
    for size in (16, CHUNK, CHUNK + 16, FRESH_PREFILL_MAX_TOKENS):
        capture(backend, ShapeKey(size=size))
    assert set(fresh_prefill.GRAPHS) == {(id(backend), 16), (id(backend), CHUNK)}


def test_a_failed_capture_leaves_the_breakable_graphs(graphs, caplog):
    StandInGraph.fail = True
    with caplog.at_level(logging.WARNING):
        capture(Backend(), ShapeKey(size=2048))
    assert not fresh_prefill.GRAPHS and "cannot be captured whole" in caplog.text and not fresh_prefill.capturing()
    StandInGraph.fail = False
    capture(Backend(), ShapeKey(size=1024))  # no further bucket is tried
    assert len(StandInGraph.made) == 1 and not fresh_prefill.wanted(16)


def prefill(bs=1, prefix=0, mode=ForwardMode.EXTEND, mm=None, tokens=CHUNK - 1, tracking=True):
    """A prefill runner's static batch; `tracking`: the radix cache's extra-buffer checkpoints are on (server args)."""
    return SimpleNamespace(batch_size=bs, forward_mode=mode, extend_prefix_lens_cpu=[prefix] * bs, mm_inputs=[mm] * bs,
                           extend_seq_lens_cpu=[tokens] * bs, tracking=tracking)


@pytest.mark.parametrize("batch, whole", [(prefill(), True), (prefill(bs=2), False), (prefill(prefix=256), False),
                                          (prefill(mode=ForwardMode.TARGET_VERIFY), False), (prefill(mm="an image"), False),
                                          (prefill(tokens=CHUNK), False), (prefill(tokens=2000, tracking=False), True)],
                         ids=["plain", "batch", "cached", "verify", "image", "checkpointed", "no-radix-cache"])
def test_only_one_request_with_nothing_cached_and_no_checkpoint_replays_the_whole_graph(graphs, batch, whole, monkeypatch):
    """The static batch has no tracking buffers under speculative decoding (mamba_track_mask None): the server's
    arguments say whether the scheduler checkpoints."""
    monkeypatch.setattr("sglang.srt.runtime_context.get_server_args", lambda: server_args(batch.tracking))
    backend, key = Backend(), ShapeKey(size=64)
    capture(backend, key)
    backend._outputs[key] = "the bucket's output"
    sglang = []
    got = hook._replay_whole(lambda *args: sglang.append(args) or "breakable", backend, key, batch)
    (graph,) = StandInGraph.made
    assert (got, graph.replays, len(sglang)) == (("the bucket's output", 1, 0) if whole else ("breakable", 0, 1))


def test_the_switch_replays_the_breakable_graph(graphs, caplog):
    capture(Backend(), ShapeKey(size=64))
    key = next(iter(fresh_prefill.GRAPHS))
    with caplog.at_level(logging.INFO):
        assert fresh_prefill.replay(key) and not fresh_prefill.replay(key, graphed=False) and fresh_prefill.replay(key)
    assert StandInGraph.made[0].replays == 2
    assert caplog.text.count("prefill replayed whole for bucket 64") == 1  # each bucket's first replay


def test_sglangs_prefill_runner_keeps_no_tracking_buffers_under_speculative_decoding():
    """Why a whole graph cannot checkpoint (server/hooks/fresh_prefill.py `checkpointed`): it is captured from the
    prefill runner's static batch, which has no tracking fields when a speculative algorithm runs; and the server
    arguments `checkpointed` reads instead exist."""
    from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import PrefillCudaGraphRunner
    from sglang.srt.server_args import ServerArgs

    def runner(spec_none: bool):
        args = SimpleNamespace(enable_mamba_extra_buffer=lambda: True, disable_radix_cache=False)
        return SimpleNamespace(model_runner=SimpleNamespace(server_args=args, spec_algorithm=SimpleNamespace(
            is_none=lambda: spec_none)))

    assert PrefillCudaGraphRunner._is_mamba_track_enabled(runner(spec_none=True))
    assert not PrefillCudaGraphRunner._is_mamba_track_enabled(runner(spec_none=False))
    assert callable(ServerArgs.enable_mamba_extra_buffer)
    assert isinstance(ServerArgs.mamba_cache_chunk_size, property)
