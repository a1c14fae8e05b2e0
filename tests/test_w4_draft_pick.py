"""The draft's pick from a 4-bit copy of the int8 lm_head (kernels/w4_draft_pick.py): the copy's layout and error,
the scan's tile maxima, and the finalists scored on the int8 rows. CPU: Triton's interpreter (the nibbles decoded by
plain Triton); the GPU tests run the inline assembly that decodes them when served, at the real vocabulary."""

import pytest
import torch

from qflash.kernels import w4_draft_pick, w8a16_argmax
from qflash.server.tools.shapes import LM_HEAD

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GROUP, HALF = w4_draft_pick.GROUP, w4_draft_pick.GROUP // 2
CONFIG = dict(BLOCK_M=16, BLOCK_N=128, num_warps=4, num_stages=2)


def head(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8).to(DEVICE),
            (torch.rand(n, generator=gen) * 0.01 + 1e-3).to(DEVICE))


def dequantized(w4: torch.Tensor, amax: torch.Tensor, n: int) -> torch.Tensor:
    """The copy's values in int8 units, read by the layout the module states (independently of its code)."""
    k = w4.shape[1] * 2
    groups = w4[:n].view(n, k // GROUP, HALF).long()
    values = torch.cat([(groups & 15) - 8, (groups >> 4) - 8], dim=-1).view(n, k).double()
    return values * amax[:, :n].t().double().repeat_interleave(GROUP, dim=1) / 7


def exact_logits(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().t()) * scale.double()


def test_the_copy_is_within_half_a_step_of_the_int8_rows_in_the_stated_layout():
    w, _ = head(300, 2 * GROUP)
    w[0, :GROUP] = 0  # an all-zero group
    w[1, :GROUP] = torch.tensor([127, -127, 64, -64] + [0] * (GROUP - 4), dtype=torch.int8)
    w[1, HALF] = 91  # the first column of the group's high nibbles
    w4, amax = w4_draft_pick.quantize(w, rows_per_step=128)  # slices that end inside the rows
    assert w4.shape == (512, GROUP) and amax.shape == (2, 512)  # rows padded to the row tile
    deq = dequantized(w4, amax, 300)
    step = amax[:, :300].t().double().repeat_interleave(GROUP, dim=1) / 7
    assert ((deq - w.double()).abs() <= step / 2 + 1e-9).all()
    assert deq[0, :GROUP].abs().sum() == 0 and amax[0, 0] == 0
    assert deq[1, :5].tolist() == [127, -127, 4 * 127 / 7, -4 * 127 / 7, 0] and deq[1, HALF] == 5 * 127 / 7
    assert int(w4[1, 0]) == (7 + 8) | ((5 + 8) << 4)  # column 0 low, column HALF high
    assert (w4[300:] == 0x88).all() and (amax[:, 300:] == 0).all()  # padding reads as zeros


@pytest.mark.parametrize("m", [1, 15, 40])
def test_the_scans_tile_maxima_are_the_copys_logits(m):
    n, k = 1000, 2 * GROUP
    w, scale = head(n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).to(DEVICE)
    w4, amax = w4_draft_pick.quantize(w)
    tile_max, tile_idx = w4_draft_pick.scan(x, w4, amax, scale, n, CONFIG)
    ref = (x.double() @ dequantized(w4, amax, n).t()) * scale.double()
    ref = torch.cat([ref, torch.full((m, 1024 - n), float("-inf"), dtype=ref.dtype, device=DEVICE)], 1)
    assert torch.allclose(tile_max.double(), ref.view(m, 8, 128).amax(-1), rtol=1e-5, atol=1e-6)
    assert torch.allclose(ref.gather(1, tile_idx.long()), tile_max.double(), rtol=1e-5, atol=1e-6)


def test_the_finalists_are_scored_on_the_int8_rows():
    # One-hot x reads column 0. Token 3 leads in int8 (98 > 97) but its group's step (127 / 7) rounds it down to
    # 5 steps (90.7), under token 700's 97 (its step 97 / 7, 7 steps): the scan ranks 700 first, and the int8
    # scores of the finalists give 3.
    n, k = 1000, GROUP
    w = torch.zeros(n, k, dtype=torch.int8, device=DEVICE)
    w[3, 0], w[3, 1], w[700, 0] = 98, 127, 97
    scale = torch.ones(n, device=DEVICE)
    x = torch.zeros(1, k, dtype=torch.bfloat16, device=DEVICE)
    x[0, 0] = 1.0
    w4, amax = w4_draft_pick.quantize(w)
    tile_max, tile_idx = w4_draft_pick.scan(x, w4, amax, scale, n, CONFIG)
    assert tile_idx[0].tolist()[:6] == [3, 128, 256, 384, 512, 700] and tile_max[0, 5] > tile_max[0, 0]
    assert w4_draft_pick.launch(x, w4, amax, w, scale, CONFIG).tolist() == [3]
    # a near tie inside one tile goes to the copy's leader: only tile leaders are finalists
    w[700, 0], w[5, 0] = 0, 97
    w4, amax = w4_draft_pick.quantize(w)
    assert w4_draft_pick.launch(x, w4, amax, w, scale, CONFIG).tolist() == [5]


def test_ties_go_to_the_lower_token_and_rows_past_the_vocabulary_never_win():
    n, k = 300, GROUP  # rows 300..511 are padding, whose logits would read 0
    x = torch.ones(2, k, dtype=torch.bfloat16, device=DEVICE)
    w = torch.full((n, k), -5, dtype=torch.int8, device=DEVICE)
    w[[42, 171], :] = -1  # equal rows in two tiles: the best, and negative, as every row is
    scale = torch.ones(n, device=DEVICE)
    w4, amax = w4_draft_pick.quantize(w)
    assert w4_draft_pick.launch(x, w4, amax, w, scale, CONFIG).tolist() == [42, 42]


@pytest.mark.parametrize("m", [15, 40])
def test_clear_winners_are_picked_as_the_int8_head_picks_them(m):
    n, k = 2000, 2 * GROUP
    w, scale = head(n, k, seed=3)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).to(DEVICE)
    winners = torch.randperm(n, generator=torch.Generator().manual_seed(5))[:m].to(DEVICE)
    w[winners] = torch.where(x > 0, 127, -127).to(torch.int8)  # each row's own token: far above the rest
    scale[winners] = 0.01
    w4, amax = w4_draft_pick.quantize(w)
    assert torch.equal(w4_draft_pick.pick(x, w4, amax, w, scale), winners)
    assert torch.equal(exact_logits(x, w, scale).argmax(1), winners)


def test_a_copy_or_config_that_does_not_fit_is_refused():
    w, scale = head(300, GROUP)
    x = torch.zeros(1, GROUP, dtype=torch.bfloat16, device=DEVICE)
    w4, amax = w4_draft_pick.quantize(w)
    with pytest.raises(ValueError, match="multiple of 128 columns"):
        w4_draft_pick.quantize(w[:, :100])
    with pytest.raises(ValueError, match="not `quantize`'s copy"):
        w4_draft_pick.launch(x, w4[:256], amax, w, scale, CONFIG)
    with pytest.raises(ValueError, match="not `quantize`'s copy"):
        w4_draft_pick.launch(x, w4, amax, w, scale, {**CONFIG, "BLOCK_N": 384})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_at_the_real_vocabulary_the_assembly_decodes_the_copy_and_clear_winners_are_the_fused_argmaxs_gpu():
    _, n, k = LM_HEAD
    w, scale = head(n, k, seed=6)
    x = torch.randn(15, k, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16).to(DEVICE)
    w4, amax = w4_draft_pick.quantize(w)
    config = w4_draft_pick.CONFIGS[("draft", 16, n, k)]
    tile_max, tile_idx = w4_draft_pick.scan(x, w4, amax, scale, n, config)
    ref = (x.float() @ dequantized(w4, amax, n).float().t()) * scale
    tiles = ref.view(15, -1, config["BLOCK_N"]).amax(-1)
    assert torch.allclose(tile_max, tiles, rtol=1e-4, atol=1e-4)
    assert torch.allclose(ref.gather(1, tile_idx.long()), tile_max, rtol=1e-4, atol=1e-4)
    winners = torch.randperm(n, generator=torch.Generator().manual_seed(8))[:15].to(DEVICE)
    w[winners] = torch.where(x > 0, 127, -127).to(torch.int8)
    w4, amax = w4_draft_pick.quantize(w)
    out = torch.full((15,), -1, dtype=torch.int64, device=DEVICE)
    w4_draft_pick.pick(x, w4, amax, w, scale, out=out)
    assert torch.equal(out, winners) and torch.equal(w8a16_argmax.pick(x, w, scale), winners)
