"""kernels/pack_kv.py in Triton's interpreter: each request's cached prefix (read from the KV pool by slot) then its
new keys, requests one after another, rows past the last request zero, and where each request's keys start; new
rows read from a wider tensor (as SGLang's k and v are views of the projection's output)."""

import itertools

import pytest
import torch

from qflash.kernels.pack_kv import pack_kv


def packed_by_hand(ext, buf, qo_indptr, kv_indptr, kv_indices, rows):
    out = torch.zeros((rows, *ext.shape[1:]), dtype=ext.dtype)
    at = 0
    for i in range(qo_indptr.shape[0] - 1):
        seq = torch.cat([buf[kv_indices[kv_indptr[i]:kv_indptr[i + 1]]], ext[qo_indptr[i]:qo_indptr[i + 1]]])
        out[at:at + seq.shape[0]] = seq
        at += seq.shape[0]
    return out


@pytest.mark.parametrize("extends, prefixes, padding, spare", [
    ((5, 12, 9), (0, 7, 20), 3, 0), ((16,), (40,), 0, 0), ((3, 8, 1, 4, 2, 6), (11, 0, 5, 5, 0, 9), 2, 6),
], ids=["three requests", "one request", "six requests, kv_indices over-allocated"])
def test_prefixes_then_new_keys_request_after_request(extends, prefixes, padding, spare):
    g = torch.Generator().manual_seed(0)
    heads, dim, slots = 2, 64, 128
    new_rows = sum(extends) + padding
    # k and v as views of one wider projection output, as SGLang's are
    qkv = torch.randn(new_rows, 3 * heads * dim, generator=g).to(torch.bfloat16)
    k_ext, v_ext = (qkv[:, i * heads * dim:(i + 1) * heads * dim].view(new_rows, heads, dim) for i in (1, 2))
    k_buf, v_buf = (torch.randn(slots, heads, dim, generator=g).to(torch.bfloat16) for _ in range(2))
    kv_indices = torch.cat([torch.randperm(slots, generator=g)[:sum(prefixes)], torch.full((spare,), 10 ** 9)])
    qo_indptr, kv_indptr = (torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32) for lens in (extends, prefixes))
    k, v, cu_seq_k = pack_kv(k_ext, v_ext, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices)
    rows = kv_indices.shape[0] + new_rows
    assert torch.equal(k, packed_by_hand(k_ext, k_buf, qo_indptr, kv_indptr, kv_indices, rows))
    assert torch.equal(v, packed_by_hand(v_ext, v_buf, qo_indptr, kv_indptr, kv_indices, rows))
    assert torch.equal(cu_seq_k, qo_indptr + kv_indptr)
