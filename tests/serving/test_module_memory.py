"""What a served quantized module holds, and what a decode step does with it: the int4 quadrature
state (the cpu default's kind, on the tiny model) is dequantized once when the registry loads it, the
floats are kept beside the codes and charged to the LRU byte bound; with ``keep_dequantized=False``
only the codes are held and every decode step dequantizes them. Greedy answers are the same."""
from __future__ import annotations

from nectar.attention.engine import DecodeEngine, Request
from nectar.modules.stored import stored_nbytes
from nectar.serving.loader import load_served_module, open_served_run
from nectar.serving.registry import open_registry

Q = "Who bought the island?"
TOKENS = 6


def _decode(registry, name: str, served) -> list[int]:
    provider = registry.provider(name)
    engine = DecodeEngine(registry.base, provider, served.n_context, stop_ids=())
    prompt = served.layout.prompt(Q).ids
    return engine.run([Request(prompt, TOKENS), Request(prompt, TOKENS)]).tokens[0]


def test_the_decode_step_reads_the_kept_floats_and_never_dequantizes(int4_run):
    served = load_served_module(int4_run)
    kept = open_registry([open_served_run(int4_run)], None, 2_000_000_000)
    codes = open_registry([open_served_run(int4_run)], None, 2_000_000_000, keep_dequantized=False)
    name = kept.names[0]
    layers = served.module.num_layers
    fused = kept.provider(name).module
    assert fused.dequantizations == layers  # once per layer, at load
    tokens = _decode(kept, name, served)
    assert fused.dequantizations == layers  # prefill + TOKENS decode steps: none
    assert codes.provider(name).module.dequantizations == 0
    assert _decode(codes, name, served) == tokens  # greedy: the same answer either way
    # every forward (prefill and each decode step after the first token) dequantizes every layer
    assert codes.provider(name).module.dequantizations == layers * TOKENS


def test_the_byte_bound_charges_the_codes_and_the_kept_floats(int4_run):
    served = load_served_module(int4_run)
    stored = stored_nbytes(served.module)
    assert stored == served.spec.module_bytes
    kept = open_registry([open_served_run(int4_run)], None, 2_000_000_000)
    codes = open_registry([open_served_run(int4_run)], None, 2_000_000_000, keep_dequantized=False)
    fk, fc = kept.provider(kept.names[0]).module, codes.provider(codes.names[0]).module
    floats = sum(t.numel() * t.element_size() for layer in fk.layers for t in layer.dequantized)
    assert kept.loaded_bytes == fk.resident_bytes == stored + floats
    assert codes.loaded_bytes == fc.resident_bytes == stored
    assert kept.loaded_bytes > 4 * codes.loaded_bytes  # int4: the memory the speed costs
