"""Sweeps over module architectures, ρ and loss weights on one document (the paper's grid).

The data stages (chunk → targets) run once in the parent run; each variant is a child run directory
``<parent>/sweep/<variant>/`` holding only its own train and evaluate stages, so a grid of k variants
costs k trainings, not k pipelines. The comparison table gathers every variant's headline metrics.
"""
from __future__ import annotations

import itertools
from typing import Any

from ..orchestration import read_eval_tables
from ..orchestration.executor import RunDir, slug
from ..schemas.base import stable_hash
from ..schemas.config import PipelineConfig
from ..schemas.presets import ConfigError, deep_merge, parse_override, regime_overlay
from ..tables import markdown_table
from .variants import Variant

# Short grid names for the paper's axes; any dotted config key works too.
ALIASES = {"arch": "train.module.arch", "rho": "train.module.rho", "lambda_kl": "train.lambda_kl",
           "lambda_alpha": "train.lambda_alpha", "lambda_A": "train.lambda_A", "depths": "train.module.depths"}
VARIANT_SECTIONS = ("train", "evaluate")


def parse_grid(items: list[str]) -> dict[str, list[str]]:
    """``["arch=mlp,quadrature", "rho=0.02,0.05"]`` → {"arch": ["mlp", "quadrature"], …}."""
    grid: dict[str, list[str]] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"grid axis {item!r} must look like key=v1,v2 (e.g. rho=0.02,0.05)")
        key, values = item.split("=", 1)
        grid[key.strip()] = [v.strip() for v in values.split(",") if v.strip()]
    return grid


def expand_variants(base: PipelineConfig, grid: dict[str, list[str]]) -> list[Variant]:
    """Every combination of the grid, validated; only train/evaluate settings may vary."""
    keys = list(grid)
    variants = []
    for values in itertools.product(*(grid[k] for k in keys)):
        data = base.model_dump(mode="json")
        settings = dict(zip(keys, values))
        # A regime first, so explicit axes (e.g. train.samples) override what it brings.
        for key, value in sorted(settings.items(), key=lambda kv: kv[0] != "regime"):
            if key == "regime":
                data = deep_merge(data, regime_overlay(base.preset, value))
                continue
            dotted = ALIASES.get(key, key)
            if dotted.split(".")[0] not in VARIANT_SECTIONS:
                raise ConfigError(f"sweep axis {key!r} changes {dotted.split('.')[0]!r}; a sweep shares the data "
                                  f"stages, so only {VARIANT_SECTIONS} settings may vary")
            data = deep_merge(data, parse_override(f"{dotted}={value}"))
        config = PipelineConfig.model_validate(data)
        name = slug("_".join(f"{k}-{v}" for k, v in settings.items())) or "base"
        variants.append(Variant(name, settings, config))
    return variants


def with_base(config: PipelineConfig, variants: list[Variant]) -> list[Variant]:
    """The grid's variants, led by the parent's own config (``base``) unless the grid holds it:
    every comparison table then has the run's configuration as its reference row."""
    if any(v.config == config for v in variants):
        return variants
    return [Variant("base", {}, config), *variants]


def comparison_row(variant: Variant, run: RunDir) -> dict[str, Any]:
    """One row of the sweep table: the variant's settings and its test-split headline numbers."""
    t = variant.config.train
    row: dict[str, Any] = {"variant": variant.name, "arch": t.module.arch, "rho": t.module.rho,
                           "lambda_alpha": t.lambda_alpha, "lambda_A": t.lambda_A, "lambda_kl": t.lambda_kl}
    manifest = run.read_manifest("train")
    if manifest:
        row.update({k: manifest.counts.get(k) for k in ("module_bytes", "kv_cache_bytes", "heldout_loss_A",
                                                        "heldout_rte_A", "heldout_loss_kl")})
    evaluated = run.read_manifest("evaluate")
    if evaluated:  # evaluate scores the live state: in the parent run that can be the first state, not train's
        row["scored_state"] = evaluated.counts.get("scored_state", "train")
    headline = read_eval_tables(run).get("headline", [])
    for h in headline:
        prefix = "" if h.get("split") == "test" else f"{h.get('split')}_"
        for key in SPLIT_KEYS:
            if key in h:
                row[prefix + key] = h[key]
    for key in RUN_KEYS:  # the same in every split's headline row
        if headline and key in headline[0]:
            row[key] = headline[0][key]
    return row


SPLIT_KEYS = ("token_acc_module", "token_acc_full", "token_acc_none", "token_acc_gap", "recovered_fraction",
              "kl_module", "recovered_kl", "recovered_kl_ci", "delta_s", "delta_s_ci")
# Module vs full KV cache at the benchmark's largest document length (bench_n).
RUN_KEYS = ("module_bytes", "kv_bytes", "bench_n", "ttft_ms_module", "ttft_ms_full_cached", "ttft_ms_full_cold",
            "tok_s_module", "tok_s_full_cached", "tok_s_full_cold")


def comparison_markdown(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(no variants)\n"
    cols = list(dict.fromkeys(k for r in rows for k in r))
    return markdown_table(cols, ([_fmt(r.get(c)) for c in cols] for r in rows))


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def sweep_id(grid: dict[str, list[str]]) -> str:
    return stable_hash(grid)[:8]
