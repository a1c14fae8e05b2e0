"""Split-KV block attention (kernels/block_attention.py) against float64 attention on small shapes (CPU:
Triton's interpreter), with ragged prefixes, causal and bidirectional blocks and a sliding window that cuts
into the prefix. Agreement with SGLang's extend kernel at the real shapes: test_block_attention_gpu.py
(SGLang's kernel multiplies bf16 operands, which the interpreter cannot). The route: SGLang's Triton backend, with
qflash's plugin loaded, serves verify forwards with it on the block's k and v as the model hands them."""

import json
from types import SimpleNamespace

import pytest
import torch

from conftest import REPO, change_attributes, run_python

from qflash.kernels import block_attention as ba

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = {(64, 64): dict(NSPLIT=4, BLOCK_N=16, num_warps=4, num_stages=2)}


def problem(prefix_lens, heads=4, kv_heads=2, dim=64, block=16, pool=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(torch.bfloat16).to(DEVICE)  # noqa: E731
    bs = len(prefix_lens)
    slots = torch.randperm(pool, generator=g)[: sum(prefix_lens)]
    kv_indptr = torch.tensor([0, *torch.tensor(prefix_lens).cumsum(0).tolist()], dtype=torch.int32)
    return dict(
        q_extend=rand(bs * block, heads, dim), k_extend=rand(bs * block, kv_heads, dim), v_extend=rand(bs * block, kv_heads, dim),
        o_extend=torch.zeros(bs * block, heads, dim, dtype=torch.bfloat16, device=DEVICE),
        k_buffer=rand(pool, kv_heads, dim), v_buffer=rand(pool, kv_heads, dim),
        qo_indptr=torch.arange(0, (bs + 1) * block, block, dtype=torch.int32, device=DEVICE),
        kv_indptr=kv_indptr.to(DEVICE), kv_indices=slots.to(torch.int64).to(DEVICE),
        custom_mask=None, mask_indptr=None, max_len_extend=block, k_scale=1.0, v_scale=1.0)


def reference(p, causal, window):
    """float64 softmax attention; query i of a block sits at position plen + i, after its prefix."""
    q, o = p["q_extend"].double().cpu(), torch.empty(p["o_extend"].shape, dtype=torch.float64)
    block, heads, dim = p["max_len_extend"], q.shape[1], q.shape[2]
    group = heads // p["k_extend"].shape[1]
    indptr = p["kv_indptr"].cpu()
    for b in range(len(indptr) - 1):
        slots = p["kv_indices"].cpu()[indptr[b]: indptr[b + 1]]
        plen = len(slots)
        k = torch.cat([p["k_buffer"].cpu()[slots], p["k_extend"].cpu()[b * block:(b + 1) * block]]).double()
        v = torch.cat([p["v_buffer"].cpu()[slots], p["v_extend"].cpu()[b * block:(b + 1) * block]]).double()
        i = torch.arange(block)[:, None]
        j = torch.arange(plen + block)[None, :]
        visible = (j < plen) | ((j - plen <= i) if causal else True)
        if window:
            visible = visible & torch.where(j < plen, plen + i <= j + window, i <= j - plen + window)
        for h in range(heads):
            s = q[b * block:(b + 1) * block, h] @ k[:, h // group].T * dim ** -0.5
            o[b * block:(b + 1) * block, h] = torch.softmax(s.masked_fill(~visible, float("-inf")), -1) @ v[:, h // group]
    return o


# Two chunks of splits for the merge: a 300-key prefix reaches both (10 splits of 32 keys), 37 and 70 keys only the first
TWO_CHUNKS = {(64, 64): dict(NSPLIT=2 * ba.MERGE_CHUNK, BLOCK_N=16, num_warps=4, num_stages=2)}


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("window", [0, 20], ids=["full", "window-20"])
@pytest.mark.parametrize("configs, prefixes", [(SMALL, [37, 0, 70]), (TWO_CHUNKS, [37, 0, 70, 300])],
                         ids=["one-chunk", "two-chunks"])
def test_block_attention_matches_float64(monkeypatch, causal, window, configs, prefixes):
    """Prefixes shorter than a split, empty, over several splits; merged from one chunk of splits or from two."""
    monkeypatch.setattr(ba, "CONFIGS", configs)
    p = problem(prefixes, pool=512)
    assert ba.block_attention(**p, is_causal=causal, sliding_window_size=window or -1, max_bs=4)
    ref = reference(p, causal, window)
    assert (p["o_extend"].double().cpu() - ref).abs().max().item() < 0.03  # bf16 inputs, bf16 P as SGLang's kernel


def block_slots(p, rows: int, seed: int = 1) -> torch.Tensor:
    """`rows` cache slots of problem p's pool, in random order, that no prefix holds: where a block's KV goes."""
    free = torch.ones(p["k_buffer"].shape[0], dtype=torch.bool)
    free[p["kv_indices"].cpu()] = False
    picked = torch.randperm(int(free.sum()), generator=torch.Generator().manual_seed(seed))[:rows]
    return free.nonzero().flatten()[picked].to(p["kv_indices"].device)


def with_block_stored(p, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """p's k and v buffers as the block's KV write leaves them: k and v_extend at `slots`, every other row as it was."""
    k, v = p["k_buffer"].clone(), p["v_buffer"].clone()
    k[slots], v[slots] = p["k_extend"], p["v_extend"]
    return k, v


def test_the_block_is_stored_in_its_cache_slots(monkeypatch):
    """Given the block's cache slots, the kernel also stores k and v_extend there, in place of SGLang's KV write:
    exactly those rows change, to the block's, for requests with and without a prefix; the output is the same."""
    monkeypatch.setattr(ba, "CONFIGS", SMALL)
    p = problem([37, 0, 70])
    slots = block_slots(p, 48)
    expected_k, expected_v = with_block_stored(p, slots)
    p_store = dict(p, k_buffer=p["k_buffer"].clone(), v_buffer=p["v_buffer"].clone(), o_extend=p["o_extend"].clone())
    assert ba.block_attention(**p, is_causal=True, max_bs=4)
    assert ba.block_attention(**p_store, is_causal=True, max_bs=4, out_cache_loc=slots)
    assert torch.equal(p_store["k_buffer"], expected_k) and torch.equal(p_store["v_buffer"], expected_v)
    assert torch.equal(p_store["o_extend"], p["o_extend"])


def test_the_real_configs_run_qwen35_head_shapes():
    p = problem([50], heads=32, kv_heads=8, dim=128, seed=5)  # the DFlash drafter's heads, its real config
    assert ba.block_attention(**p, is_causal=False, sliding_window_size=4095, max_bs=1)
    assert (p["o_extend"].double().cpu() - reference(p, False, 4095)).abs().max().item() < 0.03


def test_cases_it_does_not_serve_are_left_to_sglang():
    p = problem([10], dim=96)  # no config for this head dim
    assert not ba.block_attention(**p, is_causal=True)
    p = problem([10], dim=128)
    assert not ba.block_attention(**dict(p, custom_mask=torch.ones(1, dtype=torch.bool)), is_causal=True)
    assert not ba.block_attention(**dict(p, max_len_extend=8), is_causal=True)
    assert not ba.block_attention(**dict(p, k_scale=0.5), is_causal=True)
    assert not ba.block_attention(**p, is_causal=True, logit_cap=30.0)
    assert not ba.block_attention(**problem([10], heads=6, kv_heads=2, dim=128), is_causal=True)  # 3 heads per KV head
    assert p["o_extend"].abs().max() == 0  # nothing was written


ROUTE = """
import json, sys, torch
from types import SimpleNamespace as NS
sys.path.insert(0, sys.argv[4])
from conftest import Dispatched
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, UnquantizedKVCacheMethod
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from qflash.kernels import block_attention as ba

attn_type, window, dev = AttentionType[sys.argv[1]], int(sys.argv[2]), sys.argv[3]
ba.CONFIGS = {(64, 64): dict(NSPLIT=4, BLOCK_N=16, num_warps=4, num_stages=2)}
HEADS, KV_HEADS, DIM, BLOCK, POOL = 4, 2, 64, 16, 128
g = torch.Generator().manual_seed(0)
rand = lambda *shape: torch.randn(*shape, generator=g).to(torch.bfloat16).to(dev)
prefixes = [37, 5]
T = BLOCK * len(prefixes)
slots = torch.randperm(POOL, generator=g).to(dev)
prefix_slots, block_slots = slots[:sum(prefixes)], slots[sum(prefixes):sum(prefixes) + T]
indptr = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
# a sliding-window layer reads the window's own indices (the last 20 keys of each prefix here)
kept = [min(n, 20) for n in prefixes]
window_slots = torch.cat([prefix_slots[s + n - w:s + n] for s, n, w in zip([0, 37], prefixes, kept)])
meta = NS(qo_indptr=indptr([BLOCK] * len(prefixes)), kv_indptr=indptr(prefixes), kv_indices=prefix_slots,
          window_kv_indptr=indptr(kept), window_kv_indices=window_slots, window_kv_offsets=None, custom_mask=None,
          mask_indptr=None, max_extend_len=BLOCK, swa_out_cache_loc=None, out_cache_loc_full_physical=None)
layer = NS(layer_id=0, tp_q_head_num=HEADS, tp_k_head_num=KV_HEADS, qk_head_dim=DIM, v_head_dim=DIM, k_scale=None,
           v_scale=None, is_cross_attention=False, attn_type=attn_type, sliding_window_size=window,
           logit_capping_method="tanh", logit_cap=0.0, scaling=DIM ** -0.5, xai_temperature_len=-1)
batch = NS(forward_mode=ForwardMode.TARGET_VERIFY, out_cache_loc=block_slots)
k_cache, v_cache = rand(POOL, KV_HEADS, DIM), rand(POOL, KV_HEADS, DIM)
# q | k | v of one projection, as the model hands them to the attention: column slices, k and v viewed by head
q, k, v = rand(T, (HEADS + 2 * KV_HEADS) * DIM).split([HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM], dim=1)
k, v = k.view(T, KV_HEADS, DIM), v.view(T, KV_HEADS, DIM)

class Pool:
    def __init__(self):
        self.k, self.v = k_cache.clone(), v_cache.clone()
    def get_key_buffer(self, layer_id):
        return self.k
    def get_value_buffer(self, layer_id):
        return self.v
    def set_kv_buffer(self, layer, loc, k, v):
        self.k[loc.loc], self.v[loc.loc] = k, v

def never(*args, **kwargs):
    raise AssertionError("SGLang's extend kernel ran")

def backend(pool=None, **route):
    b = TritonAttnBackend.__new__(TritonAttnBackend)
    vars(b).update(page_size=1, dcp_size=1, enable_deterministic=False, allow_bidirectional_attention_in_extend=False,
                   token_to_kv_pool=pool or Pool(), forward_metadata=meta, req_to_token_pool=NS(size=4),
                   extend_attention_fwd=never, **route)
    return b

def plain_pool():  # SGLang's own pool of plain rows by slot (its fields, no allocation); its KV write must not run
    pool = MHATokenToKVPool.__new__(MHATokenToKVPool)
    vars(pool).update(k_buffer=[k_cache.clone()], v_buffer=[v_cache.clone()], start_layer=0, layer_transfer_counter=None,
                      quant_method=UnquantizedKVCacheMethod(), dtype=torch.bfloat16, store_dtype=torch.bfloat16, use_hnd=False,
                      kv_cache_layout="nhd", set_kv_buffer=never)
    return pool

def forward(b):  # the output, and which of k and v the forward copied
    with Dispatched() as ops:
        o = TritonAttnBackend.forward_extend(b, q, k, v, layer, batch)
    clones = [args[0].data_ptr() for func, args in ops.calls if func is torch.ops.aten.clone.default]
    return o, [name for name, t in (("k", k), ("v", v)) if t.data_ptr() in clones]

# SGLang's route: its verify hook handed copies of k and v (qflash's kernel behind it, as before this change)
stock = backend(use_verify_splitkv=True, verify_splitkv_fwd=ba.block_attention)
stock_o, stock_copies = forward(stock)
from sglang.srt.plugins import load_plugins
load_plugins()
mine = backend(use_verify_splitkv=False, verify_splitkv_fwd=never)
mine_o, mine_copies = forward(mine)
plain = backend(pool=plain_pool(), use_verify_splitkv=False, verify_splitkv_fwd=never)
plain_o, plain_copies = forward(plain)
print(json.dumps({"output equal": torch.equal(stock_o, mine_o), "output written": bool(mine_o.abs().sum() > 0),
                  "kv equal": torch.equal(stock.token_to_kv_pool.k, mine.token_to_kv_pool.k)
                              and torch.equal(stock.token_to_kv_pool.v, mine.token_to_kv_pool.v),
                  "block written": torch.equal(mine.token_to_kv_pool.v[block_slots], v),
                  "copies": [stock_copies, mine_copies],
                  "plain pool: output equal": torch.equal(stock_o, plain_o),
                  "plain pool: kv equal by the kernel": torch.equal(stock.token_to_kv_pool.k, plain.token_to_kv_pool.k_buffer[0])
                              and torch.equal(stock.token_to_kv_pool.v, plain.token_to_kv_pool.v_buffer[0]),
                  "plain pool: copies": plain_copies}))
"""


@pytest.mark.parametrize("attn_type, window", [("DECODER", -1), ("DECODER", 20), ("ENCODER_ONLY", -1)],
                         ids=["target", "draft-window", "draft-full"])
def test_verify_forwards_run_block_attention_on_k_and_v_uncopied(attn_type, window):
    """SGLang's Triton backend, hooked, serves a verify forward with qflash's kernel on the block's k and v as the
    model hands them (strided column slices of the qkv projection): SGLang's route handed the same kernel copies.
    Same output and KV cache bit for bit; the copies are gone. In SGLang's pool of plain rows the kernel writes the
    block's KV itself (the pool's write would raise), with the same cache as a result."""
    result = run_python(ROUTE, attn_type, str(window), DEVICE, str(REPO / "tests"), env={"SGLANG_PLUGINS": "qflash"})
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found == {"output equal": True, "output written": True, "kv equal": True, "block written": True,
                     "copies": [["k", "v"], []], "plain pool: output equal": True,
                     "plain pool: kv equal by the kernel": True, "plain pool: copies": []}


def stand_ins(**changes) -> tuple:
    """A verify forward the hook serves, with no tensor read: backend, layer, batch; `changes` replaces one of their
    attributes, named `object.attribute`."""
    objects = {"backend": SimpleNamespace(page_size=1, dcp_size=1, enable_deterministic=False,
                                          token_to_kv_pool=SimpleNamespace()),  # no pool the kernel writes
               "layer": SimpleNamespace(k_scale=None),
               "batch": SimpleNamespace(forward_mode=SimpleNamespace(is_target_verify=lambda: True), out_cache_loc=None)}
    change_attributes(objects, changes)
    return objects["backend"], objects["layer"], objects["batch"]


@pytest.mark.parametrize("changes, k, sinks", [
    ({"batch.forward_mode": SimpleNamespace(is_target_verify=lambda: False)}, 1, None),  # a prefill
    ({}, None, None),  # no new KV (a layer sharing another's)
    ({"backend.page_size": 16}, 1, None),  # kv_indices would hold pages
    ({"layer.k_scale": 0.5}, 1, None),  # scaled KV
    ({"backend.dcp_size": 2}, 1, None),
    ({"backend.enable_deterministic": True}, 1, None),
    ({"batch._attn_output": 1}, 1, None),
    ({}, 1, torch.zeros(1)),  # attention sinks
])
def test_forwards_the_hook_does_not_serve_run_sglangs_code(changes, k, sinks):
    from qflash.server.hooks.attention import _block_on_strided_kv

    backend, layer, batch = stand_ins(**changes)
    called = _block_on_strided_kv(lambda *args, **kwargs: "sglang", backend, None, k, k, layer, batch, sinks=sinks)
    assert called == "sglang"


def test_an_argument_sglang_does_not_know_reaches_its_code_which_refuses_it():
    from qflash.server.hooks.attention import _block_on_strided_kv

    backend, layer, batch = stand_ins()
    seen = _block_on_strided_kv(lambda *args, **kwargs: kwargs, backend, None, 1, 1, layer, batch, layer_id=3)
    assert seen["layer_id"] == 3


def test_a_block_the_kernel_declines_runs_sglangs_attention_on_the_written_kv(monkeypatch):
    from qflash.server.hooks import attention

    monkeypatch.setattr(attention, "_block_attention", lambda *args: None)
    writes = []
    monkeypatch.setattr(attention, "_write_kv", lambda *args: writes.append(args))
    backend, layer, batch = stand_ins()
    calls = []
    attention._block_on_strided_kv(lambda *args, **kwargs: calls.append(kwargs), backend, None, 1, 1, layer, batch)
    assert len(writes) == 1 and [c["save_kv_cache"] for c in calls] == [False]


def test_a_block_the_kernel_declines_in_a_plain_pool_leaves_the_kv_write_to_sglang(monkeypatch):
    """Where the kernel would have written the KV (a pool of plain rows) but declines the block, SGLang's attention
    writes it: nothing was written before."""
    from qflash.server.hooks import attention

    monkeypatch.setattr(attention, "_block_attention", lambda *args: None)
    monkeypatch.setattr(attention, "_plain_kv_slots", lambda *args: torch.arange(16))
    monkeypatch.setattr(attention, "_write_kv", lambda *args: pytest.fail("the hook wrote the KV"))
    backend, layer, batch = stand_ins()
    calls = []
    attention._block_on_strided_kv(lambda *args, **kwargs: calls.append(kwargs), backend, None, 1, 1, layer, batch)
    assert [c["save_kv_cache"] for c in calls] == [True]
