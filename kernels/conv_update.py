"""The causal-conv1d update of a GDN layer's speculative block, all of the block's tokens at once.

Before the verify, each of a GDN layer's 8,192 channels runs a width-4 depthwise convolution over the block's
16 tokens, continuing the channel's conv state (its last 3 inputs); the verify keeps, for each step, the
window after that step (the commit restores the accepted step's), and the state is left holding the block's
last 3 inputs. SGLang's kernel walks the 16 tokens one after another, each load, product and store a
dependent step. Here each program loads its channels' tap inputs as [16, BLOCK_N] tiles and computes every
token at once, with SGLang's expressions in SGLang's order (bias, then the taps oldest first, then SiLU), so
outputs, windows and states are its bits.
"""

import torch
import triton
import triton.language as tl

from qflash.kernels import pdl

PAD_SLOT = tl.constexpr(-1)  # a batch entry with this conv-state slot is padding (SGLang's PAD_SLOT_ID): nothing is read or written


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
    mask_c = (chans < dim)[None, :]
    t = tl.arange(0, T)
    x_rows = x_ptr + b * stride_xb + chans[None, :] * stride_xc
    state_rows = state_ptr + slot * stride_sb + chans[None, :] * stride_sc
    win_rows = win_ptr + win_slot * stride_gb + t[:, None] * stride_gt + chans[None, :] * stride_gc
    if HAS_BIAS:
        acc = tl.load(bias_ptr + chans, mask=chans < dim, other=0.0).to(tl.float32)[None, :] + tl.zeros([T, BLOCK_N], tl.float32)
    else:
        acc = tl.zeros([T, BLOCK_N], tl.float32)
    for j in tl.static_range(WIDTH):  # tap j of token t reads input t + j - (WIDTH - 1): the state's for t + j < WIDTH - 1
        src = t + j - (WIDTH - 1)
        in_block = (src >= 0)[:, None]
        tap = tl.where(in_block,
                       tl.load(x_rows + src[:, None] * stride_xt, mask=in_block & mask_c, other=0.0),
                       tl.load(state_rows + (src + WIDTH - 1)[:, None] * stride_sj, mask=(~in_block) & mask_c, other=0.0))
        w = tl.load(w_ptr + chans * stride_wc + j * stride_wj, mask=chans < dim, other=0.0)
        acc += tap * w[None, :]
        if j > 0:  # the window after step t holds inputs t - WIDTH + 2 .. t: taps 1 .. WIDTH - 1
            tl.store(win_rows + (j - 1) * stride_gj, tap, mask=mask_c)
    acc = acc / (1 + tl.exp(-acc))
    tl.store(o_ptr + b * stride_ob + chans[None, :] * stride_oc + t[:, None] * stride_ot,
             acc.to(o_ptr.dtype.element_ty), mask=mask_c)
    kept = (t >= T - (WIDTH - 1))[:, None] & mask_c  # the state keeps the block's last WIDTH - 1 inputs
    last = tl.load(x_rows + t[:, None] * stride_xt, mask=kept, other=0.0)
    tl.debug_barrier()  # every thread's state reads are done before any thread overwrites the state
    tl.store(state_rows + (t - (T - (WIDTH - 1)))[:, None] * stride_sj, last, mask=kept)


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


BLOCK_N, NUM_WARPS = 32, 8  # channels per program: 256 programs for one request's 8,192 (BENCHMARKS.md, 2026-12-05)
