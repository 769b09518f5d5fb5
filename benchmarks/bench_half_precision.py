"""Half-precision target storage: does storing q and A in float16 or bfloat16 change the trained
module's fidelity? (issue 14)

One capture of float32 targets by the real targets stage (embedded SmolLM2-135M, real weights, on
``--document``) with ``--pairs`` synthetic pairs (bench_targets' document-sentence pairs; KL to the
full-context model needs no good pairs, only query tokens). The float16 and bfloat16 stores are that
store's q and A rounded exactly as the stage writes them (``encode_values``; α stays float32), so the
three trainings differ in storage alone. The same module (same settings, same
seed, ``--samples`` query tokens; the cpu preset's default module unless ``--regime``) is trained on each, then every held-out pair is scored teacher-forced
by all three modules, the full-context model and the no-document model.

Printed: KL(full ‖ module) per response token for each storage, and the paired difference to float32
with a 95 % bootstrap interval over held-out pairs (tokens of a pair are correlated, so pairs are
resampled); the no-document KL for scale; the storage's rounding error on q and A.

    python benchmarks/bench_half_precision.py                    # ~20 min on 2 cores (the cpu default module)
    python benchmarks/bench_half_precision.py --regime regression  # the MLP trained by regression
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_scale import convert_store  # noqa: E402
from bench_targets import synthetic_pairs  # noqa: E402

from nectar.attention.doc_kv import prefill_document  # noqa: E402
from nectar.attention.exact import ExactDocState  # noqa: E402
from nectar.documents import load_document  # noqa: E402
from nectar.evaluation.teacher import EvalPair, teacher_forced_pair_sums  # noqa: E402
from nectar.layout import build_layout  # noqa: E402
from nectar.base_model import load_base_model  # noqa: E402
from nectar.modules.io import load_module  # noqa: E402
from nectar.modules.provider import ModuleDocState  # noqa: E402
from nectar.schemas.artifacts import TargetsPairRow  # noqa: E402
from nectar.schemas.config import ModelConfig  # noqa: E402
from nectar.schemas.presets import load_config  # noqa: E402
from nectar.stages.targets import build_targets  # noqa: E402
from nectar.stages.train import train  # noqa: E402
from nectar.tables import read_table  # noqa: E402
from nectar.targets.store import decode_values, open_targets  # noqa: E402

DTYPES = ("float32", "float16", "bfloat16")


def held_out_pairs(targets: Path) -> list[EvalPair]:
    g, _ = open_targets(str(targets / "targets.zarr"))
    ids = g["token_ids"][:]
    rows = [r for r in read_table(str(targets / "pairs.parquet"), TargetsPairRow) if r.split == "test"]
    return [EvalPair(r.pair_id, r.task, (r.pair_id,), tuple(int(t) for t in ids[r.start:r.start + r.length]),
                     r.response_start, r.start) for r in rows if r.response_start < r.length]


def rounding_error(stores: dict[str, Path]) -> dict[str, dict[str, float]]:
    ref, _ = open_targets(str(stores["float32"]))
    out = {}
    for dtype in DTYPES[1:]:
        g, _ = open_targets(str(stores[dtype]))
        out[dtype] = {}
        for name in ("q", "A"):
            a = ref[name][:]
            b = decode_values(g[name][:], g[name].attrs.get("nectar_view"))
            out[dtype][name] = float(np.linalg.norm(a - b) / np.linalg.norm(a))  # relative Frobenius error
    return out


def bootstrap_diff(kl_a: np.ndarray, kl_b: np.ndarray, n: np.ndarray, reps: int, seed: int = 0):
    """Token-weighted mean KL of b minus a, and its 95 % percentile interval over resampled pairs."""
    rng = np.random.default_rng(seed)
    stat = (kl_b.sum() - kl_a.sum()) / n.sum()
    idx = rng.integers(0, len(n), size=(reps, len(n)))
    boots = (kl_b[idx].sum(1) - kl_a[idx].sum(1)) / n[idx].sum(1)
    return float(stat), float(np.percentile(boots, 2.5)), float(np.percentile(boots, 97.5))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--document", default="pydoc:naming")
    ap.add_argument("--pairs", type=int, default=200, help="synthetic pairs (every 5th held out)")
    ap.add_argument("--samples", type=int, default=30_000, help="training budget in query tokens (cpu preset: 60k)")
    ap.add_argument("--regime", default=None, help="a training regime (e.g. regression: the MLP); default: the cpu "
                    "preset's own module (matching: quadrature, Attention Matching init, refined by regression)")
    ap.add_argument("--bootstrap", type=int, default=4000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    import os

    load0 = os.getloadavg()
    base = load_base_model(ModelConfig(name="embedded:smollm2-135m", device="cpu"))
    text, source = load_document(args.document)
    layout = build_layout(base.tokenizer, text)
    kv = prefill_document(base, layout.context_ids)
    rows = synthetic_pairs(text, args.pairs, seed=0)
    cpu = load_config("cpu", regime=args.regime)
    with tempfile.TemporaryDirectory(prefix="bench-half-") as tmp:
        work = Path(tmp)
        counts = build_targets(base, layout, kv, rows, cpu.targets, str(work / "float32"), source.sha256)
        stores = {"float32": work / "float32" / "targets.zarr"}
        for dtype in DTYPES[1:]:
            (work / dtype).mkdir()
            convert_store(stores["float32"], work / dtype / "targets.zarr", dtype)
            stores[dtype] = work / dtype / "targets.zarr"
            (work / dtype / "pairs.parquet").write_bytes((work / "float32" / "pairs.parquet").read_bytes())
        err = rounding_error(stores)
        cfg = cpu.train.model_copy(update={"samples": args.samples, "eval_every": 10**9, "checkpoint_every": 10**9})
        modules, seconds = {}, {}
        for dtype in DTYPES:
            t0 = time.perf_counter()
            train(str(work / dtype), cfg, base, kv, str(work / f"train-{dtype}"))  # kv: quadrature init
            seconds[dtype] = time.perf_counter() - t0
            modules[dtype] = load_module(str(work / f"train-{dtype}"), base)[0]
            print(f"[bench_half_precision] trained on {dtype} targets in {seconds[dtype]:.0f} s", file=sys.stderr)
        pairs = held_out_pairs(work / "float32")
        providers = {d: ModuleDocState(m) for d, m in modules.items()}
        providers.update(full=ExactDocState(kv), none=None)
        sums = teacher_forced_pair_sums(base, providers, pairs, layout.n, batch_size=4)  # {model: PairSums}
    kl = {name: sums[name].kl for name in (*DTYPES, "none")}  # [P] per-pair sums, in the order of pairs
    n = sums["full"].n
    print(f"\nbench_half_precision: embedded:smollm2-135m, {args.document} (n = {layout.n}), {counts['pairs']} synthetic "
          f"pairs ({counts['tokens']} query tokens), {args.regime or 'cpu-default'} module ({cfg.module.arch}, "
          f"init {cfg.module.init}) rho={cfg.module.rho} trained on {args.samples} "
          f"query tokens (batch {cfg.batch_size}, seed {cfg.seed}) per storage; held out: {len(pairs)} pairs, "
          f"{int(n.sum())} response tokens; load average before {load0[0]:.1f}")
    print(f"{'storage':<10}{'rel. error q':>13}{'rel. error A':>13}{'KL/token':>10}{'minus float32 [95% CI over pairs]':>40}"
          f"{'train s':>9}")
    result = {"pairs": len(pairs), "tokens": int(n.sum()), "kl": {}, "diff": {}, "rounding": err}
    for dtype in DTYPES:
        mean = kl[dtype].sum() / n.sum()
        result["kl"][dtype] = float(mean)
        if dtype == "float32":
            diff_s, e = "(reference)", {"q": 0.0, "A": 0.0}
        else:
            d, lo, hi = bootstrap_diff(kl["float32"], kl[dtype], n, args.bootstrap)
            result["diff"][dtype] = [d, lo, hi]
            diff_s, e = f"{d:+.5f} [{lo:+.5f}, {hi:+.5f}] ({d / kl['float32'].sum() * n.sum():+.1%})", err[dtype]
        print(f"{dtype:<10}{e['q']:>13.2e}{e['A']:>13.2e}{mean:>10.4f}{diff_s:>40}{seconds[dtype]:>9.0f}")
    print(f"no document: KL/token {kl['none'].sum() / n.sum():.4f} (the scale of the document's effect)")
    load1 = os.getloadavg()
    print(f"wall {time.perf_counter() - t_start:.0f} s; load average before {load0[0]:.1f}, after {load1[0]:.1f}")
    result["kl"]["none"] = float(kl["none"].sum() / n.sum())
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
