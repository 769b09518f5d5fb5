"""The systems ``nectar compare`` knows: ONE registry, name → how to obtain its provider and bytes.

  reference  ``none`` (the model without the document, 0 bytes) and ``full`` (the exact KV cache of
             the whole document): the two ends every other system sits between.
  trained    a module the train stage trains under a config overlay — a training regime of
             nectar/schemas/presets.py (REGIMES, sized per preset by PRESET_REGIMES) plus optional
             further settings — at each budget ρ, in a variant run directory that shares the run's
             data stages (comparison/sweep.py).
  method     a state method of nectar/states (``System.method``: the registry's name; ``options``: its
             settings) fitted at compare time on the document KV and, as the method reads them, the
             captured targets or the document — the outside baselines (truncate, evict,
             attention_matching) and the product's own (``recon_fit``, ``recon_first@int4``, …) alike —
             sized to the bytes of the module plan at the same ρ. (Called ``baseline`` before; that
             name is still read as ``method``, and old comparison tables keep it.)
  run        the run's own states (the first state from the document alone, the refined one of the
             train stage), as the pipeline made them, at the run's ρ: always compared when the run has
             them, never named (``run_states``)
  kvpress    a press of NVIDIA's kvpress library (``kvpress:<press>``, optionally ``:int8`` / ``:int4``
             for kept keys and values stored at that precision): the registry's kvpress adapter family
             (nectar/states/kvpress_press.py), run in its own venv on the same token ids
             (nectar/kvpress/), keeping the entries whose stored bytes are ρ of the document KV.
             Asked for by name only (``kvpress:all`` = every press that runs offline).
  served     the run's state as vLLM serves it (``vllm:trained``: the trained module, β and ragged budgets
             through NECTAR's attention backend; ``vllm:attention_matching_kv@int4``: the β-free refit any
             vLLM serves): exported (nectar/serving/engines/vllm_export.py), served by a vLLM server started
             and stopped here, and scored on the held-out probes through vLLM's prompt_logprobs — over
             coarse buckets (vLLM's top k and the rest of the vocabulary), so its row is a figure of its own
             basis (``ComparisonRow.kl_basis``), shown in a section of its own beside the torch engine's
             figure for the same state on the same buckets (comparison/served_rows.py). Opt-in, at the run's ρ.

Old names (``recon_fit_qa@int4``, …) are read as their new ones (nectar/schemas/renamed.py).

Adding a system is adding one entry, e.g. the matching module refined by the mixed loss instead:

    register(System("matching_mixed", "trained", "AM init, refined by L_reg + L_KL", regime="matching",
                    overlay={"train": {"lambda_kl": 2.0}}))
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ..schemas.config import (FIRST_FIT_BY, FIRST_FIT_KEYS, FIRST_REFINE, FIRST_KEY_CHOICE, FIRST_SCORE_WINDOW, ModuleConfig, PipelineConfig,
                              TrainConfig)
from ..schemas.presets import PRESET_REGIMES, PRESETS, REGIMES, ConfigError, deep_merge, regime_overlay
from ..schemas.renamed import renamed
from ..states.greedy_keys import GREEDY_SHARE
from ..states.kvpress_press import PREFIX as KVPRESS_PREFIX
from ..states import StateMethod, get_method
from ..states.kvpress_press import KvpressPress, PressNameError

Kind = Literal["reference", "trained", "method", "kvpress", "run", "served"]  # "baseline": read as "method"


@dataclass(frozen=True)
class System:
    name: str
    kind: Kind
    description: str
    regime: str | None = None  # trained: the REGIMES overlay
    overlay: dict[str, Any] = field(default_factory=dict)  # trained: further settings on top of the regime
    method: str | None = None  # method: its state method's name in nectar/states/registry.py
    press: str | None = None  # kvpress: the press (nectar/kvpress/worker.py PRESSES)
    bits: int = 32  # method / kvpress: storage precision of its kept entries (trained: train.module.bits in overlay)
    options: dict[str, Any] = field(default_factory=dict)  # method: its method's settings (recon_fit: select's)
    default: bool = True  # in a compare without --systems (opt-in: ablations, systems that train extra variants)
    refines: str | None = None  # trained: the closed-form system it starts from (compare: paired Δ to it)
    served: str | None = None  # served: the state exported for vLLM (``nectar serve --engine vllm --state``)

    def __post_init__(self) -> None:
        if self.kind == "baseline":  # the old name of "method" (a System registered by code written before)
            object.__setattr__(self, "kind", "method")
        if self.kind == "trained" and self.regime is None and not self.overlay:
            raise ValueError(f"trained system {self.name!r} needs a regime or an overlay")
        if self.kind == "kvpress" and not self.press:
            raise ValueError(f"kvpress system {self.name!r} needs a press")
        if self.kind == "method" and not self.method:
            raise ValueError(f"method system {self.name!r} needs the name of its state method")
        if (self.kind == "served") != (self.served is not None):
            raise ValueError(f"system {self.name!r}: a served system, and only one, names the state it serves")
        if self.kind == "served" and self.default:
            raise ValueError(f"served system {self.name!r} starts a vLLM server: opt-in only (default=False)")
        if self.refines is not None and self.kind != "trained":
            raise ValueError(f"system {self.name!r}: only a trained system refines another")
        if self.regime is not None and self.regime not in REGIMES:
            raise ValueError(f"system {self.name!r}: unknown regime {self.regime!r}")


SYSTEMS: dict[str, System] = {}


def register(system: System) -> System:
    if system.name in SYSTEMS:
        raise ValueError(f"system {system.name!r} is already registered")
    SYSTEMS[system.name] = system
    return system


def register_variant(base: str, name: str, note: str, **options: Any) -> str:
    """``name``: the method system ``base`` with ``options`` over its settings, opt-in (a benchmark's sweep
    point, e.g. another step count or rate), registered once; ``note`` is added to ``base``'s description."""
    if name not in SYSTEMS:
        b = SYSTEMS[base]
        register(System(name, "method", f"{b.description}{note}", method=b.method, bits=b.bits,
                        options={**b.options, **options}, default=False))
    return name


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
    System("recon_fit_regime", "trained", "the train stage's recon_fit state: recon_fit@int4 made by the pipeline "
           "(regime recon_fit: reconstruction-selected keys, quantization-aware fit, int4, no gradient steps)",
           regime="recon_fit",
           default=False),
    System("truncate", "method", "exact KV of a ρ·n-token part of the document", method="truncate"),
    System("evict", "method", "exact KV of the ρ·n most-attended tokens per KV head", method="evict"),
    System("attention_matching", "method", "the evicted keys with fitted log-mass biases and "
           "least-squares values (Zweiger et al., 2026)", method="attention_matching"),
    System("attention_matching_kv", "method", "attention_matching without the bias (β = 0) and the same "
           "number of keys in every layer: plain KV, what vLLM serves", method="attention_matching_kv"),
    # recon_fit (nectar/states/recon_fit.py; KVzip's context reconstruction selects the keys) and its
    # ablations: each differs from recon_select / recon_fit in one SelectionConfig switch.
    System("recon_select", "method", "exact KV of the keys reconstruction attends to most (max over spans), "
           "one budget across layers and KV heads, 4 sink tokens (KVzip's selection)", method="recon_fit",
           options={"fit": False}),
    System("recon_select_layer", "method", "recon_select with the plan's budget per layer",
           method="recon_fit", options={"fit": False, "budget": "layer"}, default=False),
    System("recon_select_mean", "method", "recon_select scoring keys by mean instead of max",
           method="recon_fit", options={"fit": False, "aggregate": "mean"}, default=False),
    System("recon_fit", "method", "recon_select's keys with fitted log-mass biases and least-squares values "
           "on reconstruction + train queries", method="recon_fit", options={"fit": True}),
    System("recon_fit_layer", "method", "recon_fit with the plan's budget per layer",
           method="recon_fit", options={"fit": True, "budget": "layer"}, default=False),
    System("recon_fit_recon", "method", "recon_fit on reconstruction queries only",
           method="recon_fit", options={"fit": True, "fit_queries": "recon"}, default=False),
    System("recon_fit_nosink", "method", "recon_fit without sink tokens",
           method="recon_fit", options={"fit": True, "sink_tokens": 0}, default=False),
    System("recon_fit_template", "method", "recon_fit keeping every chat-template token exact",
           method="recon_fit", options={"fit": True, "template_tokens": True}, default=False),
    # the selection lever for the QA pairs: keys ranked by the max of the reconstruction and the train
    # queries' scores (each normalised at the budget's cut), fitted on both
    System("recon_fit_qa", "method", "recon_fit ranking keys by reconstruction AND train queries (max of the "
           "two scores, each divided by its value at the budget's cut)", method="recon_fit",
           options={"fit": True, "score_queries": "recon+train"}, default=False),
    # recon_fit's state refined through the train stage (init "recon_fit"): by the regression loss on the
    # captured targets (matching's refinement), or end to end by the KL to the teacher through the
    # frozen model (every stored key, β and value trained), on the train pairs.
    System("recon_train", "trained", "recon_fit refined by regression on the captured targets (matching's loss)",
           regime="matching", overlay={"train": {"module": {"init": "recon_fit"}}}, default=False),
    System("recon_train_recon", "trained", "recon_fit refined by regression on the train pairs and the "
           "reconstruction spans, 12k query tokens (needs targets.recon.capture=true)", regime="matching",
           overlay={"train": {"splits": "train+recon", "samples": 12_000, "module": {"init": "recon_fit"}}},
           default=False),
    System("recon_distill", "trained", "recon_fit refined end to end by the KL to the full model's top-K",
           regime="matching", overlay={"train": {"lambda_alpha": 0.0, "lambda_A": 0.0, "lambda_kl": 1.0,
                                                 "samples": 240, "batch_size": 4, "peak_lr": 1e-3,
                                                 "module": {"init": "recon_fit"}}}, default=False),
):
    register(_s)


# Every closed-form baseline at int8 and int4 (default: cheap), and the matching state trained in float at
# the pairs its bits buy and stored quantized (opt-in: a training run per budget). The kept-entry count
# follows the byte budget: ρ stays a share of the float32 KV's bytes, the codes are 4–7× smaller.
for _bits in (8, 4):
    for _name in ("truncate", "evict", "attention_matching"):
        register(System(f"{_name}@int{_bits}", "method", f"{SYSTEMS[_name].description}, stored at int{_bits} "
                        "(fp16 scale and zero per 64 values), as many entries as the bytes buy",
                        method=_name, bits=_bits))
    register(System(f"matching@int{_bits}", "trained", f"matching with as many pairs as int{_bits} storage buys "
                    "in the bytes, trained in float, stored and served at int{_bits}".replace("{_bits}", str(_bits)),
                    regime="matching", overlay={"train": {"module": {"bits": _bits}}}, default=False))


# recon_fit states stored quantized: as many pairs as the bytes buy (keys, values as codes, β bf16),
# fitted to the keys and β as stored (``_float``: fitted in float, then rounded).
for _bits in (8, 4):
    for _name, _opts, _default in (("recon_fit", {"fit": True}, True),
                                   ("recon_select", {"fit": False}, False),
                                   ("recon_fit_qa", {"fit": True, "score_queries": "recon+train"}, _bits == 4),
                                   ("recon_fit_float", {"fit": True, "quant_aware": False}, False)):
        _desc = SYSTEMS["recon_fit" if _name == "recon_fit_float" else _name].description
        if _name == "recon_fit_float":
            _desc += " (fitted in float, then rounded)"
        register(System(f"{_name}@int{_bits}", "method", f"{_desc}, stored at int{_bits} (fp16 scale and zero "
                        "per 64 values, β bf16), as many pairs as the bytes buy", method="recon_fit", bits=_bits,
                        options=_opts, default=_default))


# The first state's settings before its key choice went "auto" (issue 38): the variants below are this with one
# setting changed, as they were measured (their cache keys unchanged)
FIRST_TOP = {"fit": True, "fit_queries": "recon", "score_queries": "recon", "fit_keys": FIRST_FIT_KEYS,
             "score_window": FIRST_SCORE_WINDOW}
# The first state's selection as it is now (FIRST_SELECT): the systems that must equal it start from this
FIRST = {**FIRST_TOP, "key_choice": FIRST_KEY_CHOICE, "fit_by": FIRST_FIT_BY}
# ... and its end-to-end steps where keys are scarce (FIRST_REFINE): the first stage's state as a method
FIRST_STATE = {**FIRST, **FIRST_REFINE.model_dump()}

# The first state's algorithm (nectar/stages/first.py) at any budget: keys ranked and β, values fitted on the
# reconstruction queries alone, int4 — from the document alone, so its state s is prefill + fit (opt-in).
register(System("recon_first@int4", "method", "the first stage's state: recon_fit ranked and fitted on the "
                "reconstruction queries alone (no question about the document), at most "
                f"{FIRST_FIT_KEYS:,} keys of a head fitted jointly, each key scored by the reconstruction within "
                f"{FIRST_SCORE_WINDOW:,} tokens of it, a head's keys chosen together for the fit where the state "
                f"keeps at most {GREEDY_SHARE:.0%} of the document's entries and there refined end to end by "
                f"{FIRST_REFINE.steps} Adam steps (per {FIRST_REFINE.per_tokens:,} tokens past that length) on the KL to the full-context model over the reconstruction (top-scored "
                "keys above, and β and values made by merging every evicted key into its most similar kept one instead "
                "of least squares), stored at int4 (fp16 scale and zero per 64 values, β bf16)",
                method="recon_refine", bits=4, options=FIRST_STATE, default=False))
# ... its fit alone, without the end-to-end steps (the first state up to first.refine's auto; what the first stage
# publishes live while its steps run)
register(System("recon_first_fit@int4", "method", "recon_first@int4's closed-form fit alone, without its end-to-end "
                "steps (what the first stage publishes live while they run)", method="recon_fit", bits=4,
                options=FIRST, default=False))
# ... keeping each head's top-scored keys at every budget, as the first state did before (issue 38's panel
# measured this as the first state: docs/quality.md, "A panel of documents")
register(System("recon_first_top@int4", "method", "recon_first@int4 keeping each head's top-scored keys at every "
                "budget", method="recon_fit", bits=4, options=FIRST_TOP, default=False))
# ... fitting every kept key of a head jointly, as the first state did before the cap (issue 39): on long
# documents slower and worse (docs/quality.md, "A cap on the keys fitted jointly")
register(System("recon_first_allkeys@int4", "method", "recon_first_top@int4 fitting every kept key of a head "
                "jointly (no cap)", method="recon_fit", bits=4, options={**FIRST_TOP, "fit_keys": None},
                default=False))

# ... with every reconstruction batch scoring every key, as the first state did before its score window
# (issue 39): the same probe figures on a 5.3k-token text, a scoring that grows with n² (docs/quality.md,
# "Scores from the nearby reconstruction")
register(System("recon_first_allscores@int4", "method", "recon_first_top@int4 with every reconstruction batch "
                "scoring every key (no score window)", method="recon_fit", bits=4,
                options={**FIRST_TOP, "score_window": None}, default=False))

# ... stored at int8: half the keys of int4 in the same bytes (issue 38: does the first state's precision explain
# its 5 % shortfall against KVzip+int8? On pydoc:naming it does not; docs/quality.md, "A panel of documents")
register(System("recon_first@int8", "method", "recon_first_top@int4's selection and fit, stored at int8 (fp16 "
                "scale and zero per 64 values, β bf16): half the pairs in the same bytes", method="recon_fit", bits=8,
                options=FIRST_TOP, default=False))

# ... with the fitted values rounded onto their int4 grid by the value fit's own objective (GPTQ's rounding,
# nectar/states/value_rounding.py) instead of each to its nearest point: the same bytes (issue 38)
register(System("recon_first_gptq@int4", "method", "recon_first_top@int4 with its fitted values rounded onto the "
                "int4 grid row by row, each rounding error moved onto the rows not yet rounded by the value "
                "fit's least squares (GPTQ)", method="recon_fit", bits=4,
                options={**FIRST_TOP, "value_rounding": "gptq"}, default=False))

# ... with each head's keys chosen together for the fit they allow (orthogonal least squares over 4× its
# top-scored keys, nectar/states/greedy_keys.py) at every budget: the same counts (issue 38)
register(System("recon_first_greedy@int4", "method", "recon_first@int4 with each head's keys (as many) chosen "
                "greedily from 4x its top-scored ones to span the fit queries' mass and output, at every budget",
                method="recon_fit", bits=4, options={**FIRST_TOP, "key_choice": "greedy"}, default=False))


# ... refined end to end at every budget: gradient steps on the next-token KL to the full-context model, teacher-forced
# on the document's own reconstruction spans, the state read as stored (issue 38's lever, nectar/states/recon_refine.py;
# the first state takes them where keys are scarce, as measured here at 0.5 %)
register(System("recon_first_refined@int4", "method", "recon_first@int4's fit refined at every budget by Adam steps "
                "on the KL to the full-context model over the reconstruction spans, every stored key, value and β read on "
                "its grid (straight-through); kept only where it lowers the spans' KL (recon_first@int4 refines only "
                "where keys are scarce)", method="recon_refine", bits=4, options=FIRST, default=False))

# ... with every evicted key merged into its most similar kept key (β and the value keep the merged keys' total
# attention mass and mass-weighted value on the fit queries) instead of β and values fitted by least squares
# (issue 38's lever, select.fit_by "merge", nectar/states/merging.py; the first state's whole state where it keeps
# over a quarter of the entries, each head where that holds up better on held-out fit queries below: fit_by "auto")
register(System("recon_first_merged@int4", "method", "recon_first@int4's keys with every evicted key merged into "
                "its most similar kept key (β and value keep their total attention mass and mass-weighted value on "
                "the reconstruction queries) instead of the least-squares fit", method="recon_fit", bits=4,
                options={**FIRST, "fit_by": "merge"}, default=False))
# ... and by least squares at every budget (the first state before fit_by "auto")
register(System("recon_first_lsq@int4", "method", "recon_first@int4 with β and values fitted by least squares at "
                "every budget", method="recon_fit", bits=4,
                options={**FIRST, "fit_by": "least_squares"}, default=False))
# ... and per (layer, KV head) by whichever of the two does better on a fifth of the fit queries held out of both
# (select.fit_by "choose", nectar/states/reconstruction.py _HeadFit.choose) at every budget: what recon_first@int4
# does between the scarce share and a quarter of the entries (1–3.5 % of the float32 bytes at int4)
register(System("recon_first_chosen@int4", "method", "recon_first@int4 with each head's β and values by least "
                "squares or by merging, whichever does better on reconstruction queries held out of both", method="recon_fit",
                bits=4, options={**FIRST, "fit_by": "choose"}, default=False))

# ... fitted as recon_first@int4 is, with the fit's ridge pulling β and the values toward that merge instead of
# β = 0 and the kept keys' own values (select.fit_prior "merged")
register(System("recon_first_fitmerged@int4", "method", "recon_first@int4 with the closed-form fit ridged toward the "
                "evicted keys merged into the kept ones (β, values) instead of β = 0 and the kept values",
                method="recon_fit", bits=4, options={**FIRST, "fit_prior": "merged", "fit_by": "least_squares"},
                default=False))

# The bits allocated by rate and distortion (issue 38, nectar/states/recon_mixed.py): recon_first's keys and
# queries, each (layer, KV head) stored at int2, int4 or int8 as distortion removed per byte decides (opt-in:
# stored as one module per precision, so scored here but not yet servable from one file).
register(System("recon_mixed", "method", "the first state's selection and fit (reconstruction queries alone), "
                "each (layer, KV head)'s pairs at int2 / int4 / int8 chosen across the state by distortion "
                "removed per byte, the rest evicted", method="recon_mixed", default=False))


# The default state (recon_fit_qa@int4) refined by gradient steps that see it as stored (train.quant_aware:
# keys, values and β rounded on their grid in every forward, straight-through gradient), so the trained
# state is the stored one and starts from the quantization-aware fit instead of discarding it; and the
# same regression refinement trained in float and rounded after (the ablation of quant_aware). Opt-in:
# each trains a variant per budget.
_QA_TRAIN = {"refine": True, "lambda_alpha": 0.1, "lambda_A": 1.0, "lambda_kl": 0.0, "peak_lr": 1e-3,
             "samples": 12_000, "module": {"bits": 4}}
for _name, _desc, _train in (
        ("recon_train_qa@int4", "recon_fit_qa@int4 refined as stored (int4 keys/values, bf16 β, straight-through "
         "gradient) by regression on the train pairs' captured targets, 12k query tokens", {**_QA_TRAIN, "quant_aware": True}),
        ("recon_train_qa_fast@int4", "recon_train_qa@int4 at 10x the learning rate (1e-2): an int4 code flips "
         "only once the float behind it crosses half a step", {**_QA_TRAIN, "quant_aware": True, "peak_lr": 1e-2}),
        ("recon_train_qa_float@int4", "recon_train_qa@int4 trained in float and rounded after (no "
         "quantization-aware steps)", {**_QA_TRAIN, "quant_aware": False}),
        ("recon_distill_qa@int4", "recon_fit_qa@int4 refined as stored end to end by the KL to the full "
         "model's top-K on the train pairs (240 pairs, batch 4)",
         {"refine": True, "quant_aware": True, "lambda_alpha": 0.0, "lambda_A": 0.0, "lambda_kl": 1.0,
          "samples": 240, "batch_size": 4, "peak_lr": 1e-3, "module": {"bits": 4}})):
    register(System(_name, "trained", _desc, regime="recon_fit", overlay={"train": _train}, default=False,
                    refines="recon_fit_qa@int4"))


# The β-free refit at the bits of an int4/int8 run: what `nectar serve RUN --engine vllm` serves for a module
# that is not plain KV (nectar/serving/engines/vllm_export.py), as many pairs as the bytes buy (opt-in: the row of
# that served state; vLLM holds the pairs at its KV dtype).
for _bits in (8, 4):
    register(System(f"attention_matching_kv@int{_bits}", "method", f"{SYSTEMS['attention_matching_kv'].description}, "
                    f"stored at int{_bits} (fp16 scale and zero per 64 values), as many pairs as the bytes buy",
                    method="attention_matching_kv", bits=_bits, default=False))


# The run's state as vLLM serves it (issue 41): the trained module through NECTAR's attention backend, and the
# β-free refit at int8/int4 (the named fallback, ``nectar serve --engine vllm --state attention_matching_kv@int4``).
# Opt-in: each starts a vLLM server (its own venv, `nectar llm setup`) for its row.
SERVED_PREFIX = "vllm:"
register(System(f"{SERVED_PREFIX}trained", "served", "this run's trained module as vLLM serves it (β and ragged "
                "budgets through NECTAR's attention backend), probe KL over vLLM's top-k buckets", served="trained",
                default=False))
for _bits in (8, 4):
    register(System(f"{SERVED_PREFIX}attention_matching_kv@int{_bits}", "served", f"attention_matching_kv@int{_bits} "
                    "at the run's ρ as vLLM serves it (plain KV, no plugin needed), probe KL over vLLM's top-k "
                    "buckets", served=f"attention_matching_kv@int{_bits}", default=False))


# The run's own states (issue 39): compared in every ``nectar compare RUN`` that has them, with the time the
# pipeline took to each (the first: chunk → first; the refined: every stage through promote).
RUN_STATES: dict[str, tuple[str, str]] = {  # system name → (stage holding it, description)
    "run:first": ("first", "this run's first state: keys chosen by reconstructing the document alone, closed-form "
                  "β and values, no LLM server (the first stage; recon_fit on reconstruction queries)"),
    "run:refined": ("train", "this run's refined state: the train stage's, made after self-study"),
}


def run_states(stages_done: set[str]) -> list[System]:
    """The run's states whose stage holds a module (``stages_done``: stages with a module.json)."""
    return [System(name, "run", desc, default=False) for name, (stage, desc) in RUN_STATES.items()
            if stage in stages_done]


def methods_available() -> bool:
    """Whether this checkout has the state methods a baseline system fits (``nectar.states``)."""
    try:
        from .. import states
    except ImportError:
        return False
    return hasattr(states, "get_method")


def kvpress_systems(name: str) -> list[System]:
    """``kvpress:<press>[:int8|:int4]`` (or ``kvpress:all[:bits]``) → its systems: the registry's kvpress
    adapter family parses the name (one-line errors for unknown presses and for presses that need a
    model-hub download: listed, never dropped)."""
    try:
        presses = KvpressPress.parse(name)
    except PressNameError as exc:
        raise ConfigError(str(exc)) from None
    return [System(p.key, "kvpress", p.description, press=p.press, bits=p.bits) for p in presses]


def resolve(names: list[str] | None) -> list[System]:
    """The requested systems in registry order, then the kvpress ones asked for (``kvpress:…``).
    ``None`` means every registered system this checkout can run (the baselines only when
    ``nectar.states`` is there; kvpress only by name); a name asked for must exist and run. An old
    name is read as its new one (nectar/schemas/renamed.py)."""
    if names is None:
        ok = methods_available()
        return [s for s in SYSTEMS.values() if s.default and (s.kind != "method" or ok)]
    presses = [s for n in names if n.startswith(KVPRESS_PREFIX) for s in kvpress_systems(n)]
    names = [renamed("system", n) for n in names if not n.startswith(KVPRESS_PREFIX)]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        raise ConfigError(f"unknown system {unknown[0]!r}; the systems are {', '.join(SYSTEMS)} and "
                          "kvpress:<press> (kvpress:all for every press)")
    wanted = set(names)
    chosen = [s for s in SYSTEMS.values() if s.name in wanted]
    missing = [s.name for s in chosen if s.kind == "method"]
    if missing and not methods_available():
        raise ConfigError(f"system {missing[0]!r} is a closed-form baseline and this checkout has no "
                          "nectar.states; update the code or leave it out of --systems")
    return chosen + list({s.name: s for s in presses}.values())


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


def system_method(system: System, module: ModuleConfig) -> StateMethod:
    """A baseline system's state method: the registry's, with the run's settings for it
    (``train.module``) and the system's own switches (``options``)."""
    if system.kind != "method":
        raise ValueError(f"system {system.name!r} is not fitted by a state method")
    return get_method(system.method).configured(module).with_options(**system.options)
