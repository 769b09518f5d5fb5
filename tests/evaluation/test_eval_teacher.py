"""Teacher-forced runner and per-head errors on the tiny model, against independent computations."""
import numpy as np
import pytest
import torch

from nectar.attention.doc_kv import prefill_document
from nectar.attention.exact import ExactDocState
from nectar.attention.state import AttnState
from nectar.evaluation.teacher import EvalPair, head_errors, teacher_forced_sums
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
    sums = teacher_forced_sums(tiny_llama, providers, pairs, layout.n, batch_size=2)
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
    one = teacher_forced_sums(tiny_llama, providers, pairs, layout.n, batch_size=1)
    two = teacher_forced_sums(tiny_llama, providers, pairs, layout.n, batch_size=2)  # padded batch
    for model in providers:
        assert one["test"][model].nll == pytest.approx(two["test"][model].nll, rel=1e-4)
        assert one["test"][model].correct == two["test"][model].correct


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
