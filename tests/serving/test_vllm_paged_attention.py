"""The NECTAR backend's attention over vLLM's paged cache (``nectar.vllm.paged_attention``) against dense
attention over each request's own slots: decode and prefill rows in one batch, GQA, β that matters,
−inf β (ragged heads), shared blocks, and the β store reset by ordinary writes."""
from __future__ import annotations

import pytest
import torch

from nectar.vllm.paged_attention import merge, paged_attention, plan_slots, split_cache, state_attention, write_slots

NB, HKV, BS, D, G = 12, 2, 4, 8, 3
SCALE = D ** -0.5


def _cache():
    kv = torch.zeros(NB, HKV, BS, 2 * D)
    bias = torch.zeros(NB * BS, HKV)
    return kv, bias


def _dense(q, k, v, b, S, L):
    """q [L, H, d]; k/v [S, hkv, d]; b [S, hkv] → [L, H, d]: causal over the last L slots, β added."""
    out = torch.empty_like(q)
    for h in range(HKV * G):
        kh = h // G
        for i in range(L):
            logits = k[: S - L + i + 1, kh] @ q[i, h] * SCALE + b[: S - L + i + 1, kh]
            out[i, h] = torch.softmax(logits, 0) @ v[: S - L + i + 1, kh]
    return out


def _fill(kv, bias, blocks, S, gen, beta_slots=0):
    """Random keys/values in a request's first S slots (its first beta_slots with random β, some −inf)."""
    slots = torch.tensor([blocks[p // BS] * BS + p % BS for p in range(S)])
    k, v = torch.randn(S, HKV, D, generator=gen), torch.randn(S, HKV, D, generator=gen)
    beta = torch.zeros(S, HKV)
    beta[:beta_slots] = 2 * torch.randn(beta_slots, HKV, generator=gen)
    if beta_slots:
        beta[beta_slots - 1, 0] = float("-inf")  # a padded slot of a narrower head
    write_slots(kv, bias, k, v, slots, beta)
    return k, v, beta


def test_decode_and_prefill_rows_match_dense_attention_with_bias():
    gen = torch.Generator().manual_seed(0)
    kv, bias = _cache()
    tables = [[3, 7, 1], [0, 5], [9, 2, 4]]
    seq, new = [10, 6, 9], [1, 4, 1]  # request 1 is a prefill chunk of 4 tokens
    dense = [_fill(kv, bias, t, S, gen, beta_slots=5) for t, S in zip(tables, seq)]
    table = torch.tensor([t + [0] * (3 - len(t)) for t in tables], dtype=torch.int32)
    starts = torch.tensor([0, 1, 5, 6], dtype=torch.int32)
    q = torch.randn(6, HKV * G, D, generator=gen)
    out = torch.full_like(q, float("nan"))
    paged_attention(q, kv, bias, starts, torch.tensor(seq), table, SCALE, out)
    for r, ((k, v, b), S, L) in enumerate(zip(dense, seq, new)):
        want = _dense(q[starts[r]:starts[r] + L], k, v, b, S, L)
        torch.testing.assert_close(out[starts[r]:starts[r] + L], want, rtol=1e-5, atol=1e-5)


def test_the_bias_changes_the_output():
    gen = torch.Generator().manual_seed(1)
    kv, bias = _cache()
    _fill(kv, bias, [0, 1], 7, gen, beta_slots=5)
    q = torch.randn(1, HKV * G, D, generator=gen)
    args = (torch.tensor([0, 1]), torch.tensor([7]), torch.tensor([[0, 1]]), SCALE)
    with_beta, without = torch.empty_like(q), torch.empty_like(q)
    paged_attention(q, kv, bias, *args, with_beta)
    paged_attention(q, kv, torch.zeros_like(bias), *args, without)
    assert (with_beta - without).abs().max() > 1e-2


def test_an_ordinary_write_resets_the_slot_bias_and_padding_slots_are_skipped():
    kv, bias = _cache()
    bias[:] = 5.0
    key = torch.ones(3, HKV, D)
    write_slots(kv, bias, key, 2 * key, torch.tensor([5, -1, 9]))
    keys, values = split_cache(kv)
    assert bias[5].eq(0).all() and bias[9].eq(0).all() and bias[0].eq(5).all()
    assert keys[1, :, 1].eq(1).all() and values[2, :, 1].eq(2).all()  # slot 5 = block 1 offset 1; 9 = block 2 offset 1
    assert keys[0].eq(0).all()  # the skipped row wrote nothing


def test_two_requests_sharing_the_state_blocks_read_the_same_state():
    gen = torch.Generator().manual_seed(2)
    kv, bias = _cache()
    k, v, b = _fill(kv, bias, [4, 6], 8, gen, beta_slots=8)  # a document's state, two full blocks
    own = [torch.randn(2, HKV, D, generator=gen) for _ in range(4)]
    write_slots(kv, bias, own[0], own[1], torch.tensor([8 * BS, 8 * BS + 1]))  # request 0's own tokens: block 8
    write_slots(kv, bias, own[2], own[3], torch.tensor([10 * BS, 10 * BS + 1]))  # request 1's: block 10
    q = torch.randn(2, HKV * G, D, generator=gen)
    out = torch.empty_like(q)
    paged_attention(q, kv, bias, torch.tensor([0, 1, 2]), torch.tensor([10, 10]),
                    torch.tensor([[4, 6, 8], [4, 6, 10]]), SCALE, out)
    for r, (ko, vo) in enumerate([(own[0], own[1]), (own[2], own[3])]):
        want = _dense(q[r:r + 1], torch.cat([k, ko]), torch.cat([v, vo]), torch.cat([b, torch.zeros(2, HKV)]), 10, 1)
        torch.testing.assert_close(out[r:r + 1], want, rtol=1e-5, atol=1e-5)


def test_the_split_path_state_gemm_merged_with_own_slots_equals_one_pass():
    """Requests on one document: the state attended densely (one GEMM for all their query rows) and merged by
    LSE with their own slots from m on gives the one-pass numbers — decode and prefill rows alike."""
    gen = torch.Generator().manual_seed(3)
    kv, bias = _cache()
    m = 7  # state slots: blocks 4 and 6 (the second one partly)
    k, v, b = _fill(kv, bias, [4, 6], m, gen, beta_slots=m)
    tables = [[4, 6, 8, 9], [4, 6, 10, 0]]
    seq = [13, 10]  # request 0 decodes one token, request 1 a prefill chunk of 3
    for table, S in zip(tables, seq):  # each request's own tokens after the state
        slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(m, S)])
        write_slots(kv, bias, torch.randn(S - m, HKV, D, generator=gen), torch.randn(S - m, HKV, D, generator=gen), slots)
    q = torch.randn(4, HKV * G, D, generator=gen)
    args = (torch.tensor([0, 1, 4]), torch.tensor(seq), torch.tensor(tables), SCALE)
    one_pass = torch.empty_like(q)
    lse_one = paged_attention(q, kv, bias, *args, one_pass)
    own = torch.empty_like(q)
    lse_own = paged_attention(q, kv, bias, *args, own, key_start=torch.tensor([m, m]))
    st_out, st_lse = state_attention(q, k.transpose(0, 1), v.transpose(0, 1), b.transpose(0, 1), SCALE)
    out, lse = merge(own, lse_own, st_out, st_lse)
    torch.testing.assert_close(out, one_pass, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, lse_one, rtol=1e-5, atol=1e-5)


def test_a_bf16_state_attends_within_bf16_rounding_of_float32():
    """On a bf16 server the state's two matmuls run in bf16 (oneDNN's fast kernels), the softmax in float32."""
    gen = torch.Generator().manual_seed(4)
    k, v = torch.randn(HKV, 50, D, generator=gen), torch.randn(HKV, 50, D, generator=gen)
    beta = torch.randn(HKV, 50, generator=gen)
    q = torch.randn(5, HKV * G, D, generator=gen)
    want, want_lse = state_attention(q, k, v, beta, SCALE)
    got, got_lse = state_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), beta, SCALE)
    assert got.dtype == torch.float32 and got_lse.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=3e-2)
    torch.testing.assert_close(got_lse, want_lse, rtol=0, atol=3e-2)


def test_one_step_plan_serves_every_layer_and_no_bias_means_zero_bias():
    """The backend plans a step's gathers once (``plan_slots``) and every layer reuses it: two layers' caches
    through one plan give what each gives planned on its own; bias None (own slots) is a zero β store."""
    gen = torch.Generator().manual_seed(5)
    tables = [[3, 7, 1], [0, 5]]
    seq, starts = torch.tensor([10, 6]), torch.tensor([0, 1, 5])  # a decode row and a prefill chunk of 4
    table = torch.tensor([t + [0] * (3 - len(t)) for t in tables], dtype=torch.int32)
    plan = plan_slots(starts, seq, table, HKV, BS, G)
    q = torch.randn(5, HKV * G, D, generator=gen)
    for _layer in range(2):
        kv, bias = _cache()
        for t, S in zip(tables, seq.tolist()):
            _fill(kv, bias, t, S, gen)  # β = 0 everywhere
        planned, alone, unbiased = (torch.full_like(q, float("nan")) for _ in range(3))
        lse_planned = paged_attention(q, kv, bias, starts, seq, table, SCALE, planned, plan=plan)
        lse_alone = paged_attention(q, kv, bias, starts, seq, table, SCALE, alone)
        paged_attention(q, kv, None, starts, seq, table, SCALE, unbiased, plan=plan)
        torch.testing.assert_close(planned, alone, rtol=0, atol=0)
        torch.testing.assert_close(lse_planned, lse_alone, rtol=0, atol=0)
        torch.testing.assert_close(unbiased, alone, rtol=0, atol=0)
    other = plan_slots(starts, seq, table, HKV, 2 * BS, G)  # a plan for another block size is refused
    with pytest.raises(ValueError, match="step plan"):
        paged_attention(q, kv, bias, starts, seq, table, SCALE, planned, plan=other)
