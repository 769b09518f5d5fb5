"""Teacher-forced runner and per-head errors on the tiny model, against independent computations."""
import numpy as np
import pytest
import torch

from nectar.attention.doc_kv import prefill_document
from nectar.attention.exact import ExactDocState
from nectar.attention.state import AttnState
from nectar.evaluation.quality import split_quality
from nectar.evaluation.teacher import EvalPair, head_errors, split_totals, teacher_forced_pair_sums
from nectar.layout import build_layout
from nectar.targets.capture import capture_packed


DOC = ("The lighthouse keeper of Varn Island kept a ledger of every ship that passed. In 1871 the "
       "schooner Meridian ran aground; her captain, Ilse Brandt, later bought the island. ") * 2


class Shifted:
    """The exact document state moved by fixed offsets: a provider with genuinely different outputs."""

    def __init__(self, inner, d_out: float, d_lse: float):
        self.inner, self.d_out, self.d_lse = inner, d_out, d_lse

    def __call__(self, layer, q, scaling):
        st = self.inner(layer, q, scaling)
        return AttnState(st.out + self.d_out, st.lse + self.d_lse)


@pytest.fixture(scope="module")
def setup(tiny_llama):
    layout = build_layout(tiny_llama.tokenizer, DOC)
    kv = prefill_document(tiny_llama, layout.context_ids)
    pairs = []
    for i, (ins, resp) in enumerate([("Who bought the island?", "Ilse Brandt, the captain."),
                                     ("What did the Meridian carry?", "Salt cod and barrels of lamp oil.")]):
        q = layout.pair(ins, resp)
        pairs.append(EvalPair(f"p{i}", "qa", ("test",) if i == 0 else ("test", "challenge"),
                              tuple(q.ids), q.response_start))
    return layout, kv, pairs


def _reference_accuracy(base, layout, pairs):
    """Greedy next-token accuracy on response tokens from the ordinary full forward (no NECTAR)."""
    correct = total = 0
    for p in pairs:
        ids = torch.tensor([list(layout.context_ids) + list(p.ids)])
        with torch.no_grad():
            logits = base.model(ids).logits[0]
        for t in range(p.response_start, len(p.ids)):
            pos = layout.n + t
            correct += int(logits[pos - 1].argmax() == ids[0, pos])
            total += 1
    return correct / total, total


def test_full_model_matches_the_ordinary_forward_and_others_differ(tiny_llama, setup):
    layout, kv, pairs = setup
    full = ExactDocState(kv)
    providers = {"module": Shifted(full, 0.3, -1.0), "full": full, "none": None}
    sums = split_totals(teacher_forced_pair_sums(tiny_llama, providers, pairs, layout.n, batch_size=2), pairs)
    acc, n_tok = _reference_accuracy(tiny_llama, layout, pairs)
    assert sums["test"]["full"].n == n_tok
    assert sums["test"]["full"].token_acc == pytest.approx(acc)
    assert sums["test"]["full"].kl_to_full == pytest.approx(0.0, abs=1e-5)
    assert sums["test"]["module"].kl_to_full > 1e-3 and sums["test"]["none"].kl_to_full > 1e-3
    # challenge holds only the second pair
    assert sums["challenge"]["full"].n == len(pairs[1].ids) - pairs[1].response_start


def test_batching_does_not_change_the_sums(tiny_llama, setup):
    layout, kv, pairs = setup
    providers = {"full": ExactDocState(kv), "none": None}
    one = split_totals(teacher_forced_pair_sums(tiny_llama, providers, pairs, layout.n, batch_size=1), pairs)
    two = split_totals(teacher_forced_pair_sums(tiny_llama, providers, pairs, layout.n, batch_size=2), pairs)
    for model in providers:
        assert one["test"][model].nll == pytest.approx(two["test"][model].nll, rel=1e-4)
        assert one["test"][model].correct == two["test"][model].correct


def test_per_pair_sums_are_in_pair_order_and_add_up(tiny_llama, setup):
    layout, kv, pairs = setup
    rev = pairs[::-1]  # batched by length internally: results must come back in the given order
    fwd = teacher_forced_pair_sums(tiny_llama, {"full": ExactDocState(kv)}, pairs, layout.n, batch_size=2)
    back = teacher_forced_pair_sums(tiny_llama, {"full": ExactDocState(kv)}, rev, layout.n, batch_size=2)
    assert list(fwd["full"].n) == [len(p.ids) - p.response_start for p in pairs]
    assert list(back["full"].n) == list(fwd["full"].n[::-1])
    assert back["full"].nll[::-1] == pytest.approx(fwd["full"].nll, rel=1e-4)


def test_a_system_equal_to_full_has_kl_zero_and_recovers_everything(tiny_llama, setup):
    layout, kv, pairs = setup
    more = pairs + [EvalPair(f"q{i}", "qa", ("test",), p.ids, p.response_start) for i, p in enumerate(pairs)]
    full = ExactDocState(kv)
    providers = {"full": full, "copy": ExactDocState(kv), "shifted": Shifted(full, 0.3, -1.0), "none": None}
    sums = teacher_forced_pair_sums(tiny_llama, providers, more, layout.n, batch_size=3)
    q = split_quality(sums, split="test", resamples=400)
    for name in ("full", "copy"):
        assert (q[name].kl_to_full.value, q[name].kl_to_full.low, q[name].kl_to_full.high) == (0, 0, 0)
        assert (q[name].recovered_kl.value, q[name].recovered_kl.low, q[name].recovered_kl.high) == (1, 1, 1)
    assert (q["none"].recovered_kl.value, q["none"].recovered_kl.low) == (0, 0)
    shifted = q["shifted"]
    assert shifted.kl_to_full.value > 1e-3 and shifted.kl_to_full.low < shifted.kl_to_full.value
    assert q["copy"].token_acc == q["full"].token_acc  # identical computation, identical estimate
    cols = shifted.columns()
    assert cols["kl_ci_low"] <= cols["kl_to_full"] <= cols["kl_ci_high"] and cols["n_pairs"] == 4
    assert cols["agreement_rouge_l"] is None and cols["n_agreement"] == 0


def test_head_errors_are_zero_for_the_exact_state_and_exact_for_a_known_shift(tiny_llama, setup):
    layout, kv, pairs = setup
    p = pairs[0]
    cap = capture_packed(tiny_llama, ExactDocState(kv), [list(p.ids)], layout.n, top_k=4)
    q, alpha, A = cap.q.numpy(), cap.alpha.numpy(), cap.A.numpy()  # [T, L, Hq, (d)]
    exact = head_errors(ExactDocState(kv), q, alpha, A, tiny_llama.scaling, token_batch=5).means()
    assert float(exact["mse_A"].max()) < 1e-10 and float(exact["mse_alpha"].max()) < 1e-9
    shifted = head_errors(Shifted(ExactDocState(kv), 0.1, 0.5), q, alpha, A, tiny_llama.scaling).means()
    d = tiny_llama.head_dim
    assert np.allclose(shifted["mse_A"].numpy(), d * 0.01, rtol=1e-4)
    assert np.allclose(shifted["mse_alpha"].numpy(), 0.25, rtol=1e-4)
    # rte_A for one head by hand: mean over tokens of log(d·0.01 / ||q − A||²)
    ref = np.mean(np.log(d * 0.01 / ((q[:, 1, 2] - A[:, 1, 2]) ** 2).sum(-1)))
    assert shifted["rte_A"][1, 2].item() == pytest.approx(ref, rel=1e-4)
