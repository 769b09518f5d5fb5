"""Target-caching throughput: prefix reuse vs the naive full forward per pair (issue 3).

Prefix reuse (what the targets stage does): prefill the document's KV once with
``prefill_document``, then ``build_targets`` runs query-only forwards for batches of pairs with the
exact document state, recording q, α, A and the teacher top-K, and writes them to sharded Zarr.

Naive baseline: one ordinary forward over document + pair for every pair (sdpa, batch 1). It records
nothing and writes nothing, so it is a *lower bound* on the naive method's cost: the ratio printed is
a conservative one.

Each method runs in its own child process, so peak memory (max RSS; on CUDA also the allocator's
peak) belongs to that method alone. Prints query tokens/s for both (with the one-time prefill
included, and steady-state without it), their ratio, bytes written per query token and peak memory;
with several backends (CUDA: ``--backends torch,fused``) also how far their targets agree.

    python benchmarks/bench_targets.py                       # embedded SmolLM2, pydoc:naming, CPU
    python benchmarks/bench_targets.py --device cuda --model random:smollm2 --doc-tokens 16384 \
        --dtype bfloat16 --backends torch,fused --pairs 64
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

TASKS = ("qa", "quoting", "paraphrasing", "summarization")


# ----------------------------------------------------------------------------- inputs


def synthetic_pairs(text: str, n_pairs: int, seed: int = 0) -> list:
    """Question/answer pairs built from the document's own sentences, spread over the whole text.

    Shaped like the synthesize stage's output (instruction + a 1-3 sentence response, four task
    types), so query lengths are realistic; the content is not what a model would write.
    """
    from nectar.schemas import DatasetRow

    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if len(s.strip()) >= 40]
    if len(sentences) < 4:
        raise SystemExit(f"document has {len(sentences)} usable sentences; need at least 4 to build pairs")
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n_pairs):
        j = int(rng.integers(0, len(sentences) - 3))
        s, task = sentences[j], TASKS[i % len(TASKS)]
        words = " ".join(s.split()[:6])
        if task == "qa":
            instruction, response = f"According to the document, what is said about \"{words}\"?", s
        elif task == "quoting":
            instruction, response = f"Quote the passage that begins with \"{words}\".", " ".join(sentences[j:j + 2])
        elif task == "paraphrasing":
            instruction, response = f"Paraphrase in plain words: \"{s}\"", s
        else:
            instruction, response = (f"Summarize the part of the document around \"{words}\" in a few sentences.",
                                     " ".join(sentences[j:j + 3]))
        rows.append(DatasetRow(pair_id=f"bench-{i}", chunk_id=0, task=task, instruction=instruction,
                               response=response, full_answer=response, judge_raw="{}", is_consistent=True,
                               confidence=1.0, reasoning="", verdict="consistent", kept=True,
                               split="train" if i % 5 else "test"))
    return rows


def long_document(tokenizer, n_tokens: int) -> str:
    """About ``n_tokens`` of real text: CPython's language reference topics, concatenated in order."""
    from pydoc_data.topics import topics

    text, total = [], 0
    for name in sorted(topics):
        text.append(topics[name])
        total += len(tokenizer(topics[name], add_special_tokens=False)["input_ids"])
        if total >= n_tokens:
            break
    ids = tokenizer("\n\n".join(text), add_special_tokens=False)["input_ids"][:n_tokens]
    return tokenizer.decode(ids)


def random_smollm2(dtype: str, device: str, window: int):
    """SmolLM2-135M's architecture (30 layers, 9 q / 3 kv heads, d=64) with random weights.

    For GPU runs where the real weights (538 MB) can't travel: only the tokenizer and config.json
    are needed. Throughput depends on the shapes alone; agreement checks hold for any weights.
    """
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from nectar.models import BaseModel, _weights_fingerprint, cache_dir

    path = cache_dir() / "models" / "smollm2-135m-instruct"
    config = LlamaConfig.from_pretrained(path)
    config.max_position_embeddings = max(window, config.max_position_embeddings)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(getattr(torch, dtype)).eval()
    model.requires_grad_(False)
    tok = AutoTokenizer.from_pretrained(path)
    return BaseModel(model=model, tokenizer=tok, name="random:smollm2",
                     weights_hash=_weights_fingerprint(model, "random:smollm2"),
                     num_layers=config.num_hidden_layers, num_q_heads=config.num_attention_heads,
                     num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                     max_context_tokens=config.max_position_embeddings)


def load_model(args):
    from nectar.models import load_base_model
    from nectar.schemas import ModelConfig

    if args.model == "random:smollm2":
        return random_smollm2(args.dtype, args.device, (args.doc_tokens or 0) + args.max_query_tokens + 256)
    return load_base_model(ModelConfig(name=args.model, dtype=args.dtype, device=args.device))


# ----------------------------------------------------------------------------- one method (child)


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory_now(device) -> dict:
    import torch

    with open("/proc/self/status") as f:
        rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    out = {"rss_mb": rss_kb / 1024, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if device.type == "cuda":
        out["cuda_peak_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run_child(args) -> dict:
    import torch

    from nectar.attention.prefix import prefill_document
    from nectar.documents import load_document
    from nectar.layout import build_layout, check_fits
    from nectar.schemas import TargetsConfig
    from nectar.stages.targets import build_targets, plan_pairs

    if args.device == "cpu":
        torch.set_num_threads(args.threads or os.cpu_count() or 1)
    base = load_model(args)
    device = base.device
    text, source = load_document(args.document)
    if args.doc_tokens:
        text = long_document(base.tokenizer, args.doc_tokens)
    layout = build_layout(base.tokenizer, text)
    check_fits(layout, args.max_query_tokens, base.max_context_tokens)
    cfg = TargetsConfig(top_k=args.top_k, batch_size=args.batch_size, max_query_tokens=args.max_query_tokens,
                        dtype=args.store_dtype)
    rows = synthetic_pairs(text, args.pairs, args.seed)
    planned = plan_pairs(rows, layout, cfg)
    query_tokens = sum(p.row.length for p in planned)
    with torch.no_grad():  # warm-up (lazy init, kernel selection) outside the timed region, both methods
        base.model(torch.as_tensor([list(layout.context_ids[:64])], device=device))
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    after_load = memory_now(device)
    result = {"method": args.child, "backend": args.backend, "device": str(device), "n_context": layout.n,
              "pairs": len(planned), "query_tokens": query_tokens, "rss_after_load_mb": after_load["rss_mb"]}
    c0 = time.process_time()  # CPU seconds of all threads: less sensitive to other jobs on a shared machine
    if args.child == "reuse":
        t0 = time.perf_counter()
        kv = prefill_document(base, layout.context_ids)
        sync(device)
        t1 = time.perf_counter()
        out_url = args.workdir
        counts = build_targets(base, layout, kv, rows, cfg, out_url, source.sha256, backend=args.backend)
        sync(device)
        t2 = time.perf_counter()
        assert counts["tokens"] == query_tokens, (counts, query_tokens)
        result.update(prefill_s=t1 - t0, capture_s=t2 - t1, total_s=t2 - t0, zarr=str(Path(out_url) / "targets.zarr"),
                      bytes_written=dir_bytes(Path(out_url) / "targets.zarr"), doc_kv_mb=kv.nbytes() / 2**20)
    else:
        t0 = time.perf_counter()
        with torch.no_grad():
            for p in planned:  # what a per-pair pipeline does: the whole document + this pair, every time
                ids = torch.as_tensor([list(layout.context_ids) + p.ids], device=device)
                # Only the pair's logits are needed (the most favourable naive forward).
                base.model(input_ids=ids, use_cache=False, logits_to_keep=len(p.ids))
        sync(device)
        result.update(prefill_s=0.0, capture_s=time.perf_counter() - t0, total_s=time.perf_counter() - t0)
    result.update(memory_now(device), cpu_s=time.process_time() - c0)
    return result


# ----------------------------------------------------------------------------- parent


def spawn(args, method: str, backend: str, workdir: str, index: int) -> dict:
    # Each run gets its own folder: build_targets resumes a complete group instead of recomputing it.
    rundir = os.path.join(workdir, f"{index}-{method}-{backend}")
    result_file = rundir + ".json"
    cmd = [sys.executable, __file__, "--child", method, "--backend", backend, "--workdir", rundir,
           "--result", result_file, *args.passthrough]
    print(f"[bench] {method} ({backend}) ...", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)
    return json.loads(Path(result_file).read_text())


def agreement(ref_zarr: str, other_zarr: str) -> dict:
    """How far two backends' targets are apart (max abs differences, top-1 agreement)."""
    from nectar.targets.store import open_targets

    a, _ = open_targets(ref_zarr)
    b, _ = open_targets(other_zarr)
    out = {}
    for name in ("q", "alpha", "A", "topk_logprobs"):
        x, y = np.asarray(a[name][:], np.float32), np.asarray(b[name][:], np.float32)
        out[f"{name}_max_abs"] = float(np.abs(x - y).max())
        out[f"{name}_max_rel"] = float(np.abs(x - y).max() / max(np.abs(x).max(), 1e-12))
    out["top1_agree"] = float((a["topk_ids"][:, 0] == b["topk_ids"][:, 0]).mean())
    return out


def report(args, results: list[dict], agree: dict) -> bool:
    naive = next(r for r in results if r["method"] == "naive")
    print(f"\nmodel={args.model} dtype={args.dtype} device={naive['device']} document={args.document}"
          f"{f' (doc_tokens={args.doc_tokens})' if args.doc_tokens else ''} n_context={naive['n_context']} "
          f"pairs={naive['pairs']} query_tokens={naive['query_tokens']} "
          f"(mean {naive['query_tokens'] / naive['pairs']:.1f}/pair) batch_size={args.batch_size}")
    head = (f"{'method':<16}{'prefill s':>10}{'capture s':>11}{'total s':>10}{'tok/s':>10}{'tok/s steady':>14}"
            f"{'B/token':>10}{'CPU s':>8}{'peak RSS MB':>13}{'RSS>load MB':>13}{'cuda peak MB':>14}")
    print(head)
    for r in results:
        tps, steady = r["query_tokens"] / r["total_s"], r["query_tokens"] / r["capture_s"]
        bpt = r["bytes_written"] / r["query_tokens"] if "bytes_written" in r else float("nan")
        print(f"{r['method'] + ':' + r['backend']:<16}{r['prefill_s']:>10.2f}{r['capture_s']:>11.2f}"
              f"{r['total_s']:>10.2f}{tps:>10.1f}{steady:>14.1f}{bpt:>10.0f}{r['cpu_s']:>8.1f}{r['peak_rss_mb']:>13.0f}"
              f"{r['peak_rss_mb'] - r['rss_after_load_mb']:>13.0f}{r.get('cuda_peak_mb', float('nan')):>14.0f}")
    ok = True
    for r in results:
        if r["method"] != "reuse":
            continue
        ratio, steady = naive["total_s"] / r["total_s"], naive["capture_s"] / r["capture_s"]
        verdict = "OK" if ratio >= args.min_ratio else "BELOW TARGET"
        ok &= ratio >= args.min_ratio
        print(f"speed-up reuse:{r['backend']} vs naive full forward per pair: {ratio:.1f}x incl. prefill, "
              f"{steady:.1f}x steady-state, {naive['cpu_s'] / r['cpu_s']:.1f}x in CPU time incl. prefill "
              f"(target >= {args.min_ratio:g}x wall incl. prefill: {verdict})")
    for name, a in agree.items():
        print(f"agreement {name}: " + " ".join(f"{k}={v:.3g}" for k, v in a.items()))
    return ok


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="cpu, cuda or auto")
    p.add_argument("--pairs", type=int, default=32)
    p.add_argument("--document", default="pydoc:naming")
    p.add_argument("--doc-tokens", type=int, default=None,
                   help="use ~N tokens of concatenated pydoc topics instead of --document (long-document runs)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--model", default="embedded:smollm2-135m",
                   help="embedded:smollm2-135m, tiny:llama, tiny:qwen3, random:smollm2 (SmolLM2 shapes, random)")
    p.add_argument("--backends", default="auto", help="comma list of torch,fused,flash,auto; first is reference")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--top-k", type=int, default=32)
    p.add_argument("--max-query-tokens", type=int, default=512)
    p.add_argument("--store-dtype", default="float32", choices=["float32", "float16"])
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-ratio", type=float, default=10.0, help="exit 1 when reuse is slower than this x naive")
    p.add_argument("--json", default=None, help="also write all figures to this JSON file")
    p.add_argument("--child", choices=["reuse", "naive"], help=argparse.SUPPRESS)
    p.add_argument("--backend", default="auto", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.pairs < 1 or args.batch_size < 1:
        p.error(f"--pairs ({args.pairs}) and --batch-size ({args.batch_size}) must be at least 1")
    own = {"--child", "--backend", "--workdir", "--result", "--backends", "--json", "--min-ratio"}
    argv = sys.argv[1:] if argv is None else argv
    args.passthrough = _drop_options(argv, own) + ["--device", args.device]
    return args


def _drop_options(argv: list[str], names: set[str]) -> list[str]:
    out, skip = [], False
    for tok in argv:
        if skip:
            skip = False
            continue
        name = tok.split("=", 1)[0]
        if name in names or name == "--device":
            skip = "=" not in tok
            continue
        out.append(tok)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        Path(args.result).write_text(json.dumps(run_child(args)))
        return 0
    workdir = tempfile.mkdtemp(prefix="bench-targets-")
    try:
        backends = [b.strip() for b in args.backends.split(",") if b.strip()]
        results = [spawn(args, "reuse", b, workdir, i) for i, b in enumerate(backends)]
        results.append(spawn(args, "naive", "sdpa", workdir, len(backends)))
        ref = results[0]
        agree = {f"{r['backend']} vs {ref['backend']}": agreement(ref["zarr"], r["zarr"])
                 for r in results[1:] if r["method"] == "reuse"}
        ok = report(args, results, agree)
        if args.json:
            Path(args.json).write_text(json.dumps({"args": {k: v for k, v in vars(args).items()
                                                            if k != "passthrough"},
                                                   "results": results, "agreement": agree}, indent=2))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
