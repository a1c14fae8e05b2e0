"""DFlash's draft pick over the int8 lm_head (server/hooks/draft_pick.py), from its 4-bit copy (on the CPU in
Triton's interpreter): each block's positions 1..K-1 are the drafts; position 0 is the bonus token."""

from types import SimpleNamespace

import torch

from qflash.server.hooks.draft_pick import Int8HeadDraftSampler

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
K, BATCH, VOCAB, HIDDEN = 16, 2, 48, 128  # the 4-bit copy's rows: whole groups of 128 columns


def test_each_block_drafts_from_its_positions_1_to_k_minus_1():
    # An identity lm_head: the greedy token of a one-hot hidden state is its index. Row p of block b is
    # token (b * K + p) % VOCAB, so every position of both blocks picks its own token.
    head = SimpleNamespace(weight=(100 * torch.eye(VOCAB, HIDDEN)).to(torch.int8).to(DEVICE),
                           weight_scale=torch.full((VOCAB,), 0.01, device=DEVICE),
                           shard_indices=SimpleNamespace(num_org_elements=VOCAB))
    sampler = Int8HeadDraftSampler(head, K, max_bs=4)
    tokens = torch.arange(BATCH * K) % VOCAB
    hidden = torch.nn.functional.one_hot(tokens, HIDDEN).to(torch.bfloat16).to(DEVICE)
    sampler(hidden)
    drafts = sampler.out[: BATCH * (K - 1)].cpu()
    assert drafts.tolist() == tokens.view(BATCH, K)[:, 1:].reshape(-1).tolist()


def test_one_block_is_picked_into_the_samplers_buffer_by_the_kernels_alone(monkeypatch):
    """In the draft graph every torch op around the pick's kernels is a launch of its own: the ids go straight into
    the sampler's buffer (the kernels themselves: test_each_block_drafts_from_its_positions_1_to_k_minus_1)."""
    from conftest import Dispatched
    from qflash.kernels import w4_draft_pick

    written = []
    monkeypatch.setattr(w4_draft_pick, "launch",
                        lambda x, w4, amax, w, w_scale, config, out=None: written.append(out) or out)
    head = SimpleNamespace(weight=torch.zeros(VOCAB, HIDDEN, dtype=torch.int8, device=DEVICE),
                           weight_scale=torch.ones(VOCAB, device=DEVICE),
                           shard_indices=SimpleNamespace(num_org_elements=VOCAB))
    sampler = Int8HeadDraftSampler(head, K, max_bs=4)
    hidden = torch.zeros(K, HIDDEN, dtype=torch.bfloat16, device=DEVICE)
    with Dispatched() as ops:
        sampler(hidden)
    assert written[0].data_ptr() == sampler.out.data_ptr() and written[0].shape == (K - 1,)
    assert ops.names() <= {"view", "slice", "reshape", "_reshape_alias", "alias"}, ops.names()  # no launch among them


def test_up_to_max_rows_the_pick_scans_the_4_bit_copy_and_more_rows_pick_on_the_int8_head(monkeypatch):
    from qflash.kernels import w4_draft_pick, w8a16_argmax

    picked = []
    monkeypatch.setattr(w4_draft_pick, "launch", lambda x, *args, out=None: picked.append(("4-bit", x.shape[0])))
    monkeypatch.setattr(w8a16_argmax, "launch", lambda x, *args, out=None: picked.append(("int8", x.shape[0])))
    head = SimpleNamespace(weight=torch.zeros(VOCAB, HIDDEN, dtype=torch.int8, device=DEVICE),
                           weight_scale=torch.ones(VOCAB, device=DEVICE),
                           shard_indices=SimpleNamespace(num_org_elements=VOCAB))
    sampler = Int8HeadDraftSampler(head, K, max_bs=4)
    for blocks in (1, 2, 3):
        sampler(torch.zeros(blocks * K, HIDDEN, dtype=torch.bfloat16, device=DEVICE))
    assert 2 * (K - 1) <= w4_draft_pick.MAX_ROWS < 3 * (K - 1)  # the blocks of two requests, not of three
    assert picked == [("4-bit", K - 1), ("4-bit", 2 * (K - 1)), ("int8", 3 * (K - 1))]
