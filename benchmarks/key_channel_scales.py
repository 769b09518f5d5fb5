"""Issue 38's key-outlier lever, SIMULATED: the first state with its kept keys rounded to int4 with one fp16
scale and zero per (head, channel) over that head's kept keys (KIVI's per-channel keys) instead of one per
key row along d — measured before the module format can store it (it cannot yet: modules/stored.py and the
fused/vLLM serving paths hold one group along d per row).

    python benchmarks/key_channel_scales.py --out OUT --documents try --budgets 0.005,0.01 \\
        --states recon_first_kchan@int4 --references recon_first@int4,kvpress:kvzip:int4 --reference recon_first@int4

It registers ``recon_first_kchan@int4`` (recon_first@int4's settings under another name) and runs
benchmarks/document_panel.py with, for that system only, (1) the fit's keys "as stored" rounded per channel
(β and values fitted against them, as the product's quant-aware fit does) and (2) the module's keys left on
that grid when the values and β are rounded for storage. The state's ``bytes`` column stays the per-row
count; each fit prints what per-channel keys add or save (c·d·bits/8 + 4·d bytes a head against c·(d·bits/8
+ 4)), so the comparison is at the bytes printed, not exactly equal ones. The paired reference is the plain
recon_first@int4 on the same probes."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import nectar.comparison.compose as compose  # noqa: E402
import nectar.states.reconstruction as reconstruction  # noqa: E402
from nectar.comparison.systems import SYSTEMS, register  # noqa: E402
from nectar.quantization import fake_quantize  # noqa: E402

NAME = "recon_first_kchan@int4"
ACTIVE = {"on": False}
EXTRA_BYTES: list[int] = []
_row_round, _store_round, _fit = reconstruction.fake_quantize, reconstruction.quantize_module_, compose._fit_part


def per_channel(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x [c, d] rounded with one (scale, zero) per channel over its c rows."""
    c = x.shape[0]
    return fake_quantize(x.T.contiguous(), bits, c + c % 2).T.contiguous()  # a group of whole bytes


def keys_round(x, bits, group=64):
    """reconstruction.build_selected's rounding: keys [c, d] per channel while active, β (1-D) as before."""
    if ACTIVE["on"] and x.dim() == 2 and bits < 16:
        return per_channel(x, bits)
    return _row_round(x, bits, group)


@torch.no_grad()
def store_round(module):
    """Values and β rounded as stored; the keys stay on the per-channel grid the fit rounded them to."""
    if not ACTIVE["on"]:
        return _store_round(module)
    keys = [layer.W.detach().clone() for layer in module.layers]
    _store_round(module)
    extra, d, code = 0, module.head_dim, module.head_dim * module.bits // 8
    for layer, W, counts in zip(module.layers, keys, module.head_pairs):
        layer.W.copy_(W)
        extra += sum(c * code + 4 * d - c * (code + 4) for c in counts if c)
    EXTRA_BYTES.append(extra)
    return module


def fit_part(part, s, rho, base, gap=0):
    ACTIVE["on"] = s.name == NAME
    try:
        state = _fit(part, s, rho, base, gap)
    finally:
        ACTIVE["on"] = False
    if s.name == NAME:
        print(f"{NAME} ρ {rho:g}: {state.nbytes:,} bytes with per-row keys; per-channel keys "
              f"{EXTRA_BYTES[-1]:+,} ({EXTRA_BYTES[-1] / state.nbytes:+.2%})", flush=True)
    return state


def install() -> None:
    """Register the simulated system and route the fit's and the store's rounding through this file (in
    this process only: the script's own, never on import)."""
    register(dataclasses.replace(SYSTEMS["recon_first@int4"], name=NAME,
                                 description="recon_first@int4 with its keys rounded per channel (simulated)"))
    reconstruction.fake_quantize, reconstruction.quantize_module_ = keys_round, store_round
    compose._fit_part = fit_part


if __name__ == "__main__":
    import document_panel

    install()
    document_panel.main(sys.argv[1:])
