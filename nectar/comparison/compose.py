"""``nectar compare RUN_A RUN_B …``: the documents' states composed, scored against the full context of
the documents concatenated (docs/quality.md, "Several documents at once").

  1. open    the runs (one base model, else refused in one line); the reference context is their
             documents joined by a blank line in the order given, under the model's chat layout
  2. probes  held-out probes of each document (``queries/probes.py``, the run's probe settings, split
             ``probes:<doc>``), and prompts that need both: quote the sentence holding a phrase of one
             document, then the one holding a phrase of the other (split ``both``); ``probes`` is all of
             them. Every prompt is scored at the concatenation's positions
  3. states  each baseline system fitted on each document alone, from that run's document KV (ρ of
             each document's KV, so a composition holds ρ of the KVs' total bytes); ``module``: each
             run's trained module. Composed under every asked layout (nectar/attention/compose.py),
             and each part alone (at its concat offset) to show what the other documents add.
             ``<recon_fit system>+gaps``: each document refitted at the gap its place in the layout
             puts after it (recon_fit ``fit_gaps``, ``part_gaps``), paired against the plain one
  4. score   every provider on every prompt (teacher forced, paired bootstrap over prompts); kvpress
             presses on the concatenated context in their own venv; paired Δ of each composition to the
             best press at the same ρ
  5. write   OUT/comparison.parquet (ComparisonRow), comparison.md, info.json
"""
from __future__ import annotations

import dataclasses
import json
import random
import re
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..attention.compose import POSITIONS, CompositionError, compose, part_gaps, refuse_different_models, shared_prefix
from ..attention.doc_kv import DocKV, prefill_document
from ..attention.exact import ExactDocState
from ..states import FitInputs, FittedState
from ..evaluation.scoring import score_providers
from ..evaluation.selection import Selection
from ..evaluation.teacher import EvalPair, PairSums
from ..kvpress import BridgeResult, KvpressEnvError, KvpressError, PressJob, PressResult, score_presses
from ..layout import PromptLayout, build_layout
from ..orchestration.context import RunContext, load_base
from ..orchestration.executor import CODE_VERSION, RunDir, now
from ..schemas.artifacts import ComparisonRow, ProbeRow
from ..schemas.base import stable_hash
from ..schemas.presets import ConfigError
from ..schemas.renamed import renamed
from ..queries.probes import make_probes
from ..queries.recon import make_recon
from ..storage import atomic_write
from .differences import paired, to_best_press
from .inputs import CompareInputError, open_for_compare
from .jobs import baseline_plan
from .outputs import write_comparison
from .run import SCORE_BATCH
from .table import comparison_markdown, differences_markdown
from .systems import System, resolve, system_method

SEPARATOR = "\n\n"  # between the documents of the reference context
# a recon_fit system named with this suffix (``recon_fit@int4+gaps``) fits each document with its
# reconstruction queries also at the gap its place in the layout implies (``part_gaps``): a compose-time refit
GAPS = "+gaps"
BOTH = "Quote the sentence of the documents that contains the phrase «{a}», then the one that contains «{b}»."


@dataclass
class Part:
    """One document: its run, its own layout (positions 0 … n − 1) and its exact KV."""

    ctx: RunContext
    label: str  # the document's id: split and system names
    layout: PromptLayout
    doc_kv: DocKV


@dataclass
class Prompt:
    pair_id: str
    task: str
    splits: tuple[str, ...]
    instruction: str
    response: str


def open_runs(run_dirs: list[str], require_targets: bool = False) -> list[RunContext]:
    """Reopen the runs (each a run directory); one base model for all, else one line naming both."""
    if len(run_dirs) < 2:
        raise CompareInputError(f"composing needs at least two runs, got {len(run_dirs)}; "
                                "give `nectar compare RUN_A RUN_B`")
    ctxs = []
    for r in run_dirs:
        if require_targets:
            ctxs.append(open_for_compare(r))
        else:
            from ..orchestration.context import open_run
            from ..tables import ArtifactError

            if not RunDir(r).exists("run.json"):
                raise CompareInputError(f"{r} is not a run directory (no run.json); make one with `nectar run DOC`")
            try:
                ctxs.append(open_run(r))
            except ArtifactError as exc:
                raise CompareInputError(f"{r}: {exc}") from None
    try:
        refuse_different_models([(c.run.root, c.config.model) for c in ctxs])
    except CompositionError as exc:
        raise CompareInputError(str(exc)) from None
    return ctxs


def labels(ctxs: list[RunContext]) -> list[str]:
    """Each document's name (its id without the hash suffix), numbered when two runs share one."""
    ids = [re.sub(r"-[0-9a-f]{8}$", "", c.info.doc_id) for c in ctxs]
    return [d if ids.count(d) == 1 else f"{d}#{i + 1}" for i, d in enumerate(ids)]


def composed_prompts(texts: list[tuple[str, str]], ctx: RunContext, per_doc: int, both: int,
                     seed: int = 0) -> list[Prompt]:
    """Held-out probes of each document (up to ``per_doc``, seeded) and ``both`` prompts that need two
    documents (a locate probe of one, then of the next, cycling through the documents)."""
    cfg = ctx.config.targets.probes
    rng = random.Random(seed)
    out: list[Prompt] = []
    locates: list[list[ProbeRow]] = []
    for label, text in texts:
        held = sorted((p for p in make_probes(text, cfg) if p.split == "probes"), key=lambda p: p.probe_id)
        picked = held if len(held) <= per_doc else sorted(rng.sample(held, per_doc), key=lambda p: p.probe_id)
        out += [Prompt(f"{label}:{p.probe_id}", p.kind, ("probes", f"probes:{label}"), p.instruction, p.response)
                for p in picked]
        loc = [p for p in held if p.kind == "locate"]
        rng.shuffle(loc)
        locates.append(loc)
    for i in range(both):
        a, b = i % len(texts), (i + 1) % len(texts)
        if i >= len(locates[a]) or i >= len(locates[b]):
            break
        pa, pb = locates[a][i], locates[b][i]
        phrase = lambda p: p.instruction.split("«", 1)[1].rsplit("»", 1)[0]  # noqa: E731
        out.append(Prompt(f"both-{i:03d}", "both", ("probes", "both"), BOTH.format(a=phrase(pa), b=phrase(pb)),
                          pa.response + "\n" + pb.response))
    return out


def selection(prompts: list[Prompt], layout: PromptLayout) -> Selection:
    """The prompts as evaluation pairs over the concatenated layout (no greedy agreement sample: the
    composed states are compared teacher forced, where intervals are tight)."""
    pairs, per_split = [], {}
    for p in prompts:
        q = layout.pair(p.instruction, p.response)
        pairs.append(EvalPair(p.pair_id, p.task, p.splits, tuple(q.ids), q.response_start))
        for s in p.splits:
            per_split.setdefault(s, []).append(p.pair_id)
    return Selection(pairs, {}, per_split, {s: [] for s in per_split}, {s: [] for s in per_split})


@dataclass
class State:
    """One system's state for one document."""

    provider: Any
    nbytes: int
    seconds: float
    arch: str | None
    rho: float | None = None  # ``module``: the trained module's own budget (its spec's ρ)


def fit_part(part: Part, s: System, rho: float, base, cache_dir: str | None = None, gap: int = 0) -> State:
    """A baseline fitted on one document alone (its own KV, reconstruction spans, targets if the run has
    them), in ρ of that document's KV; or the run's trained module (``module``). ``gap``: a ``+gaps``
    system's reconstruction queries are also asked from that many positions further (recon_fit
    ``fit_gaps``; 0: the system without the suffix, the same state). ``cache_dir``: fitted states are
    kept there and reused by a later compare with the same output folder (another layout, another press:
    minutes of fitting saved), named by ``state_key`` and ``fit_digest``: a state fitted with other
    settings (the system's, the run's, the targets, the release) is fitted again, never reused."""
    path = None
    if cache_dir is not None and s.name != "module":
        path = (f"{cache_dir}/{part.label}-{part.ctx.info.sha256[:12]}-{state_key(s, gap)}-"
                f"{fit_digest(part, s, gap)}-rho{rho:g}.pt")
        cached = _load_state(path, base)
        if cached is not None:
            return cached
    state = _fit_part(part, s, rho, base, gap)
    if path is not None:
        _save_state(path, state)
    return state


def state_key(s: System, gap: int = 0) -> str:
    """The cached state's name: the system's, and for a ``+gaps`` system the gap it was fitted at (at
    gap 0 it is the plain system's state, reused as such)."""
    if not s.name.endswith(GAPS):
        return s.name
    plain = s.name.removesuffix(GAPS)
    return f"{plain}+gap{gap}" if gap else plain


def fit_digest(part: Part, s: System, gap: int = 0) -> str:
    """12 hex digits of what a fitted state depends on besides the document and ρ: the state method's
    settings as configured (a system's definition can change between releases under the same name),
    its precision, the run's model, module, seed and reconstruction settings, the targets stage's
    cache key (the captured queries some methods read) and the release."""
    cfg = part.ctx.config
    method = _configured_method(part, s, gap)
    settings = method_settings(method)
    targets = part.ctx.stage_run("targets").read_manifest("targets")
    return stable_hash({"method": type(method).__name__, "settings": settings, "bits": s.bits,
                        "model": cfg.model.cache_dict(), "module": cfg.train.module.cache_dict(),
                        "seed": cfg.train.seed, "recon": cfg.targets.recon.cache_dict(),
                        "probes": cfg.targets.probes.cache_dict(),
                        "targets": targets.cache_key if targets is not None else None,
                        "code": CODE_VERSION})[:12]


def method_settings(method) -> dict | str:
    """A method's settings as a cached state's digest reads them: every field, except a field the method added
    after states were cached (its ``added_settings``: name → default) while it holds that default — so those
    states stay valid, and a state made with any other value of it is its own entry."""
    if not dataclasses.is_dataclass(method):
        return repr(method)
    added = dict(getattr(method, "added_settings", ()))
    return {k: v for k, v in dataclasses.asdict(method).items() if not (k in added and added[k] == v)}


def _configured_method(part: Part, s: System, gap: int = 0):
    """The state method a system fits on this part (with its composition gap, if any)."""
    method = system_method(s, part.ctx.config.train.module)
    return method.with_options(fit_gaps=(gap,)) if gap else method


def _load_state(path: str, base) -> State | None:
    import os

    import torch

    if not os.path.exists(path):
        return None
    saved = torch.load(path, map_location=base.device, weights_only=False)
    fitted = saved["state"] if "state" in saved else FittedState(saved["name"], saved["module"], saved["plan"])
    return State(fitted, saved["nbytes"], saved["seconds"], saved["arch"])


def _save_state(path: str, state: State) -> None:
    import torch

    fitted = state.provider
    blob = {"nbytes": state.nbytes, "seconds": state.seconds, "arch": state.arch}
    if isinstance(fitted, FittedState):
        blob.update(name=fitted.name, module=fitted.module, plan=fitted.plan)
    else:  # a state of several modules (recon_mixed's, one per precision): kept whole
        blob["state"] = fitted
    atomic_write(path, lambda f: torch.save(blob, f))


def _fit_part(part: Part, s: System, rho: float, base, gap: int = 0) -> State:
    ctx = part.ctx
    t0 = time.perf_counter()
    if s.name == "module":
        from ..modules.io import load_module
        from ..modules.provider import ModuleDocState

        if not ctx.run.exists("train", "module.json"):
            raise CompareInputError(f"system module: {ctx.run.root} has no trained module (run the pipeline "
                                    "through the train stage, or compare a baseline such as recon_fit@int4)")
        module, spec = load_module(ctx.run.url("train"), base, ctx.info.sha256, device=base.device)
        return State(ModuleDocState(module), spec.module_bytes, time.perf_counter() - t0, spec.arch, spec.rho)
    targets = ctx.stage_run("targets").url("targets")
    has_targets = ctx.stage_run("targets").read_manifest("targets") is not None
    method = _configured_method(part, s, gap)
    inputs = FitInputs(part.doc_kv, targets if has_targets else None, seed=ctx.config.train.seed, bits=s.bits)
    if method.reads_document:
        tcfg = ctx.config.targets
        spans = tuple((r.instruction, r.response) for r in make_recon(ctx.text, tcfg.recon, tcfg.probes))
        inputs = dataclasses.replace(inputs, base=base, layout=part.layout, document=ctx.text, spans=spans)
    elif not has_targets:
        raise CompareInputError(f"system {s.name}: fits on the captured targets and {ctx.run.root} has none; run "
                                "its data stages (`nectar run`) or compare a baseline that reads the document "
                                "(recon_fit@int4)")
    dims = dict(num_layers=base.num_layers, num_kv_heads=base.num_kv_heads, head_dim=base.head_dim,
                n_context=part.layout.n, scaling=base.scaling)
    fitted = method.fit(baseline_plan(ctx, rho, dims), inputs)
    return State(fitted, int(fitted.nbytes), time.perf_counter() - t0, s.method)


@dataclass
class Entry:
    """One scored system (a row per split): its key, how it is shown, its provider and facts."""

    key: str
    kind: str
    rho: float | None
    provider: Any
    nbytes: int
    seconds: float | None
    source: str
    arch: str | None = None
    base_system: str | None = None  # the per-document system it composes
    positions: str | None = None


def at_rho(name: str, rho: float | None) -> str:
    """A key at its budget (``recon_fit@int4@0.1``); one without a budget (ρ None) is its name alone."""
    return name if rho is None else f"{name}@{rho:g}"


def common_rho(states: list[State]) -> float | None:
    """The run modules' budget when every document's module has the same one, else None (a table's –)."""
    own = {st.rho for st in states}
    return own.pop() if len(own) == 1 else None


def composed_entries(parts: list[Part], s: System, rho: float | None, positions: list[str], base, n: int,
                     log: Callable[[str], None], cache_dir: str | None = None, prefix=None) -> list[Entry]:
    """The system fitted on every document, composed under each layout (and, given the shared template
    prefix's exact state, with that prefix held once: ``+once``), and each document alone. A ``+gaps``
    system fits each document at the gap each layout puts after it (``part_gaps``): one set of states
    per layout, each document alone with its ``concat`` one. ``rho`` None (``module``, each run's own):
    each state's own ρ labels its document's rows, and their common ρ the compositions' (none if they
    differ: the rows' key is then the bare name and the table shows –)."""
    lengths = [p.layout.n for p in parts]
    fitted: dict[tuple[int, int], State] = {}

    def states_for(pos: str) -> list[State]:
        gaps = part_gaps(lengths, pos) if s.name.endswith(GAPS) else (0,) * len(parts)
        for i, (part, gap) in enumerate(zip(parts, gaps)):
            if (i, gap) not in fitted:
                st = fitted[i, gap] = fit_part(part, s, rho, base, cache_dir, gap)
                budget = rho if rho is not None else st.rho
                log(f"compose: {s.name} @ {'–' if budget is None else f'{budget:g}'} on {part.label}"
                    + (f" (gap {gap})" if gap else "") + f": {st.nbytes / 1e6:.3f} MB in {st.seconds:.0f} s")
        return [fitted[i, gap] for i, gap in enumerate(gaps)]

    out = []
    for pos in positions:
        states = states_for(pos)
        total, secs = sum(st.nbytes for st in states), sum(st.seconds for st in states)
        budget = rho if rho is not None else common_rho(states)
        for once in ([False, True] if prefix is not None else [False]):
            provider, _ = compose([st.provider for st in states], lengths, pos, base.model, at=n,
                                  prefix=prefix if once else None)
            layout = f"{pos}+once" if once else pos
            out.append(Entry(at_rho(f"compose[{layout}]:{s.name}", budget), s.kind, budget, provider, total,
                             secs, f"{len(parts)} states composed, positions {pos}"
                             + (", template prefix held once (its exact KV from the model, not stored)" if once else ""),
                             states[0].arch, s.name, layout))
    for i, (part, st) in enumerate(zip(parts, states_for("concat"))):
        only = [st.provider if j == i else None for j in range(len(parts))]
        provider, _ = compose(only, lengths, "concat", base.model, at=n)
        budget = rho if rho is not None else st.rho
        out.append(Entry(at_rho(f"alone:{part.label}:{s.name}", budget), s.kind, budget, provider, st.nbytes,
                         st.seconds, f"{part.label}'s state alone, at its concat offset", st.arch, s.name, "alone"))
    return out


def kvpress_entries(jobs: list[tuple[System, float]], base, ctx: RunContext, context_ids, doc_kv: DocKV,
                    sel: Selection, workdir: str, sums: dict, notes: dict) -> list[Entry]:
    """The presses on the concatenated context (kvpress's venv); rows that cannot run are reported."""
    if not jobs:
        return []
    press_jobs = [PressJob(f"{s.name}@{rho:g}", s.press, rho, s.bits) for s, rho in jobs]
    ids = [p.pair_id for p in sel.pairs]
    cached = {j.key: r for j in press_jobs if (r := _load_press(workdir, j.key, ids, context_ids)) is not None}
    todo = [j for j in press_jobs if j.key not in cached]
    result = BridgeResult(dict(cached))
    if todo:
        try:
            result = score_presses(base, ctx.config.model, list(context_ids), doc_kv, sel.pairs, todo, workdir)
        except (KvpressEnvError, KvpressError) as exc:
            print(f"kvpress rows left out: {exc}")
            notes["kvpress"] = {"error": str(exc)}
            return []
        for key, r in result.results.items():
            _save_press(workdir, key, ids, context_ids, r)
        result.results.update(cached)
    notes["kvpress"] = {**result.facts, "guard_max_token_kl": result.guard_max_kl, "errors": result.errors,
                        "reused": sorted(cached)}
    out = []
    for (s, rho), job in zip(jobs, press_jobs):
        r = result.results.get(job.key)
        if r is None:
            print(f"kvpress row {job.key} left out: {result.errors.get(job.key, 'no result')}")
            continue
        sums[job.key] = r.sums
        out.append(Entry(job.key, "kvpress", rho, None, r.state_bytes, r.press_s,
                         f"kvpress {s.press} on the concatenation, {r.kept_entries} entries", s.press))
    return out


def _press_path(workdir: str, key: str) -> str:
    return f"{workdir}/{re.sub(r'[^A-Za-z0-9_.@-]', '_', key)}.result.json"


def _load_press(workdir: str, key: str, pair_ids: list[str], context_ids) -> PressResult | None:
    """A press's per-pair sums from an earlier compare into the same folder, if made on these pairs
    and this context (a press takes minutes; scoring the compositions again should not redo it)."""
    import os

    path = _press_path(workdir, key)
    if not os.path.exists(path):
        return None
    saved = json.loads(open(path).read())
    if saved["pair_ids"] != pair_ids or saved["context_ids"] != list(context_ids):
        return None
    sums = PairSums(*(np.asarray(saved["sums"][k]) for k in ("correct", "nll", "kl", "n")))
    return PressResult(sums, saved["press_s"], saved["score_s"], saved["kept_entries"], saved["state_bytes"])


def _save_press(workdir: str, key: str, pair_ids: list[str], context_ids, r: PressResult) -> None:
    blob = {"pair_ids": pair_ids, "context_ids": list(context_ids), "press_s": r.press_s, "score_s": r.score_s,
            "kept_entries": r.kept_entries, "state_bytes": r.state_bytes,
            "sums": {k: getattr(r.sums, k).tolist() for k in ("correct", "nll", "kl", "n")}}
    atomic_write(_press_path(workdir, key), json.dumps(blob))


def with_gaps(names: list[str]) -> list[System]:
    """The systems asked for (``resolve``), each ``<recon_fit system>+gaps`` right after the system it
    refits at the composition's gaps; a ``+gaps`` of any other system is refused in one line."""
    gapped = {renamed("system", n.removesuffix(GAPS)) for n in names if n.endswith(GAPS)}
    plain = {renamed("system", n) for n in names if not n.endswith(GAPS)}
    resolved = resolve(list(dict.fromkeys(n.removesuffix(GAPS) for n in names if n != "module")))
    chosen = []
    for s in resolved:
        if s.kind == "kvpress" or s.name in plain:
            chosen.append(s)
        if s.name in gapped:
            if s.kind != "method" or s.method != "recon_fit" or not s.options.get("fit", True):
                raise ConfigError(f"system {s.name}{GAPS}: only a fitted recon_fit system (recon_fit@int4, …) "
                                  "refits its β and values at a composition's gaps; drop the suffix")
            chosen.append(dataclasses.replace(s, name=s.name + GAPS, default=False,
                                              description=s.description + ", fitted also at the gap its place "
                                              "in the composition puts after each document"))
    return chosen


def plan_systems(systems: list[str] | None, positions: list[str] | None) -> tuple[list[System], list[str]]:
    names = systems or ["none", "full", "recon_fit@int4"]
    own = [n for n in names if n == "module"]
    try:
        chosen = with_gaps(names)
    except ConfigError as exc:
        raise CompareInputError(str(exc)) from None
    if own:
        chosen.append(System("module", "trained", "each run's trained module", regime="recon_fit"))
    for s in chosen:
        if s.kind == "served":
            raise CompareInputError(f"system {s.name}: a composition is not served by vLLM; compare each run "
                                    f"alone (`nectar compare RUN --systems {s.name}`)")
        if s.kind == "trained" and s.name != "module":
            raise CompareInputError(f"system {s.name}: composing trains nothing; compose each run's own module "
                                    "(`module`), a baseline (recon_fit@int4) or a kvpress press")
    positions = positions or list(POSITIONS)
    for p in positions:
        if p not in POSITIONS:
            raise CompareInputError(f"--positions {p!r} is not one of {list(POSITIONS)}")
    return chosen, positions


def compare_composed(run_dirs: list[str], out_dir: str, systems: list[str] | None = None,
                     rhos: list[float] | None = None, positions: list[str] | None = None,
                     per_doc: int = 40, both: int = 20, log: Callable[[str], None] = print,
                     prefix_once: bool = True) -> dict[str, Any]:
    """Open, probe, fit, compose, score and write (module docstring); returns the outputs' facts."""
    chosen, positions = plan_systems(systems, positions)
    ctxs = open_runs(run_dirs)
    rhos = list(dict.fromkeys(rhos or [ctxs[0].config.train.module.rho]))
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    base = load_base(ctxs[0].config)
    names = labels(ctxs)
    parts = []
    for c, label in zip(ctxs, names):
        layout = build_layout(base.tokenizer, c.text)
        parts.append(Part(c, label, layout, prefill_document(base, layout.context_ids)))
    concat_text = SEPARATOR.join(c.text for c in ctxs)
    layout = build_layout(base.tokenizer, concat_text)
    t1 = time.perf_counter()
    full_kv = prefill_document(base, layout.context_ids)
    prefill_s = time.perf_counter() - t1
    timings["load_and_prefill_s"] = time.perf_counter() - t0
    cfg = ctxs[0].config.evaluate
    sel = selection(composed_prompts(list(zip(names, (c.text for c in ctxs))), ctxs[0], per_doc, both, cfg.seed),
                    layout)
    log(f"compose: {len(parts)} documents ({', '.join(f'{p.label} n={p.layout.n}' for p in parts)}), concatenated "
        f"n={layout.n}; {len(sel.pairs)} prompts ({', '.join(f'{k} {len(v)}' for k, v in sel.per_split.items())})")
    entries = [Entry("none", "reference", None, None, 0, 0.0, "no document"),
               Entry("full", "reference", None, ExactDocState(full_kv), full_kv.nbytes(), prefill_s,
                     "the concatenated documents' KV cache")]
    t0 = time.perf_counter()
    common = shared_prefix([p.layout.context_ids for p in parts])
    prefix = ExactDocState(prefill_document(base, common)) if prefix_once and common else None
    for s in chosen:
        if s.kind in ("method", "trained"):
            for rho in (rhos if s.kind == "method" else [None]):
                entries += composed_entries(parts, s, rho, positions, base, layout.n, log,
                                            f"{out_dir.rstrip('/')}/states", prefix)
    timings["fit_s"] = time.perf_counter() - t0
    sums_extra: dict = {}
    notes: dict[str, Any] = {"positions": positions}
    t0 = time.perf_counter()
    presses = [(s, rho) for s in chosen if s.kind == "kvpress" for rho in rhos]
    entries += kvpress_entries(presses, base, ctxs[0], layout.context_ids, full_kv, sel,
                               f"{out_dir.rstrip('/')}/kvpress", sums_extra, notes)
    if presses:
        timings["kvpress_s"] = time.perf_counter() - t0
    providers = {e.key: e.provider for e in entries if e.kind != "kvpress"}
    sums, quality = score_providers(base, layout.n, providers, sel, cfg, SCORE_BATCH, 8, None, timings, sums_extra)
    notes["differences"] = to_best_press([(e.key, e.rho, e.kind == "kvpress") for e in entries], sums, sel,
                                        quality, cfg) + to_plain(entries, sums, sel, quality, cfg)
    facts = {"runs": [c.run.root for c in ctxs], "documents": [c.info.source_uri for c in ctxs],
             "model": base.name, "n": layout.n, "n_parts": [p.layout.n for p in parts], "n_shared_prefix": len(common),
             "kv_bytes": full_kv.nbytes(), "kv_bytes_parts": [p.doc_kv.nbytes() for p in parts],
             "kv_dtype": str(full_kv.keys[0].dtype).removeprefix("torch."), "created_at": now()}
    return write(out_dir, entries, quality, facts, timings, notes)


def to_plain(entries: list[Entry], sums: dict, sel: Selection, quality, cfg) -> list[dict[str, Any]]:
    """Each ``+gaps`` entry against the same layout of the system it refits, when both were scored:
    what fitting at the composition's gaps adds, paired on the same prompts."""
    keys = {e.key for e in entries}
    pairs = [(e.key, plain) for e in entries if GAPS + "@" in e.key
             and (plain := e.key.replace(GAPS + "@", "@")) in keys]
    return [d for split, idx in sel.split_index().items() if len(idx) and split in quality
            for d in paired(sums, idx, split, pairs, cfg)]


def rows(entries: list[Entry], quality) -> list[ComparisonRow]:
    out = []
    for split, by_key in quality.items():
        for e in entries:
            cols = by_key[e.key].columns()
            out.append(ComparisonRow(system=e.key.rsplit("@", 1)[0] if e.rho is not None else e.key, kind=e.kind,
                                     arch=e.arch, rho=e.rho, state_bytes=e.nbytes, split=split,
                                     train_seconds=e.seconds, state_seconds=e.seconds, source=e.source,
                                     **ComparisonRow.quality(cols)))
    return out


def write(out_dir: str, entries: list[Entry], quality, facts: dict[str, Any], timings: dict[str, float],
          notes: dict[str, Any]) -> dict[str, Any]:
    out = RunDir(out_dir)
    out.makedirs()
    table = rows(entries, quality)
    data = [r.model_dump(exclude={"schema_version"}) for r in table]
    md = comparison_markdown(data, {k: v for k, v in facts.items() if k not in ("runs", "kv_bytes_parts")})
    md = md.replace("# Equal-bytes comparison", "# Several documents at once: composed states at equal bytes", 1)
    md += differences_markdown(notes.get("differences", []))
    timings["total_s"] = sum(v for k, v in timings.items() if k != "total_s")
    info = write_comparison(out.root, table, md, {**facts, "systems": [e.key for e in entries]}, timings, notes)
    return {"out": out.root, "markdown": md, "rows": table, "info": info}
