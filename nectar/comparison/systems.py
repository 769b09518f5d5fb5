"""The systems ``nectar compare`` knows: ONE registry, name → how to obtain its provider and bytes.

  reference  ``none`` (the model without the document, 0 bytes) and ``full`` (the exact KV cache of
             the whole document): the two ends every other system sits between.
  trained    a module the train stage trains under a config overlay — a training regime of
             nectar/schemas/presets.py (REGIMES, sized per preset by PRESET_REGIMES) plus optional
             further settings — at each budget ρ, in a variant run directory that shares the run's
             data stages (comparison/sweep.py).
  baseline   a closed-form fit on the document KV and the captured targets,
             ``nectar.baselines.fit_baseline(name, doc_kv, targets_url, plan, seed)``, sized to the
             bytes of the module plan at the same ρ.

Adding a system is adding one entry, e.g. the matching module refined by the mixed loss instead:

    register(System("matching_mixed", "trained", "AM init, refined by L_reg + L_KL", regime="matching",
                    overlay={"train": {"lambda_kl": 2.0}}))
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ..schemas.config import PipelineConfig, TrainConfig
from ..schemas.presets import PRESET_REGIMES, PRESETS, REGIMES, ConfigError, deep_merge, regime_overlay

Kind = Literal["reference", "trained", "baseline"]


@dataclass(frozen=True)
class System:
    name: str
    kind: Kind
    description: str
    regime: str | None = None  # trained: the REGIMES overlay
    overlay: dict[str, Any] = field(default_factory=dict)  # trained: further settings on top of the regime
    baseline: str | None = None  # baseline: the name fit_baseline takes

    def __post_init__(self) -> None:
        if self.kind == "trained" and self.regime is None and not self.overlay:
            raise ValueError(f"trained system {self.name!r} needs a regime or an overlay")
        if self.kind == "baseline" and not self.baseline:
            raise ValueError(f"baseline system {self.name!r} needs the name of its fit")
        if self.regime is not None and self.regime not in REGIMES:
            raise ValueError(f"system {self.name!r}: unknown regime {self.regime!r}")


SYSTEMS: dict[str, System] = {}


def register(system: System) -> System:
    if system.name in SYSTEMS:
        raise ValueError(f"system {system.name!r} is already registered")
    SYSTEMS[system.name] = system
    return system


for _s in (
    System("none", "reference", "the base model without the document (0 bytes)"),
    System("full", "reference", "the exact KV cache of the whole document"),
    System("regression", "trained", "NECTAR MLP, regression on the captured (α, A)", regime="regression"),
    System("mixed", "trained", "NECTAR MLP, regression + distillation (KL)", regime="mixed"),
    System("distill", "trained", "NECTAR MLP, distillation only (KL)", regime="distill"),
    System("cartridges", "trained", "quadrature (document-initialised keys/values) + KL, the paper's baseline",
           regime="cartridges"),
    System("matching", "trained", "quadrature + log-mass bias initialised by Attention Matching, refined by "
           "regression on the captured targets", regime="matching"),
    System("truncate", "baseline", "exact KV of a ρ·n-token part of the document", baseline="truncate"),
    System("evict", "baseline", "exact KV of the ρ·n most-attended tokens per KV head", baseline="evict"),
    System("attention_matching", "baseline", "the evicted keys with fitted log-mass biases and "
           "least-squares values (Zweiger et al., 2026)", baseline="attention_matching"),
    System("attention_matching_kv", "baseline", "attention_matching without the bias (β = 0) and the same "
           "number of keys in every layer: plain KV, what vLLM serves", baseline="attention_matching_kv"),
):
    register(_s)


def baselines_available() -> bool:
    """Whether this checkout has the closed-form baselines (``nectar.baselines.fit_baseline``)."""
    try:
        from .. import baselines
    except ImportError:
        return False
    return hasattr(baselines, "fit_baseline")


def resolve(names: list[str] | None) -> list[System]:
    """The requested systems in registry order. ``None`` means every system this checkout can run
    (the baselines only when ``nectar.baselines`` is there); a name asked for must exist and run."""
    if names is None:
        ok = baselines_available()
        return [s for s in SYSTEMS.values() if s.kind != "baseline" or ok]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        raise ConfigError(f"unknown system {unknown[0]!r}; the systems are {', '.join(SYSTEMS)}")
    wanted = set(names)
    chosen = [s for s in SYSTEMS.values() if s.name in wanted]
    missing = [s.name for s in chosen if s.kind == "baseline"]
    if missing and not baselines_available():
        raise ConfigError(f"system {missing[0]!r} is a closed-form baseline and this checkout has no "
                          "nectar.baselines.fit_baseline; update the code or leave it out of --systems")
    return chosen


# ----- a trained system's configuration -----

def _paths(tree: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out += _paths(value, (*prefix, key))
        else:
            out.append((*prefix, key))
    return out


def _get(tree: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def system_keys(preset: str) -> list[tuple[str, ...]]:
    """Every train setting some regime or registered system sets (λs, budget, batch, lr, arch, …)."""
    trees = [REGIMES[r] for r in REGIMES] + list(PRESET_REGIMES.get(preset, {}).values())
    trees += [s.overlay for s in SYSTEMS.values()]
    paths = {p for t in trees for p in _paths(t.get("train", {}))}
    return sorted(paths)


def trained_config(run_config: PipelineConfig, system: System, rho: float) -> PipelineConfig:
    """The run's configuration with ``system``'s training settings at budget ``rho``.

    Every train setting that some regime or system sets is first reset to the preset's own value,
    then the system's regime and overlay apply: ``mixed`` is the preset's mixed regime whatever
    regime the run itself was made with (a run made with ``--regime mixed`` must not hand its
    240-pair budget to ``regression``). Other train settings (depths, seed, …) stay the run's.
    """
    if system.kind != "trained":
        raise ValueError(f"system {system.name!r} is not trained")
    preset = run_config.preset
    data = run_config.model_dump(mode="json")
    preset_train = deep_merge(TrainConfig().model_dump(mode="json"), PRESETS.get(preset, {}).get("train", {}))
    for path in system_keys(preset):
        _set(data["train"], path, _get(preset_train, path))
    if system.regime is not None:
        data = deep_merge(data, regime_overlay(preset, system.regime))
    data = deep_merge(data, system.overlay)
    data["train"]["module"]["rho"] = rho
    return PipelineConfig.model_validate(data)
