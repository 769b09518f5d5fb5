"""A module stored at int8/int4: the bytes it reports are the bytes of the file it writes, and it loads
back to the same values."""
import json
import struct

import pytest
import torch

from nectar.modules import build_module, load_module, make_spec, plan_module, save_module
from nectar.modules.stored import quantize_module_, stored_nbytes


def _tensor_bytes_in_file(path) -> int:
    """Bytes of the tensor data in a safetensors file (its size less the 8-byte length and the header)."""
    raw = path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + header_len])
    spans = [v["data_offsets"] for k, v in header.items() if k != "__metadata__"]
    assert len(raw) == 8 + header_len + max(e for _, e in spans)
    return sum(e - s for s, e in spans)


@pytest.mark.parametrize("arch,bits", [("quadrature", 4), ("quadrature", 8), ("quadrature", 32), ("mlp", 4)])
def test_stored_bytes_are_the_bytes_written_and_load_round_trips(tmp_path, arch, bits):
    plan = plan_module(arch, num_layers=2, num_kv_heads=2, head_dim=64, n_context=400, scaling=0.125, rho=0.05,
                       layer_multipliers=(1.0,), depths=(0, 2, 2), quad_bias=arch == "quadrature", bits=bits)
    module = build_module(plan, seed=1)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 1.0)
    quantize_module_(module)
    spec = make_spec(module, plan, "tiny", "hash", "0" * 64, num_q_heads=4)
    save_module(module, spec, str(tmp_path))
    assert spec.module_bytes == stored_nbytes(module) == _tensor_bytes_in_file(tmp_path / "module.safetensors")
    loaded, _ = load_module(str(tmp_path))
    assert loaded.bits == bits
    for (name, a), (_, b) in zip(module.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    if bits < 32:  # fewer bytes a parameter than float32, scales and zeros included
        assert spec.module_bytes < 4 * module.n_params() * (bits / 32 + 0.07)


def test_lower_precision_buys_more_pairs_in_the_same_bytes():
    kw = dict(num_layers=2, num_kv_heads=2, head_dim=64, n_context=2000, scaling=0.125, rho=0.05,
              layer_multipliers=(1.0,), quad_bias=True)
    pairs = {b: plan_module("quadrature", bits=b, **kw).quad_pairs[0] for b in (32, 8, 4)}
    assert pairs[32] < pairs[8] < pairs[4]
    for b in (32, 8, 4):
        m = build_module(plan_module("quadrature", bits=b, **kw))
        params_bytes = stored_nbytes(m)  # a closed-form module stores only its pairs
        assert params_bytes <= 4 * 2 * 2 * plan_module("quadrature", **kw).budgets[0]
