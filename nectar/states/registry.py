"""The state methods, one per file, by name: the one place a method is registered.

Training (``train.module.init``), ``nectar compare`` and serving ask this registry for a method
object and then ask the object (``reads``, ``plan``, ``fit``, ``init``) — never test its name.
Adding a method is adding its file and one ``register`` line here (or a ``register`` call at
run time: tests/states/test_new_method.py); docs/architecture.md, "Adding a state method".
kvpress's presses are one adapter family (``kvpress:<press>[:int8|:int4]``, kvpress_press.py).
"""
from __future__ import annotations

from ..modules.builder import ModulePlan
from ..schemas.renamed import renamed
from .attention_matching import AttentionMatching
from .attention_matching_kv import AttentionMatchingKV
from .evict import Evict
from .interface import FitInputs, FittedState, StateMethod
from .kvpress_press import PREFIX as KVPRESS_PREFIX
from .kvpress_press import KvpressPress
from .recon_fit import ReconFit
from .recon_mixed import ReconMixed
from .recon_refine import ReconRefine
from .selection import KeyScore
from .truncate import Truncate

METHODS: dict[str, StateMethod] = {}


def register(method: StateMethod) -> StateMethod:
    """Add ``method`` (an instance with its default settings) under ``method.name``."""
    if method.name in METHODS or method.name.startswith(KVPRESS_PREFIX) or method.name == "first":
        raise ValueError(f"state method {method.name!r} is already registered (or a reserved name)")
    METHODS[method.name] = method
    return method


def unregister(name: str) -> None:
    METHODS.pop(name, None)


for _m in (Truncate(), Evict(), AttentionMatching(), AttentionMatchingKV(), ReconFit(), ReconMixed(), ReconRefine()):
    register(_m)


def from_targets() -> tuple[str, ...]:
    """Methods fitted from the document KV and the targets alone (``fit_method``); the rest read the
    document with the model."""
    return tuple(name for name, m in METHODS.items() if not m.reads_document)


FROM_TARGETS: tuple[str, ...] = from_targets()  # the built-in ones


def get_method(name: str) -> StateMethod:
    """The method of ``name`` (an old name is read as its new one, said once on stderr), or the kvpress
    press of ``kvpress:<press>[:int8|:int4]``."""
    if name.startswith(KVPRESS_PREFIX):
        presses = KvpressPress.parse(name)
        if len(presses) != 1:
            raise ValueError(f"{name!r} names {len(presses)} presses; ask for one")
        return presses[0]
    name = renamed("method", name)
    if name not in METHODS:
        raise ValueError(f"unknown state method {name!r}; choose one of {', '.join(METHODS)} or kvpress:<press>")
    return METHODS[name]


def init_method(init: str) -> StateMethod | None:
    """The method a trained module starts from (``train.module.init``); None for ``first`` (the
    module's own start from the document rows, nectar/modules/builder.py)."""
    return None if init == "first" else get_method(init)


def method_plan(name: str, plan: ModulePlan, bits: int | None = None) -> ModulePlan:
    """The quadrature plan of method ``name`` in the bytes of ``plan`` (any arch, same ρ), its pairs
    stored at ``bits`` (default the plan's): 4·P bytes per head buy ~7× more pairs at int4 than fp32."""
    return get_method(name).plan(plan, bits)


def fit_method(name: str, doc_kv, targets_url: str, plan: ModulePlan, seed: int = 0,
               score: KeyScore = "mean", max_tokens: int | None = None, bits: int | None = None) -> FittedState:
    """Fit method ``name`` on the document KV and the targets' training queries (seconds), stored at
    ``bits`` (default the plan's); ``score``: how key scores aggregate, for the methods that rank by it."""
    method = get_method(name)
    if method.reads_document:
        raise ValueError(f"state method {name!r} reads the document with the model: call "
                         f"get_method({name!r}).fit(plan, FitInputs(doc_kv, targets, base=…, layout=…, "
                         "document=…, spans=…))")
    if "score" in getattr(method, "__dataclass_fields__", {}):
        method = method.with_options(score=score)
    return method.fit(plan, FitInputs(doc_kv, targets_url, seed=seed, bits=bits, max_tokens=max_tokens))
