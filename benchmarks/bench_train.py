"""Training benchmark on the embedded default (SmolLM2-135M-Instruct, CPU).

    python benchmarks/bench_train.py                 # throughput per regime + module vs KV bytes
    python benchmarks/bench_train.py --recovery      # + train MLP and cartridges, token accuracy

Data: the default document (``pydoc:naming``, ~1.4k tokens) and document-grounded pairs built
from it — "which sentence comes right after <sentence>? Quote it." → the next sentence — put
through the real targets stage (exact capture, teacher top-K). No LLM synthesis: the benchmark
measures training, not pair quality.

Figures printed:
  * samples/s and query tokens/s per regime (regression samples are tokens, the others pairs),
    and each regime's tokens/s relative to pure regression (the named baseline);
  * module bytes and parameters vs the KV-cache bytes they replace, MLP and quadrature;
  * --recovery: held-out token accuracy of module / full context / no document and the fraction
    of the document's benefit recovered, (acc_module − acc_none) / (acc_full − acc_none).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nectar.attention.doc_kv import prefill_document  # noqa: E402
from nectar.attention.exact import ExactDocState  # noqa: E402
from nectar.attention.forward import query_logits  # noqa: E402
from nectar.documents import load_document  # noqa: E402
from nectar.layout import build_layout  # noqa: E402
from nectar.base_model import load_base_model  # noqa: E402
from nectar.modules.io import load_module  # noqa: E402
from nectar.modules.provider import ModuleDocState  # noqa: E402
from nectar.schemas.artifacts import DatasetRow, TrainLogRow  # noqa: E402
from nectar.schemas.config import ModelConfig  # noqa: E402
from nectar.schemas.presets import load_config  # noqa: E402
from nectar.stages.targets import build_targets  # noqa: E402
from nectar.stages.train import train  # noqa: E402
from nectar.tables import read_table  # noqa: E402
from nectar.targets.reader import TargetsData  # noqa: E402
from nectar.training.loop import micro_batches  # noqa: E402

REGIMES = ("regression", "mixed", "distill", "cartridges")


def sentence_pairs(text: str, test_every: int = 5) -> list[DatasetRow]:
    """Consecutive-sentence quoting pairs (every ``test_every``-th one held out)."""
    flat = re.sub(r"\s+", " ", text)
    sents = [s.strip() for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", flat)]
    sents = [s for s in sents if 5 <= len(s.split()) <= 45]
    rows = []
    for i, (a, b) in enumerate(zip(sents, sents[1:])):
        rows.append(DatasetRow(
            pair_id=f"s{i:03d}", chunk_id=0, task="quoting",
            instruction=f'Which sentence of the document comes right after "{a}"? Quote it.',
            response=b, full_answer=b, judge_raw="", is_consistent=True, confidence=1.0, reasoning="",
            verdict="consistent", kept=True, split="test" if i % test_every == test_every - 1 else "train"))
    return rows


def prepare(model: str, document: str, work: Path):
    base = load_base_model(ModelConfig(name=model))
    text, source = load_document(document)
    layout = build_layout(base.tokenizer, text)
    kv = prefill_document(base, layout.context_ids)
    rows = sentence_pairs(text)
    tcfg = load_config("cpu").targets
    t0 = time.perf_counter()
    counts = build_targets(base, layout, kv, rows, tcfg, str(work / "targets"), source.sha256)
    dt = time.perf_counter() - t0
    print(f"document {document}: n = {layout.n} tokens; pairs {counts['pairs']} "
          f"({counts.get('pairs_train', 0)} train / {counts.get('pairs_test', 0)} test), "
          f"{counts['tokens']} query tokens; targets captured in {dt:.1f}s")
    return base, layout, kv, str(work / "targets")


def regime_config(regime: str, steps: int, batch_tokens: int, batch_pairs: int, rho: float, lr: float | None):
    cfg = load_config("cpu", regime=regime).train
    b = batch_tokens if cfg.lambda_kl == 0 else batch_pairs
    update = {"batch_size": b, "samples": steps * b, "eval_every": 10 ** 9, "checkpoint_every": 10 ** 9,
              "module": cfg.module.model_copy(update={"rho": rho})}
    if lr is not None:
        update["peak_lr"] = lr
    return cfg.model_copy(update=update)


def throughput(base, kv, targets: str, work: Path, steps: int, batch_tokens: int, batch_pairs: int,
               rho: float) -> dict:
    data = TargetsData(f"{targets}/targets.zarr")
    mean_pair = data.header.n_tokens / data.header.n_pairs
    out = {}
    for regime in REGIMES:
        cfg = regime_config(regime, steps, batch_tokens, batch_pairs, rho, None)
        stamps: list[float] = []
        train(targets, cfg, base, kv, str(work / f"tp-{regime}"), progress=lambda d, t: stamps.append(time.perf_counter()))
        # steps 2 … N-1 only: step 1 warms up, step N includes the final held-out evaluation
        timed = len(stamps) - 2
        dt = stamps[-2] - stamps[0]
        sps = timed * cfg.batch_size / dt
        tok_s = sps if cfg.lambda_kl == 0 else sps * mean_pair
        spec = json.loads((work / f"tp-{regime}" / "module.json").read_text())
        out[regime] = {"batch": cfg.batch_size, "unit": "tokens" if cfg.lambda_kl == 0 else "pairs",
                       "samples_s": sps, "tokens_s": tok_s, "s_per_step": dt / timed, "arch": spec["arch"],
                       "n_params": spec["n_params"], "module_bytes": spec["module_bytes"],
                       "kv_cache_bytes": spec["kv_cache_bytes"]}
    return out


def _every(k: int, name: str):
    t0 = time.perf_counter()
    return lambda done, total: done % k == 0 and print(
        f"  {name}: step {done}/{total} ({time.perf_counter() - t0:.0f}s)", flush=True)


@torch.no_grad()
def token_accuracy(base, provider, data: TargetsData, n: int) -> float:
    correct = total = 0
    for mb in micro_batches(data, data.pairs("test"), 2048):
        b = data.pair_batch(mb, base.tokenizer.pad_token_id or 0)
        logits = query_logits(base, provider, b.input_ids, n, b.attention_mask)
        correct += int(((logits.argmax(-1) == b.next_ids) & b.kl_mask).sum())
        total += int(b.kl_mask.sum())
    return correct / max(total, 1)


def recovery(base, kv, targets: str, work: Path, args) -> dict:
    data = TargetsData(f"{targets}/targets.zarr")
    n = data.header.n_context
    acc_full = token_accuracy(base, ExactDocState(kv), data, n)
    acc_none = token_accuracy(base, None, data, n)
    print(f"\nheld-out token accuracy: full context {acc_full:.3f}, no document {acc_none:.3f}")
    out = {"acc_full": acc_full, "acc_none": acc_none}
    runs = [("mlp-regression", "regression", args.recovery_steps_tokens, args.recovery_lr),
            ("cartridges", "cartridges", args.recovery_steps_pairs, args.recovery_lr_quad),
            ("mlp-mixed", "mixed", args.recovery_steps_pairs, args.recovery_lr)]
    for name, regime, steps, lr in runs:
        cfg = regime_config(regime, steps, args.batch_tokens, args.batch_pairs, args.rho, lr)
        cfg = cfg.model_copy(update={"eval_every": max(1, steps // 4)})
        t0 = time.perf_counter()
        train(targets, cfg, base, kv, str(work / name), progress=_every(max(1, steps // 10), name))
        dt = time.perf_counter() - t0
        module, spec = load_module(str(work / name), base)
        acc = token_accuracy(base, ModuleDocState(module), data, n)
        frac = (acc - acc_none) / (acc_full - acc_none) if acc_full != acc_none else float("nan")
        held = [r for r in read_table(str(work / name / "train_log.parquet"), TrainLogRow) if r.split == "heldout"]
        out[name] = {"acc": acc, "recovered": frac, "steps": steps, "seconds": dt, "n_params": spec.n_params,
                     "heldout_A_first": held[0].loss_A, "heldout_A_last": held[-1].loss_A,
                     "heldout_kl_first": held[0].loss_kl, "heldout_kl_last": held[-1].loss_kl,
                     "heldout_rte_A_first": held[0].rte_A, "heldout_rte_A_last": held[-1].rte_A}
        print(f"{name:15s} ({spec.arch}, {spec.n_params} params, {steps} steps, {dt:.0f}s): "
              f"acc {acc:.3f}, recovered {frac:+.1%} of the document's benefit; held-out target loss "
              f"{held[0].loss_A:.1f} → {held[-1].loss_A:.1f}, KL {held[0].loss_kl:.3f} → {held[-1].loss_kl:.3f}, "
              f"RTE_A {held[0].rte_A:.2f} → {held[-1].rte_A:.2f}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded:smollm2-135m")
    ap.add_argument("--document", default="pydoc:naming")
    ap.add_argument("--rho", type=float, default=0.05, help="the cpu preset's rho")
    ap.add_argument("--steps", type=int, default=6, help="steps per regime for throughput")
    ap.add_argument("--batch-tokens", type=int, default=64, help="regression batch (tokens; cpu preset)")
    ap.add_argument("--batch-pairs", type=int, default=8, help="batch for regimes with distillation (pairs)")
    ap.add_argument("--recovery", action="store_true", help="also train and measure token accuracy")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--recovery-steps-tokens", type=int, default=400)
    ap.add_argument("--recovery-steps-pairs", type=int, default=60)
    ap.add_argument("--recovery-lr", type=float, default=1e-3)
    ap.add_argument("--recovery-lr-quad", type=float, default=1e-2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        work = Path(tmp)
        base, layout, kv, targets = prepare(args.model, args.document, work)
        result = {"model": args.model, "document": args.document, "n": layout.n}
        if not args.skip_throughput:
            result["throughput"] = report_throughput(base, kv, targets, work, args)
        if args.recovery:
            result["recovery"] = recovery(base, kv, targets, work, args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


def report_throughput(base, kv, targets: str, work: Path, args) -> dict:
    tp = throughput(base, kv, targets, work, args.steps, args.batch_tokens, args.batch_pairs, args.rho)
    ref = tp["regression"]["tokens_s"]
    print(f"\ntraining throughput ({args.threads} threads, ρ = {args.rho}):")
    for regime, r in tp.items():
        print(f"  {regime:11s} {r['arch']:10s} batch {r['batch']:3d} {r['unit']:6s}: "
              f"{r['samples_s']:8.3g} samples/s  {r['tokens_s']:8.3g} query tokens/s  "
              f"({r['s_per_step']:.2f} s/step; ×{r['tokens_s'] / ref:.3f} the tokens/s of pure regression)")
    print("\nmodule vs the document KV cache it replaces (float32 both):")
    for regime in ("regression", "cartridges"):
        r = tp[regime]
        print(f"  {r['arch']:10s} {r['n_params']:9d} params  {r['module_bytes'] / 2**20:7.2f} MiB  vs KV "
              f"{r['kv_cache_bytes'] / 2**20:7.2f} MiB  (KV / module = {r['kv_cache_bytes'] / r['module_bytes']:.1f}×)")
    return tp


if __name__ == "__main__":
    main()
