"""Quantization-aware training (modules/stored.py ``trained_as_stored``): the forward reads every
parameter as it will be stored, the float parameter behind it takes the gradient, and what is saved
is exactly what the last forward used — for plain quadrature states and for KVzip-style ragged ones
(heads of different widths, β at bf16 with −inf masked slots)."""
import torch

from nectar.states.reconstruction import build_selected, selection_plan
from nectar.modules.builder import build_module, plan_from_config
from nectar.modules.stored import (load_stored_tensors, parameter_bits, quantize_module_, stored_tensors,
                                   trained_as_stored)
from nectar.quantization import fake_quantize, quantize, straight_through
from nectar.schemas.config import ModuleConfig

L, H, D, N = 2, 2, 16, 96


def _doc(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(H, N, D, generator=g) * 2 for _ in range(L)]  # [Hkv, n, d] per layer
    values = [torch.randn(H, N, D, generator=g) for _ in range(L)]
    return keys, values


def _plain(bits: int):
    cfg = ModuleConfig(arch="quadrature", rho=0.1, bias=True, bits=bits)
    keys, values = _doc()
    return build_module(plan_from_config(cfg, L, H, D, N, D ** -0.5), keys, values, seed=0)


class _KV:
    def __init__(self):
        self.keys, self.values = _doc()


def _ragged(bits: int = 4):
    cfg = ModuleConfig(arch="quadrature", rho=0.1, bias=True, bits=bits)
    plan = plan_from_config(cfg, L, H, D, N, D ** -0.5)
    kept = [[torch.arange(0, N, 9 + h + layer) for h in range(H)] for layer in range(L)]  # widths differ per head
    return build_selected(selection_plan(plan, kept, fit=True), kept, _KV())


def _outputs(module, q):
    return [layer(q) for layer in module.layers]  # per layer (A [N, H, d], a [N, H])


def _train(module, steps: int, lr: float) -> list[float]:
    """Adam on the MSE to the document's exact attention for fixed random queries; losses per step."""
    keys, values = _doc()
    q = torch.randn(64, H, D, generator=torch.Generator().manual_seed(1)) * 2  # [N, H, d]
    exact = []
    for layer in range(L):
        p = torch.softmax(torch.einsum("nhd,hkd->hnk", q, keys[layer]) * D ** -0.5, -1)  # [H, N, n]
        exact.append(torch.einsum("hnk,hkd->nhd", p, values[layer]))
    opt = torch.optim.Adam(module.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = sum(((A - t) ** 2).mean() for (A, _), t in zip(_outputs(module, q), exact))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def test_straight_through_rounds_forward_and_passes_the_gradient_unchanged():
    x = torch.tensor([[0.3, -1.7, 2.2, 5.0], [1.0, float("-inf"), 0.5, 0.25]], requires_grad=True)
    y = straight_through(x, 16)
    assert torch.equal(y.detach(), fake_quantize(x.detach(), 16))
    y.masked_fill(~torch.isfinite(y), 0.0).sum().backward()
    assert torch.equal(x.grad, torch.tensor([[1.0, 1, 1, 1], [1, 0, 1, 1]]))  # −inf: no gradient, no NaN
    z = torch.randn(3, 64, requires_grad=True)
    assert torch.equal(straight_through(z, 4).detach(), fake_quantize(z.detach(), 4))
    assert straight_through(z, 32) is z


def test_what_the_forward_used_is_what_is_stored_plain_and_ragged():
    for module in (_plain(4), _ragged(4)):
        names = list(parameter_bits(module))
        with trained_as_stored(module):
            _train(module, steps=15, lr=0.05)
            used = {n: getattr(module.get_submodule(n.rpartition(".")[0]), n.rpartition(".")[2]).detach().clone()
                    for n in names}  # the parametrized reads: values as the forward saw them
            q = torch.randn(5, H, D) * 2
            out = _outputs(module, q)
        quantize_module_(module)
        tensors = stored_tensors(module)
        fresh = _ragged(4) if module.head_pairs else _plain(4)  # same plan, the untrained values
        load_stored_tensors(fresh, tensors)
        for name, value in fresh.named_parameters():
            assert torch.equal(value, used[name]), name  # bit for bit: trained = stored = loaded
        for (A, a), (A2, a2) in zip(out, _outputs(fresh, q)):
            assert torch.equal(A, A2) and torch.equal(a, a2)
        if not module.head_pairs:  # the packed codes are those of the values the forward saw
            assert torch.equal(tensors["layers.0.W.codes"], quantize(used["layers.0.W"], 4).codes)


def test_training_as_stored_lowers_the_loss_and_moves_codes():
    for module in (_plain(4), _ragged(4)):
        start = {n: p.detach().clone() for n, p in module.named_parameters()}
        with trained_as_stored(module):
            losses = _train(module, steps=30, lr=0.05)
        assert losses[-1] < 0.8 * losses[0], losses[::5]
        quantize_module_(module)
        moved = sum(int((p.detach() != start[n]).sum()) for n, p in module.named_parameters())
        assert moved > 0


def test_nothing_changes_at_32_bits():
    a, b = _plain(32), _plain(32)
    assert all(bits == 32 for bits in parameter_bits(a).values())
    names = [n for n, _ in a.named_parameters()]
    with trained_as_stored(a):
        assert [n for n, _ in a.named_parameters()] == names  # no parametrization registered
        la = _train(a, steps=5, lr=0.05)
    lb = _train(b, steps=5, lr=0.05)
    assert la == lb
    for (n, p), (_, r) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, r), n
