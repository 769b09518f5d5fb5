import math

import torch

from nectar.attention.state import AttnState, attention_state, merge_states
from float_tolerance import close_reordered


def _reference(q, k, v, scaling):
    hq, hkv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    logits = q @ k.transpose(-1, -2) * scaling
    return torch.softmax(logits, -1) @ v, torch.logsumexp(logits, -1)


def test_attention_state_matches_softmax_with_gqa_and_chunks():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 8, generator=g), torch.randn(2, 2, 37, 8, generator=g), torch.randn(2, 2, 37, 8, generator=g)
    out, lse = _reference(q, k, v, 0.3)
    st = attention_state(q, k, v, 0.3, chunk_size=10)  # 4 chunks merged exactly
    assert close_reordered(st.out, out) and close_reordered(st.lse, lse)


def test_merge_of_disjoint_key_sets_equals_attention_over_union():
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(1, 2, 3, 4, generator=g), torch.randn(1, 2, 20, 4, generator=g), torch.randn(1, 2, 20, 4, generator=g)
    whole = attention_state(q, k, v, 0.5)
    merged = merge_states(attention_state(q, k[:, :, :7], v[:, :, :7], 0.5), attention_state(q, k[:, :, 7:], v[:, :, 7:], 0.5))
    assert close_reordered(merged.out, whole.out) and close_reordered(merged.lse, whole.lse)


def test_merge_with_empty_state_is_identity_and_never_nan():
    a = AttnState(torch.ones(1, 1, 2, 3), torch.tensor([[[0.5, 1.0]]]))
    empty = AttnState(torch.zeros(1, 1, 2, 3), torch.full((1, 1, 2), -math.inf))
    m = merge_states(a, empty)
    assert torch.equal(m.out, a.out) and torch.equal(m.lse, a.lse)
    assert merge_states(None, a) is a
    m = merge_states(empty, a)  # the empty side first
    assert torch.equal(m.out, a.out) and torch.equal(m.lse, a.lse)
    both = merge_states(empty, empty)
    assert not both.out.isnan().any() and (both.lse == -math.inf).all()


def test_merge_promotes_mixed_dtypes_and_passes_gradients():
    g = torch.Generator().manual_seed(2)
    out_a = torch.randn(1, 2, 3, 4, generator=g, requires_grad=True)
    lse_a = torch.randn(1, 2, 3, generator=g, requires_grad=True)
    b = AttnState(torch.randn(1, 2, 3, 4, generator=g).bfloat16(), torch.randn(1, 2, 3, generator=g))
    m = merge_states(AttnState(out_a, lse_a), b)
    assert m.out.dtype == torch.float32
    w = torch.exp(lse_a - m.lse).unsqueeze(-1)  # the defining formula
    assert close_reordered(m.out, w * out_a + (1 - w) * b.out.float())
    m.out.sum().backward()
    assert out_a.grad is not None and lse_a.grad is not None and lse_a.grad.abs().sum() > 0


def test_causal_offset_hides_future_keys():
    q, k, v = torch.randn(1, 1, 3, 4), torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 4)
    st = attention_state(q, k, v, 1.0, causal_offset=2)  # query i sees keys 0..i+2
    for i in range(3):
        o, l = _reference(q[:, :, i:i + 1], k[:, :, : i + 3], v[:, :, : i + 3], 1.0)
        assert close_reordered(st.out[:, :, i:i + 1], o) and close_reordered(st.lse[:, :, i:i + 1], l)
