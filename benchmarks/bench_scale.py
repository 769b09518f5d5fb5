"""Scale benchmark (issue 14): a long document and many pairs, on SmolLM2-135M's architecture.

What it measures, each step in its own child process (so peak RSS belongs to that step alone):

1. ``capture``  the targets stage end to end on a document of ``--doc-tokens`` tokens (CPython's
                language reference, concatenated) with ``--capture-pairs`` synthetic pairs: the one
                prefill, then packed query-only capture + Zarr writes (float32); with
                ``--online-stage`` also the stage with ``targets.mode=online`` (teacher top-K only).
                Query tokens/s; the document KV is saved for the training runs.
2. storage      bytes per query token on disk for float32, float16, bfloat16 (the float32 store
                converted, no new capture) and online (its token arrays), against the estimate.
3. ``train``    stores of ``--pairs`` pairs (default 200; ``--pairs 2000`` for the full CPU size) are
                the captured pairs' rows tiled (real rows, repeated as more pairs: loader memory and
                step speed depend on sizes and shapes, not on the values). Regression steps (token
                batches, b = 64) streamed from stores of ``--rss-pairs`` pairs: peak RSS against the
                store size, and the previous loader's way (every q/α/A read into RAM first) on the
                smallest; then cached vs online targets steps/s for token batches and for pair batches
                (λKL = 2, b = 4, through the base model).
4. extrapolation to the paper's largest setting (IP Intro: n = 122,466 tokens, 228,193 samples) on
   Qwen3-1.7B's shapes: bytes from the storage formula (the measured bytes/token match it), compute
   as FLOPs scaled by the rate measured in step 1 — what one GPU can and cannot hold.

    python benchmarks/bench_scale.py          # a few minutes on 2 cores: n = 4k, 16 captured pairs, stores up to 200 pairs
    python benchmarks/bench_scale.py --doc-tokens 16384 --capture-pairs 64 --pairs 2000 --online-stage
                                              # the issue's CPU size: n >= 16k, >= 2,000 pairs (28 GB float32 store, ~45 min)
    python benchmarks/bench_scale.py --model embedded:smollm2-135m   # the real weights (same speed)
    python benchmarks/bench_scale.py --model random:qwen3-1.7b --device cuda --dtype bfloat16 \
        --doc-tokens 32768 --capture-pairs 32 --online-stage --online-pairs 10000 --pairs 128 \
        --top-k 64 --batch-size 32 --batch-tokens 4096
                                              # a GPU: Qwen3-1.7B shapes, n = 32k, 10k pairs through the
                                              # online stage (cached q/α/A of 10k pairs would be ~0.5 TB)

``--model random:smollm2`` (default) is SmolLM2-135M's architecture with random weights (needs only
its tokenizer and config.json); speed and bytes depend on the shapes alone. Training runs compute the
normalisation statistics from 1,024 tokens (setup, not timed) to keep online runs bounded.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

# The paper's largest setting (Table 1, IP Intro) and the model whose shapes it is extrapolated to.
PAPER_N, PAPER_SAMPLES, PAPER_PAIR_TOKENS = 122_466, 228_193, 150  # 150 query tokens/pair: issue 14's figure
QWEN3_1_7B = dict(layers=28, q_heads=16, kv_heads=8, head_dim=128, params=1.7e9, nonembed=1.4e9, top_k=64)
H100_BF16_PEAK = 989e12  # dense FLOP/s (spec sheet): a bound, never reached
H100_HBM_BYTES = 80e9


# ----------------------------------------------------------------------------- helpers


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def human(n: float) -> str:
    from nectar.targets.size import human_bytes

    return human_bytes(n)


def load_model(args):
    import math

    import torch

    from bench_generation import random_model

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    window = args.doc_tokens + 1024
    if args.model == "random:qwen3-1.7b" and window > 32_768:  # YaRN x2 / x4 past 32k, as the paper preset
        rope = {"rope_type": "yarn", "factor": float(2 ** math.ceil(math.log2(window / 32_768))),
                "original_max_position_embeddings": 32_768}  # Qwen3's pretrained window, as the paper preset
        return random_model(args.model, args.dtype, args.device, window, rope=rope)
    if args.model.startswith("random:"):  # random weights with the real architecture (only its config travels)
        return random_model(args.model, args.dtype, args.device, window)
    from nectar.base_model import load_base_model
    from nectar.schemas import ModelConfig

    return load_base_model(ModelConfig(name=args.model, device=args.device, dtype=args.dtype))


def nonembed_params(base) -> int:
    """Parameters the per-token matmuls touch, the LM head included (embedding lookups excluded)."""
    m = base.model
    emb = m.get_input_embeddings().weight
    total = sum(p.numel() for p in m.parameters())
    tied = m.get_output_embeddings().weight is emb
    return total - (0 if tied else emb.numel())


def gpu_peak(reset: bool = False) -> float | None:
    """Peak GPU memory allocated by this process (GB), or None on CPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 1e9
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return peak


def setup(args, base):
    from bench_targets import long_document, synthetic_pairs

    from nectar.layout import build_layout, check_fits

    text = long_document(base.tokenizer, args.doc_tokens)
    layout = build_layout(base.tokenizer, text)
    check_fits(layout, args.max_query_tokens, base.max_context_tokens)
    return text, layout, synthetic_pairs(text, args.capture_pairs, seed=0)


def targets_cfg(args, **kw):
    from nectar.schemas import TargetsConfig

    return TargetsConfig(top_k=args.top_k, max_query_tokens=args.max_query_tokens, max_bytes=10**15,
                         batch_size=args.batch_size, batch_tokens=args.batch_tokens, **kw)


# ----------------------------------------------------------------------------- children


def child_capture(args) -> dict:
    """Prefill once, then the targets stage (float32, then online) over the synthetic pairs."""
    from nectar.attention.doc_kv import prefill_document, save_doc_kv
    from nectar.stages import targets as stage

    base = load_model(args)
    text, layout, rows = setup(args, base)
    out: dict = {"n_context": layout.n, "rss_after_load_mb": rss_mb(), "gpu_weights_gb": gpu_peak(reset=True),
                 "nonembed_params": nonembed_params(base), "device": str(base.device), "dtype": str(base.dtype)}
    t0, c0 = time.perf_counter(), time.process_time()
    kv = prefill_document(base, layout.context_ids)
    out.update(prefill_s=time.perf_counter() - t0, prefill_cpu_s=time.process_time() - c0,
               gpu_prefill_peak_gb=gpu_peak(reset=True))
    save_doc_kv(kv, f"{args.workdir}/doc_kv.safetensors", {"n": layout.n})
    modes = [("cached", rows)]
    if args.online_stage:  # the online stage may run more pairs: it writes no q/α/A
        from bench_targets import synthetic_pairs

        modes.append(("online", synthetic_pairs(text, args.online_pairs, seed=1) if args.online_pairs else rows))
    for mode, mode_rows in modes:
        cfg = targets_cfg(args, mode=mode)
        planned = stage.plan_pairs(mode_rows, layout, cfg)
        size = stage.targets_size(planned, base, cfg)
        t0, c0 = time.perf_counter(), time.process_time()
        counts = stage.build_targets(base, layout, kv, mode_rows, cfg, f"{args.workdir}/{mode}", "bench",
                                     planned=planned)
        out[mode] = dict(seconds=time.perf_counter() - t0, cpu_s=time.process_time() - c0, tokens=counts["tokens"],
                         pairs=counts["pairs"], estimated_bytes=size.total, gpu_peak_gb=gpu_peak(reset=True),
                         bytes=dir_bytes(Path(args.workdir) / mode / "targets.zarr"))
        print(f"[bench_scale] {mode} stage: {json.dumps(out[mode])}", file=sys.stderr, flush=True)
    out["doc_kv_bytes"] = kv.nbytes()
    out["peak_rss_mb"] = peak_rss_mb()
    out["shapes"] = dict(layers=base.num_layers, q_heads=base.num_q_heads, kv_heads=base.num_kv_heads,
                         head_dim=base.head_dim)
    return out


def child_train(args) -> dict:
    """Regression or mixed steps from a store; time per step and peak RSS."""
    import torch

    from nectar.attention.doc_kv import DocKV
    from nectar.schemas.config import ModuleConfig, TrainConfig
    from nectar.stages import train as train_stage
    from nectar.targets import reader as data_mod
    from nectar.training import fit as fit_mod

    base = load_model(args)
    rss_load = rss_mb()
    gpu_peak(reset=True)
    kv = None
    if args.online or args.kl:
        from safetensors.torch import load_file

        t = load_file(f"{args.kv}")
        n_layers = len([k for k in t if k.startswith("k.")])
        kv = DocKV([t[f"k.{i}"] for i in range(n_layers)], [t[f"v.{i}"] for i in range(n_layers)])
    if args.loader == "inmemory":  # the previous loader: every q/α/A of the store read into RAM first
        real = data_mod.TargetsData

        class InMemory(real):
            def __init__(self, url, **kw):
                super().__init__(url, **kw)
                from nectar.targets.store import VALUE_ARRAYS, decode_values

                self._all = {k: decode_values(self.group[k][:], self.views[k]) for k in VALUE_ARRAYS}

            def rows(self, index):
                return data_mod.TokenBatch(*(torch.from_numpy(np.ascontiguousarray(self._all[k][index]))
                                             for k in ("q", "alpha", "A")))

        fit_mod.TargetsData = InMemory
    stats = fit_mod.target_statistics
    fit_mod.target_statistics = lambda data, hkv, seed=0: stats(data, hkv, max_tokens=1024, seed=seed)
    batch = 4 if args.kl else 64
    steps = max(3, args.steps)  # timed between the 1st and the last step (which also evaluates)
    cfg = TrainConfig(samples=steps * batch, batch_size=batch, lambda_kl=2.0 if args.kl else 0.0,
                      eval_every=10**6, checkpoint_every=10**6, module=ModuleConfig(rho=0.05), seed=0)
    stamps: list[tuple[int, float]] = []
    t0 = time.perf_counter()
    out = Path(args.result).with_suffix("")  # a folder per run: no run resumes another's checkpoint
    shutil.rmtree(out, ignore_errors=True)
    train_stage.train(args.store, cfg, base, kv, str(out),
                      progress=lambda done, total: stamps.append((done, time.perf_counter())))
    # steps 1 … total-1: the last step also runs the final held-out evaluation and checkpoint
    (s0, t_first), (s1, t_last) = stamps[0], stamps[-2]
    return dict(steps_per_s=(s1 - s0) / (t_last - t_first), batch=batch, wall_s=time.perf_counter() - t0,
                rss_after_load_mb=rss_load, peak_rss_mb=peak_rss_mb(), store_bytes=dir_bytes(Path(args.store)),
                gpu_peak_gb=gpu_peak())


# ----------------------------------------------------------------------------- parent-side store copies


def convert_store(src: Path, dst: Path, dtype: str, mode: str = "cached") -> None:
    """The float32 group rewritten as the stage writes it with q and A in ``dtype`` (or, online,
    without them)."""
    import torch

    from nectar.schemas.artifacts import TargetsHeader
    from nectar.targets.store import HEADER_KEY, create_targets, encode_values, open_targets

    g, header = open_targets(str(src))
    new = header.model_copy(update={"dtype": dtype, "mode": mode})
    h = create_targets(str(dst), new, g["token_ids"].chunks[0], g["token_ids"].shards[0])
    copy_rows(g, h, header.n_tokens, lambda name, a: encode_values(torch.from_numpy(a), dtype)
              if name in ("q", "A") else a)
    for name in ("pair_offsets", "pair_split"):
        h[name][:] = g[name][:]
    h.attrs[HEADER_KEY] = TargetsHeader.model_validate(g.attrs[HEADER_KEY]).model_copy(
        update={"dtype": dtype, "mode": mode}).model_dump(mode="json")


def copy_rows(g, h, n_tokens: int, transform, repeat: int = 1) -> None:
    shard = h["token_ids"].shards[0]
    names = [n for n in ("q", "A", "alpha", "topk_ids", "topk_logprobs", "token_ids", "positions", "response_mask")
             if n in g and n in h]
    for r in range(repeat):
        for start in range(0, n_tokens, shard):
            stop = min(n_tokens, start + shard)
            for name in names:
                h[name][r * n_tokens + start: r * n_tokens + stop] = transform(name, g[name][start:stop])


def tile_store(src: Path, dst: Path, times: int) -> None:
    """A store ``times`` as large: the same pairs' rows repeated (as many more pairs)."""
    from nectar.targets.store import HEADER_KEY, create_targets, open_targets

    g, header = open_targets(str(src))
    T, P = header.n_tokens, header.n_pairs
    new = header.model_copy(update={"n_tokens": T * times, "n_pairs": P * times, "complete": True,
                                    "split_pairs": {k: v * times for k, v in header.split_pairs.items()}})
    h = create_targets(str(dst), new, g["token_ids"].chunks[0], g["token_ids"].shards[0])
    copy_rows(g, h, T, lambda name, a: a, repeat=times)
    offsets = g["pair_offsets"][:]
    h["pair_offsets"][:] = np.concatenate([offsets[:-1] + r * T for r in range(times)] + [[T * times]])
    h["pair_split"][:] = np.tile(g["pair_split"][:P], times)
    h.attrs[HEADER_KEY] = new.model_dump(mode="json")


# ----------------------------------------------------------------------------- parent


def spawn(args, child: str, extra: list[str], label: str) -> dict:
    result = Path(args.workdir) / f"{label}.json"
    cmd = [sys.executable, __file__, "--child", child, "--workdir", args.workdir, "--result", str(result),
           "--model", args.model, "--doc-tokens", str(args.doc_tokens), "--capture-pairs", str(args.capture_pairs),
           "--top-k", str(args.top_k), "--max-query-tokens", str(args.max_query_tokens),
           "--device", args.device, "--dtype", args.dtype, "--online-pairs", str(args.online_pairs),
           "--batch-size", str(args.batch_size), "--batch-tokens", str(args.batch_tokens), *extra]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    print(f"[bench_scale] {label} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    out = json.loads(result.read_text())
    # each child's figures as soon as they exist: a run cut short (a device's time limit) keeps them
    print(f"[bench_scale] {label} done in {time.perf_counter() - t0:.0f} s: {json.dumps(out)}", file=sys.stderr, flush=True)
    return out


def extrapolate(cap: dict, tr: dict) -> list[str]:
    """The paper's largest setting on Qwen3-1.7B's shapes, from the storage formula and FLOP counts."""
    from nectar.targets.size import TargetsSize

    q = QWEN3_1_7B
    tokens = PAPER_SAMPLES * PAPER_PAIR_TOKENS
    lines = [f"paper setting: n = {PAPER_N:,} document tokens, {PAPER_SAMPLES:,} pairs x {PAPER_PAIR_TOKENS} "
             f"query tokens = {tokens / 1e6:.1f}M query tokens, Qwen3-1.7B shapes (L={q['layers']}, "
             f"Hq={q['q_heads']}, Hkv={q['kv_heads']}, d={q['head_dim']}), top-{q['top_k']}"]
    for dtype, mode in (("float32", "cached"), ("float16", "cached"), ("bfloat16", "cached"), ("float32", "online")):
        s = TargetsSize(n_pairs=PAPER_SAMPLES, n_tokens=tokens, num_layers=q["layers"], num_q_heads=q["q_heads"],
                        head_dim=q["head_dim"], top_k=q["top_k"], dtype=dtype, mode=mode, chunk_tokens=64,
                        shard_tokens=2048)
        lines.append(f"  targets {mode if mode == 'online' else dtype:>8}: {s.bytes_per_token():>7,} B/token "
                     f"-> {human(s.total)}")
    kv_bf16 = 2 * q["layers"] * q["kv_heads"] * q["head_dim"] * PAPER_N * 2
    flop_model = 2 * q["params"]  # per query token, matmuls of the frozen model (the tied LM head included)
    flop_doc = 4 * q["layers"] * q["q_heads"] * q["head_dim"] * PAPER_N  # q·K and p·V over the document
    capture = tokens * (flop_model + flop_doc)
    lines += [
        f"  document KV (bf16): {human(kv_bf16)}; weights (bf16): {human(2 * q['params'])}: both fit one "
        f"{H100_HBM_BYTES / 1e9:.0f} GB GPU, with room for packed capture batches",
        f"  capture compute: {(flop_model + flop_doc) / 1e9:.1f} GFLOP per query token ({flop_doc / 1e9:.1f} of "
        f"them attention over the document) = {capture:.2e} FLOP in all; at the H100's dense bf16 peak "
        f"({H100_BF16_PEAK / 1e12:.0f} TFLOP/s, never reached) that is >= {capture / H100_BF16_PEAK / 60:.0f} min "
        f"— a bound; the rate measured here follows",
        f"  online targets cost one such capture per epoch of pair training (a forward with the document "
        f"attention the module path skips) and, for token batches, each token's pair prefix "
        f"(x{tr['online_amplification']:.0f} tokens run per token trained, measured below)",
        "  one GPU can: hold the model + document KV (+ a streamed window of targets in host RAM), capture "
        "at the compute above, train online; it cannot: keep float32 or bf16 targets on its own disk "
        "(TB; this machine has 64 GiB), nor hold them in RAM — those need object storage (fsspec) or "
        "targets.mode=online",
    ]
    cpu_tok_s = cap["cached"]["tokens"] / cap["cached"]["seconds"]
    cpu_flop = cap["cached"]["tokens"] * cap["flop_per_token"] / cap["cached"]["seconds"]
    where = f"this {cap['device']} device"
    lines.append(f"  {where} sustained {cpu_flop / 1e9:,.0f} GFLOP/s in capture ({cpu_tok_s:,.0f} tok/s at n = "
                 f"{cap['n_context']:,}); at that rate the paper's capture would take "
                 f"{capture / cpu_flop / 3600:,.1f} hours ({capture / cpu_flop / 86400 / 365:.2f} years)")
    if "online" in cap:
        o = cap["online"]
        on_flop = o["tokens"] * cap["flop_per_token"] / o["seconds"]
        lines.append(f"  online stage (top-K only) sustained {on_flop / 1e9:,.0f} GFLOP/s; the paper's top-K pass at that "
                     f"rate: {capture / on_flop / 3600:,.1f} hours")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:smollm2",
                   help="random:smollm2 (default), random:qwen3-1.7b (GPU size) or embedded:smollm2-135m")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--dtype", default="float32", help="the model's dtype (float32 on CPU; bfloat16 on a GPU)")
    p.add_argument("--online-pairs", type=int, default=0,
                   help="pairs of the online targets stage (default: the captured ones); it stores no q/α/A, "
                   "so it can run the issue's >= 10k pairs where cached targets would not fit the disk")
    p.add_argument("--doc-tokens", type=int, default=4096)
    p.add_argument("--pairs", type=int, default=200, help="pairs of the largest store (tiled from the captured)")
    p.add_argument("--capture-pairs", type=int, default=16, help="synthetic pairs put through the targets stage")
    p.add_argument("--online-stage", action="store_true", help="also time the targets stage with mode=online")
    p.add_argument("--rss-pairs", default=None, help="comma list of store sizes (pairs) for the memory series "
                   "(default: pairs/4 and pairs)")
    p.add_argument("--top-k", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8, help="targets.batch_size: pairs per capture forward")
    p.add_argument("--batch-tokens", type=int, default=2048, help="targets.batch_tokens: query tokens per forward")
    p.add_argument("--max-query-tokens", type=int, default=384)
    p.add_argument("--steps", type=int, default=20, help="training steps per measurement")
    p.add_argument("--online-steps", type=int, default=3, help="steps of online token-batch training (>= 3)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--keep", default=None, help="keep the stores in this folder instead of a temporary one")
    p.add_argument("--json", default=None)
    # child-only
    p.add_argument("--child", choices=["capture", "train"], help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    p.add_argument("--kv", help=argparse.SUPPRESS)
    p.add_argument("--loader", default="stream", help=argparse.SUPPRESS)
    p.add_argument("--online", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--kl", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if args.child:
        out = child_capture(args) if args.child == "capture" else child_train(args)
        Path(args.result).write_text(json.dumps(out))
        return 0

    work = Path(args.keep or tempfile.mkdtemp(prefix="bench-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    args.workdir = str(work)
    try:
        return run(args, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def run(args, work: Path) -> int:
    t_start = time.perf_counter()
    load0 = os.getloadavg()
    cap = spawn(args, "capture", ["--online-stage"] if args.online_stage else [], "capture")
    sh = cap["shapes"]
    cap["flop_per_token"] = 2 * cap["nonembed_params"] + 4 * sh["layers"] * sh["q_heads"] * sh["head_dim"] * cap["n_context"]
    fp32 = work / "cached" / "targets.zarr"
    tokens, captured = cap["cached"]["tokens"], cap["cached"]["pairs"]
    stores = {"float32": fp32}
    for dtype, mode in (("float16", "cached"), ("bfloat16", "cached"), ("float32", "online")):
        name = dtype if mode == "cached" else "online"
        stores[name] = work / f"converted-{name}" / "targets.zarr"
        convert_store(fp32, stores[name], dtype, mode)
    kv = str(work / "doc_kv.safetensors")

    def tiled(src: Path, pairs: int, label: str) -> Path:
        """A store of about ``pairs`` pairs: the captured ones' rows repeated."""
        dst = work / f"tiled-{label}-{pairs}" / "targets.zarr"
        if not dst.exists():
            tile_store(src, dst, max(1, round(pairs / captured)))
        return dst

    def train(label, store, *extra):
        return spawn(args, "train", ["--store", str(store), "--kv", kv, "--steps", str(args.steps), *extra], label)

    rss_pairs = sorted({int(x) for x in args.rss_pairs.split(",")} if args.rss_pairs else {max(captured, args.pairs // 4), args.pairs})
    runs: dict[str, dict] = {}
    for i, p in enumerate(rss_pairs):
        store = tiled(fp32, p, "fp32")
        runs[f"stream {p} pairs"] = train(f"train-stream-{p}", store)
        if i == 0:  # the previous loader on the smallest store (it reads the store into RAM)
            runs[f"in-memory {p} pairs (previous loader)"] = train(f"train-inmemory-{p}", store, "--loader", "inmemory")
        if p != args.pairs:
            shutil.rmtree(store.parent, ignore_errors=True)
    big, big_online = tiled(fp32, args.pairs, "fp32"), tiled(stores["online"], args.pairs, "online")
    # online token batches run up to b pair prefixes per step: fewer steps keep the run bounded
    runs["online tokens"] = train("train-online", big_online, "--online", "--steps", str(args.online_steps))
    kl_steps = str(max(3, args.steps // 4))
    runs["cached pairs (mixed)"] = train("train-kl-cached", big, "--kl", "--steps", kl_steps)
    runs["online pairs (mixed)"] = train("train-kl-online", big_online, "--kl", "--online", "--steps", kl_steps)
    amp = online_amplification(big, batch=64, steps=args.steps)
    report(args, cap, stores, runs, amp, rss_pairs, big, tokens, load0, t_start)
    return 0


def report(args, cap, stores, runs, amp, rss_pairs, big, tokens, load0, t_start) -> None:
    sh, c = cap["shapes"], cap["cached"]
    print()
    print(f"bench_scale: model={args.model} (L={sh['layers']}, Hq={sh['q_heads']}, "
          f"Hkv={sh['kv_heads']}, d={sh['head_dim']}, {cap['nonembed_params'] / 1e6:.0f}M matmul parameters) "
          f"on {cap['device']} in {cap['dtype']}; n_context={cap['n_context']:,} captured pairs={c['pairs']:,} "
          f"({tokens:,} query tokens) top_k={args.top_k} threads={args.threads or os.cpu_count()} "
          f"load average before={load0[0]:.1f}")
    if cap.get("gpu_weights_gb") is not None:
        print(f"GPU memory (peak allocated): weights {cap['gpu_weights_gb']:.1f} GB; prefill "
              f"{cap['gpu_prefill_peak_gb']:.1f} GB; targets stage {c['gpu_peak_gb']:.1f} GB"
              + (f"; online stage {cap['online']['gpu_peak_gb']:.1f} GB" if "online" in cap else ""))
    print(f"capture: prefill {cap['prefill_s']:.1f} s ({cap['n_context'] / cap['prefill_s']:.0f} document tok/s); "
          f"targets stage {c['seconds']:.1f} s = {tokens / c['seconds']:.1f} query tok/s with its Zarr writes ({c['bytes'] / c['seconds'] / 1e6:.0f} MB/s) "
          f"(CPU {c['cpu_s']:.0f} s); ~{cap['flop_per_token'] / 1e9:.2f} GFLOP/query token -> "
          f"{tokens * cap['flop_per_token'] / c['seconds'] / 1e9:.0f} GFLOP/s; document KV {human(cap['doc_kv_bytes'])}; "
          f"peak RSS {cap['peak_rss_mb']:.0f} MB")
    if "online" in cap:
        o = cap["online"]
        print(f"  online targets stage (teacher top-K only, nothing recorded): {o['pairs']:,} pairs, "
              f"{o['tokens']:,} query tokens in {o['seconds']:.1f} s = {o['tokens'] / o['seconds']:.1f} query tok/s; "
              f"store {human(o['bytes'])} ({o['bytes'] / o['tokens']:,.0f} B/token; estimate "
              f"{o['estimated_bytes'] / o['tokens']:,.0f})")
    print(f"{'storage':<10}{'B/token on disk':>16}{'estimate B/token':>18}{'captured store':>16}{'vs float32':>11}")
    from nectar.stages.targets import TargetsSize

    f32 = dir_bytes(stores["float32"])
    for name, path in stores.items():
        b = dir_bytes(path)
        est = TargetsSize(n_pairs=c["pairs"], n_tokens=tokens, num_layers=sh["layers"], num_q_heads=sh["q_heads"],
                          head_dim=sh["head_dim"], top_k=args.top_k, dtype="float32" if name == "online" else name,
                          mode="online" if name == "online" else "cached", chunk_tokens=64, shard_tokens=2048).total
        print(f"{name:<10}{b / tokens:>16,.0f}{est / tokens:>18,.0f}{human(b):>16}{b / f32:>10.3f}x")
    print(f"{'training run':<34}{'store':>11}{'steps/s':>9}{'items/s':>9}{'RSS load MB':>12}{'peak RSS MB':>12}"
          f"{'peak-load MB':>13}{'GPU peak GB':>12}")
    for name, r in runs.items():
        g = r.get("gpu_peak_gb")
        print(f"{name:<34}{human(r['store_bytes']):>11}{r['steps_per_s']:>9.3f}{r['steps_per_s'] * r['batch']:>9.1f}"
              f"{r['rss_after_load_mb']:>12.0f}{r['peak_rss_mb']:>12.0f}{r['peak_rss_mb'] - r['rss_after_load_mb']:>13.0f}"
              f"{'-' if g is None else f'{g:.1f}':>12}")
    first, last = runs[f"stream {rss_pairs[0]} pairs"], runs[f"stream {rss_pairs[-1]} pairs"]
    def grow(r): return r["peak_rss_mb"] - r["rss_after_load_mb"]
    print(f"  streamed: store {last['store_bytes'] / first['store_bytes']:.1f}x larger "
          f"({human(first['store_bytes'])} -> {human(last['store_bytes'])}), training memory above the loaded "
          f"model {grow(first):.0f} -> {grow(last):.0f} MB ({grow(last) / max(grow(first), 1):.2f}x)")
    mem = runs[f"in-memory {rss_pairs[0]} pairs (previous loader)"]
    print(f"  previous loader (every q/α/A read into RAM, up to 8 GiB) on the {human(mem['store_bytes'])} store: "
          f"{grow(mem):.0f} MB above the model vs {grow(first):.0f} MB streamed; steps/s {mem['steps_per_s']:.2f} vs "
          f"{first['steps_per_s']:.2f}")
    on, ca = runs["online tokens"], last
    print(f"  online vs cached, token batches (b=64): {on['steps_per_s']:.3f} vs {ca['steps_per_s']:.2f} steps/s "
          f"({ca['steps_per_s'] / on['steps_per_s']:.0f}x slower: {amp:.1f} pair-prefix tokens run per token trained)")
    kon, kca = runs["online pairs (mixed)"], runs["cached pairs (mixed)"]
    print(f"  online vs cached, pair batches (b=4, lambda_kl=2): {kon['steps_per_s']:.3f} vs {kca['steps_per_s']:.3f} "
          f"steps/s ({kca['steps_per_s'] / kon['steps_per_s']:.2f}x slower: one more forward of the pairs, with the "
          f"document attention)")
    print("extrapolation (storage formula and FLOP counts, scaled by the throughput measured above):")
    for line in extrapolate(cap, {"online_amplification": amp}):
        print(line)
    load1 = os.getloadavg()
    print(f"wall {time.perf_counter() - t_start:.0f} s; load average before {load0[0]:.1f}, after {load1[0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"capture": cap, "train": runs, "online_amplification": amp,
                                               "load": [load0, load1]}, indent=2))


def online_amplification(store: Path, batch: int, steps: int) -> float:
    """Pair-prefix tokens the online source runs per token of a random token batch (no model needed:
    the same grouping OnlineTargets does)."""
    from nectar.targets.reader import TargetsData

    d = TargetsData(str(store))
    stream = d.stream("train", by_pairs=False, seed=0)
    run = 0
    for s in range(steps):
        idx = stream.batch(s, batch)
        pair = np.searchsorted(d.offsets, idx, side="right") - 1
        run += sum(int(idx[pair == p].max()) + 1 - int(d.offsets[p]) for p in np.unique(pair))
    d.close()
    return run / (steps * batch)


if __name__ == "__main__":
    sys.exit(main())
