"""The causal-conv1d update of a GDN layer's speculative block, all of the block's tokens at once.

Before the verify, each of a GDN layer's 8,192 channels runs a width-4 depthwise convolution over the block's
16 tokens, continuing the channel's conv state (its last 3 inputs); the verify keeps, for each step, the
window after that step (the commit restores the accepted step's), and the state is left holding the block's
last 3 inputs. SGLang's kernel walks the 16 tokens one after another, each load, product and store a
dependent step. Here each program loads its channels' tap inputs as [16, BLOCK_N] tiles and computes every
token at once, with SGLang's expressions in SGLang's order (bias, then the taps oldest first, then SiLU), so
outputs, windows and states are its bits.
"""

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from qflash.kernels import pdl

PAD_SLOT = tl.constexpr(-1)  # a batch entry with this conv-state slot is padding (SGLang's PAD_SLOT_ID): nothing is read or written


@triton.jit
def conv_rows(x_own, stride_xt, t, state_rows, stride_sj, win_rows, stride_gj, w_ptr, stride_wc, stride_wj, bias_ptr,
              chans, mask_c, mask, WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The conv of a tile of rows [R, C], each a token t of some request's block: x_own points at each row's own
    input (the request's inputs stride_xt apart), state_rows at its request's conv state, win_rows at the window of
    its step, which is stored; mask_c [C] holds the channels that exist, mask [R, C] the entries to compute.
    Returns (the SiLU outputs in fp32, each row's own input)."""
    if HAS_BIAS:
        acc = tl.load(bias_ptr + chans, mask=mask_c, other=0.0).to(tl.float32)[None, :] + tl.zeros(mask.shape, tl.float32)
    else:
        acc = tl.zeros(mask.shape, tl.float32)
    for j in tl.static_range(WIDTH):  # tap j of token t reads input t + j - (WIDTH - 1): the state's for t + j < WIDTH - 1
        src = t + j - (WIDTH - 1)
        in_block = (src >= 0)[:, None]
        tap = tl.where(in_block,
                       tl.load(x_own + (j - (WIDTH - 1)) * stride_xt, mask=in_block & mask, other=0.0),
                       tl.load(state_rows + (src + WIDTH - 1)[:, None] * stride_sj, mask=(~in_block) & mask, other=0.0))
        w = tl.load(w_ptr + chans * stride_wc + j * stride_wj, mask=mask_c, other=0.0)
        acc += tap * w[None, :]
        if j > 0:  # the window after step t holds inputs t - WIDTH + 2 .. t: taps 1 .. WIDTH - 1
            tl.store(win_rows + (j - 1) * stride_gj, tap, mask=mask)
    return acc / (1 + tl.exp(-acc)), tap


@triton.jit
def conv_finish(o_rows, out, state_rows, stride_sj, own, t, mask, T: tl.constexpr, WIDTH: tl.constexpr):
    """Stores the outputs (o_rows may be the rows' own inputs) and moves each request's state to its block's last
    WIDTH - 1 inputs, once every thread's reads of inputs and states are done."""
    tl.debug_barrier()
    tl.store(o_rows, out.to(o_rows.dtype.element_ty), mask=mask)
    kept = (t >= T - (WIDTH - 1))[:, None] & mask
    tl.store(state_rows + (t - (T - (WIDTH - 1)))[:, None] * stride_sj, own, mask=kept)


@triton.jit
def _conv_update_kernel(x_ptr, w_ptr, bias_ptr, state_ptr, slots_ptr, win_ptr, win_slots_ptr, o_ptr, dim,
                        stride_xb, stride_xc, stride_xt, stride_wc, stride_wj, stride_sb, stride_sc, stride_sj,
                        stride_gb, stride_gt, stride_gc, stride_gj, stride_ob, stride_oc, stride_ot,
                        T: tl.constexpr, WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                        PDL: tl.constexpr):
    pdl.enter(PDL)
    b = tl.program_id(0)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    if slot == PAD_SLOT:
        return
    win_slot = tl.load(win_slots_ptr + b).to(tl.int64)
    chans = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    t = tl.arange(0, T)
    mask_c = chans < dim
    mask = (t < T)[:, None] & mask_c[None, :]
    x_own = x_ptr + b * stride_xb + chans[None, :] * stride_xc + t[:, None] * stride_xt
    state_rows = state_ptr + slot * stride_sb + chans[None, :] * stride_sc
    win_rows = win_ptr + win_slot * stride_gb + t[:, None] * stride_gt + chans[None, :] * stride_gc
    out, own = conv_rows(x_own, stride_xt, t, state_rows, stride_sj, win_rows, stride_gj, w_ptr, stride_wc, stride_wj,
                         bias_ptr, chans, mask_c, mask, WIDTH, HAS_BIAS)
    conv_finish(o_ptr + b * stride_ob + chans[None, :] * stride_oc + t[:, None] * stride_ot, out, state_rows, stride_sj,
                own, t, mask, T, WIDTH)


@triton.jit
def conv_prologue(offs_m, offs_n, M, width, w_ptr, bias_ptr, state_ptr, slots_ptr, win_slots_ptr, stride_wc,
                  stride_sb, stride_sc, stride_sj, T: tl.constexpr, WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr,
                  PDL: tl.constexpr):
    """What `conv_in_place` reads that the GEMM does not write, before the GEMM's PDL wait: the rows' state and window
    slots (written at the cycle's start, many launches back), returned; the conv's weights and the rows' states
    (written a cycle back, out of L2 since) asked into L2, where after the K loop they are read without a miss in
    HBM behind the slots' load."""
    rows = offs_m < M
    b = offs_m // T
    slot = pdl.load_settled(slots_ptr + b, mask=rows, other=PAD_SLOT).to(tl.int64)
    win_slot = pdl.load_settled(win_slots_ptr + b, mask=rows, other=0).to(tl.int64)
    chans = offs_n < width
    from_state = rows & (slot != PAD_SLOT) & (offs_m % T < WIDTH - 1)  # one row a state input: every state's line
    states = state_ptr + slot[:, None] * stride_sb + offs_n[None, :] * stride_sc + (offs_m % T)[:, None] * stride_sj
    pdl.prefetch(states, from_state[:, None] & chans[None, :], PDL)
    pdl.prefetch(w_ptr + offs_n * stride_wc, chans, PDL)
    if HAS_BIAS:
        pdl.prefetch(bias_ptr + offs_n, chans, PDL)
    return slot, win_slot


@triton.jit
def conv_in_place(y_ptr, offs_m, offs_n, M, width, slot, win_slot, w_ptr, bias_ptr, state_ptr, win_ptr, stride_wc,
                  stride_wj, stride_sb, stride_sc, stride_sj, stride_gb, stride_gt, stride_gc, stride_gj,
                  T: tl.constexpr, WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The conv update of a tile of rows a GEMM program has just stored into y ([M, width] row-major, token m of the
    batch's blocks of T), in place: the tile holds whole blocks, so every tap it reads is its own or a state's.
    slot, win_slot: the rows' (`conv_prologue`)."""
    tl.debug_barrier()  # the tile's stores are in before any thread reads another's rows
    t = offs_m % T
    mask_c = offs_n < width
    mask = ((offs_m < M) & (slot != PAD_SLOT))[:, None] & mask_c[None, :]
    x_own = y_ptr + offs_m[:, None] * width + offs_n[None, :]
    state_rows = state_ptr + slot[:, None] * stride_sb + offs_n[None, :] * stride_sc
    win_rows = win_ptr + win_slot[:, None] * stride_gb + t[:, None] * stride_gt + offs_n[None, :] * stride_gc
    out, own = conv_rows(x_own, width, t, state_rows, stride_sj, win_rows, stride_gj, w_ptr, stride_wc, stride_wj,
                         bias_ptr, offs_n, mask_c, mask, WIDTH, HAS_BIAS)
    conv_finish(x_own, out, state_rows, stride_sj, own, t, mask, T, WIDTH)


def takes(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias=None, activation=None, **kwargs) -> bool:
    """Whether this kernel serves a call of SGLang's `causal_conv1d_update`: a SiLU block of at least width - 1
    tokens (a power of two) per request, so the new state holds block inputs only, chained (no EAGLE tree), saving
    per-step windows, with a state of exactly width - 1 inputs."""
    width = weight.shape[1]
    return (x.dim() == 3 and activation in ("silu", "swish", True) and kwargs.get("intermediate_conv_window") is not None
            and kwargs.get("conv_state_indices") is not None and kwargs.get("intermediate_state_indices") is not None
            and all(kwargs.get(name) is None for name in
                    ("cache_seqlens", "num_accept_tokens", "retrieve_next_token", "retrieve_next_sibling", "retrieve_parent_token"))
            and kwargs.get("pad_slot_id", PAD_SLOT.value) == PAD_SLOT.value
            and conv_state.shape[-1] == width - 1 and x.shape[-1] >= width - 1 and x.shape[-1] & (x.shape[-1] - 1) == 0)


def conv_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias=None, activation="silu", *,
                conv_state_indices: torch.Tensor, intermediate_conv_window: torch.Tensor,
                intermediate_state_indices: torch.Tensor, **unused) -> torch.Tensor:
    """SGLang's `causal_conv1d_update` for what `takes` accepts: x [batch, dim, T] (any strides), conv_state
    [slots, dim, width - 1], weight [dim, width], windows [slots, T, dim, width - 1]. Returns the SiLU outputs
    [batch, dim, T] laid out as x is; updates conv_state and the windows in place."""
    batch, dim, T = x.shape
    out = torch.empty_like(x)
    win = intermediate_conv_window
    _conv_update_kernel[(batch, triton.cdiv(dim, BLOCK_N))](
        x, weight, bias if bias is not None else weight, conv_state, conv_state_indices, win, intermediate_state_indices,
        out, dim, *x.stride(), *weight.stride(), *conv_state.stride(), *win.stride(), *out.stride(),
        T=T, WIDTH=weight.shape[1], HAS_BIAS=bias is not None, BLOCK_N=BLOCK_N, num_warps=NUM_WARPS,
        **pdl.options(x.device))
    return out


class Epilogue(NamedTuple):
    """A `conv_update` call run by the epilogue of the GEMM that writes its input (`conv_in_place`)."""

    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    state: torch.Tensor
    slots: torch.Tensor
    windows: torch.Tensor
    window_slots: torch.Tensor
    block: int  # tokens a request

    def arguments(self) -> tuple:
        """The GEMM kernel's conv arguments."""
        return (self.weight, self.weight if self.bias is None else self.bias, self.state, self.slots, self.windows,
                self.window_slots, *self.weight.stride(), *self.state.stride(), *self.windows.stride())

    def constants(self) -> dict:
        return dict(CONV_T=self.block, CONV_WIDTH=self.weight.shape[1], CONV_BIAS=self.bias is not None)


def epilogue(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias=None, activation="silu", *,
             conv_state_indices: torch.Tensor, intermediate_conv_window: torch.Tensor,
             intermediate_state_indices: torch.Tensor, **unused) -> Epilogue:
    """`conv_update`'s call as a GEMM epilogue, for the GEMM that writes x."""
    return Epilogue(weight, bias, conv_state, conv_state_indices, intermediate_conv_window, intermediate_state_indices,
                    x.shape[-1])


def no_epilogue(y: torch.Tensor) -> tuple[tuple, dict]:
    """The GEMM kernel's conv arguments and constants where it runs none."""
    return (y,) * 6 + (0,) * 9, dict(CONV_T=0, CONV_WIDTH=0, CONV_BIAS=False)


BLOCK_N, NUM_WARPS = 32, 8  # channels per program: 256 programs for one request's 8,192 (BENCHMARKS.md, 2026-12-05)
