"""The packed capture forward: several pairs back to back in one row reproduce, pair by pair, the
model's ordinary full-sequence forward (document + pair in one pass)."""
import pytest
import torch

from nectar.attention.interface import _packed_local_state
from nectar.attention.doc_kv import prefill_document
from nectar.attention.exact import ExactDocState
from nectar.layout import build_layout
from nectar.targets.capture import capture_packed, pack
from float_tolerance import FORWARD, close_reordered


def _pairs(layout):
    return [layout.pair("Who bought the island?", "Captain Ilse Brandt bought it.").ids,
            layout.pair("What cargo?", "Salt cod and lamp oil.").ids,
            [layout.pair("Where?", "North.").ids[0]],  # a one-token sequence between two longer ones
            layout.pair("How many sailors were aboard?", "Seven.").ids]


def _check_packed_capture_matches_full_forward(base, document):
    layout = build_layout(base.tokenizer, document)
    kv = prefill_document(base, layout.context_ids, chunk_tokens=64)
    seqs = _pairs(layout)
    cap = capture_packed(base, ExactDocState(kv), seqs, layout.n, top_k=5, keep_logits=True)
    start = 0
    for ids in seqs:
        with torch.no_grad():
            ref = base.model(torch.tensor([list(layout.context_ids) + ids])).logits[0, layout.n:]  # [m, V]
        got = cap.logits[start:start + len(ids)]
        assert close_reordered(got, ref, FORWARD), (got - ref).abs().max()
        ref_lp = torch.log_softmax(ref.float(), -1).topk(5, -1).values
        assert close_reordered(cap.topk_logprobs[start:start + len(ids)], ref_lp, FORWARD)
        start += len(ids)
    t = sum(map(len, seqs))
    assert cap.q.shape == cap.A.shape == (t, base.num_layers, base.num_q_heads, base.head_dim)
    assert cap.alpha.shape == (t, base.num_layers, base.num_q_heads)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
def test_packed_capture_reproduces_full_forward_tiny(fixture, request, document):
    _check_packed_capture_matches_full_forward(request.getfixturevalue(fixture), document)


@pytest.mark.slow
def test_packed_capture_reproduces_full_forward_smollm2(smollm2, document):
    _check_packed_capture_matches_full_forward(smollm2, document)


def test_logit_rows_limit_the_head_and_leave_zeros_elsewhere(tiny_llama, document):
    layout = build_layout(tiny_llama.tokenizer, document)
    kv = prefill_document(tiny_llama, layout.context_ids)
    seqs = _pairs(layout)
    full = capture_packed(tiny_llama, ExactDocState(kv), seqs, layout.n, top_k=4)
    rows = torch.zeros(sum(map(len, seqs)), dtype=torch.bool)
    rows[3:9] = True
    part = capture_packed(tiny_llama, ExactDocState(kv), seqs, layout.n, top_k=4, logit_rows=rows)
    assert close_reordered(part.topk_logprobs[rows], full.topk_logprobs[rows])
    assert torch.equal(part.topk_ids[rows], full.topk_ids[rows])
    assert (part.topk_logprobs[~rows] == 0).all() and (part.topk_ids[~rows] == 0).all()
    assert torch.equal(part.q, full.q) and torch.equal(part.A, full.A)


def test_pack_positions_restart_at_n_for_every_sequence():
    ids, pos, segments = pack([[5, 6, 7], [8], [9, 10]], n=100, device="cpu")
    assert ids.tolist() == [[5, 6, 7, 8, 9, 10]]
    assert pos.tolist() == [[100, 101, 102, 100, 100, 101]]
    assert segments == [(0, 3), (3, 4), (4, 6)]
    with pytest.raises(ValueError, match="empty"):
        pack([[1], []], n=0, device="cpu")


def test_packed_local_state_rejects_segments_that_do_not_tile_the_row():
    q = torch.randn(1, 4, 6, 8)
    kv = torch.randn(1, 2, 6, 8)
    st = _packed_local_state(q, kv, kv, [(0, 2), (2, 6)], 8 ** -0.5)
    assert st.out.shape == (1, 4, 6, 8) and st.lse.shape == (1, 4, 6)
    with pytest.raises(ValueError, match="tiled by the segments"):
        _packed_local_state(q, kv, kv, [(0, 2), (2, 5)], 8 ** -0.5)
    with pytest.raises(ValueError, match="batch 2"):
        _packed_local_state(q.expand(2, -1, -1, -1), kv, kv, [(0, 6)], 8 ** -0.5)
