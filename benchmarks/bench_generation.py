"""Generation benchmark (paper App. F, issue 12): NECTAR module vs the best full KV cache available.

For every n in --lengths, one prompt is answered after an n-token document (greedy, exactly
--new-tokens, median of --repeats) by

  module            the decode engine with the module (fused inference form; random init: timing only)
  full_cached       the same engine with the exact document state over the document's KV (prefix cache)
  full_cold         full_cached with the document prefilled first
  hf_static_cached  transformers' own decode over the same prefix: StaticCache + sdpa attention, the
                    decode step compiled (torch.compile "reduce-overhead", CUDA graphs) on GPU
  hf_static_cold    hf_static_cached with the document prefilled first

The first three are ``nectar.evaluation.benchmark.run_benchmark``, the evaluate stage's own code and
defaults, so the stage's table and this one measure the same thing. The module is compared with the
faster of the two full-cache paths (``best``), cold and prefix-cached.

Every decode rate is also printed as a fraction of its memory-bandwidth bound (docs/design.md §12):
bytes read per decode step = the model's weights + the module, or + the document's KV (read once per
step), over a bandwidth this script measures (the read rate of a sum over 512 MiB, torch threads as
set) unless --bandwidth-gbs is given. The TTFT bound against the prefix cache is the arithmetic one,
(C_model + C_doc) / (C_model + C_module) FLOPs per prompt token.

Batched decoding (--batch 1,8,32, at the largest n): B concurrent requests on the same document;
module vs the full cache read once per step (the engine's ExactDocState folds the batch into one
attention over the one KV) vs read per sequence (transformers' StaticCache with a copy per row).

    python benchmarks/bench_generation.py --lengths 4096                       # embedded SmolLM2, CPU
    python benchmarks/bench_generation.py --lengths 1024,2048,4096 --arch quadrature --batch 1
    python benchmarks/bench_generation.py --model random:qwen3-1.7b --device cuda --dtype bfloat16 \\
        --lengths 32768,131072 --new-tokens 64 --batch 1,8,32
``random:smollm2`` / ``random:qwen3-1.7b`` are those architectures with random weights (only the
tokenizer and config are needed, so they run on machines without the weights): speed depends on
the shapes alone.
"""
from __future__ import annotations

import os

# Like the `nectar` CLI (and so the evaluate stage): threads sleep instead of spinning between ops.
# On a machine with anything else running, spinning threads make small ops 10-20x slower.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def load_document(path: str | None) -> str:
    if path:
        return Path(path).read_text(encoding="utf-8")
    from pydoc_data.topics import topics  # the Python language reference: on every machine

    return "\n\n".join(topics[k] for k in sorted(topics))[:200_000]


def random_model(name: str, dtype: str, device: str, window: int, rope: dict | None = None):
    """An architecture with random weights, built from the embedded model's tokenizer/config files.
    ``rope``: a RoPE scaling (e.g. YaRN, as the ``paper`` preset extends Qwen3) applied before the
    model is built; without it the window is simply raised to ``window`` (same cost per token)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from nectar.base_model import BaseLM, _weights_fingerprint, cache_dir, embedded_smollm2_dir

    # Only the tokenizer and config.json are read: on a machine the 538 MB weights can't travel to
    # (a GPU lease), those two files in $NECTAR_CACHE/models/smollm2-135m-instruct are enough.
    path = cache_dir() / "models" / "smollm2-135m-instruct"
    if not ((path / "tokenizer.json").exists() and (path / "config.json").exists()):
        path = embedded_smollm2_dir()
    tok = AutoTokenizer.from_pretrained(path)
    if name == "random:smollm2":
        config, cls = LlamaConfig.from_pretrained(path), LlamaForCausalLM
    elif name == "random:qwen3-1.7b":  # Qwen3-1.7B's shapes (28 layers, 16 q / 8 kv heads, d=128)
        config = Qwen3Config(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                             num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                             max_position_embeddings=40960, rope_theta=1_000_000, rms_norm_eps=1e-6,
                             tie_word_embeddings=True)
        cls = Qwen3ForCausalLM
    else:
        raise SystemExit(f"unknown random model {name!r}; use random:smollm2 or random:qwen3-1.7b")
    if rope is not None:
        from nectar.base_model import apply_rope_scaling

        apply_rope_scaling(config, rope)
    config.max_position_embeddings = max(window, config.max_position_embeddings)
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(config).to(getattr(torch, dtype)).eval()
    model.requires_grad_(False)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return BaseLM(model=model, tokenizer=tok, name=name, weights_hash=_weights_fingerprint(model),
                     num_layers=config.num_hidden_layers, num_q_heads=config.num_attention_heads,
                     num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                     max_context_tokens=config.max_position_embeddings)


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# ----- the physical bound -----

def measure_read_bandwidth(device, mib: int = 512, repeats: int = 5) -> float:
    """Bytes/s of reading a large tensor (a sum over ``mib`` MiB, best of ``repeats``): STREAM-like."""
    import torch

    x = torch.ones(mib * 2**20 // 4, dtype=torch.float32, device=device)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        _sync(x.device)
        t0 = time.perf_counter()
        x.sum()
        _sync(x.device)
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


def weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every parameter once (a tied embedding is the LM head;
    an untied input embedding is read one row per token, so it is left out)."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total if emb.data_ptr() == head.data_ptr() else total - emb.numel() * emb.element_size()


def kv_bytes(base, n: int) -> int:
    return 2 * base.num_layers * base.num_kv_heads * base.head_dim * n * base.dtype.itemsize


def prompt_flops(base, n: int, module_params: int | None) -> float:
    """FLOPs per prompt token beyond the LM head: the linear layers, plus attention over the n
    document tokens (QK and PV) or the module (each query head evaluates its KV head's networks)."""
    emb = base.model.get_input_embeddings().weight.numel()
    linear = 2 * (sum(p.numel() for p in base.model.parameters()) - emb)
    if module_params is None:
        return linear + 4 * n * base.head_dim * base.num_q_heads * base.num_layers
    g = base.num_q_heads // base.num_kv_heads
    return linear + 2 * module_params * g


# ----- transformers' own full-cache decode (the baseline that must not be a strawman) -----

class HFStatic:
    """Greedy decoding with transformers' StaticCache and sdpa attention; on CUDA the decode step is
    ``torch.compile(mode="reduce-overhead")`` (CUDA graphs), as transformers documents for speed."""

    def __init__(self, base, compile_decode: bool):
        self.base, self.model, self.dev = base, base.model, base.device
        self.compile_decode = compile_decode
        self._compiled = {}

    def _cache(self, batch: int, max_len: int):
        from transformers import StaticCache

        cache = StaticCache(config=self.model.config, max_cache_len=max_len)
        cache.early_initialization(batch, self.base.num_kv_heads, self.base.head_dim, self.base.dtype, self.dev)
        return cache

    def prefill(self, cache, ids: list[int], chunk: int = 2048):
        import torch

        for s in range(0, len(ids), chunk):
            out = self.model(input_ids=torch.tensor([ids[s:s + chunk]], device=self.dev), past_key_values=cache,
                             use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]

    def document_cache(self, context_ids: list[int], batch: int, max_len: int):
        """A cache holding the document for ``batch`` rows (prefilled once, copied per row)."""
        one = self._cache(1, max_len)
        self.prefill(one, context_ids)
        if batch == 1:
            return one
        cache = self._cache(batch, max_len)
        for src, dst in zip(one.layers, cache.layers):
            dst.keys.copy_(src.keys.expand_as(dst.keys))
            dst.values.copy_(src.values.expand_as(dst.values))
            dst.cumulative_length.fill_(len(context_ids))
        return cache

    def _step(self, cache):
        def step(tok):
            return self.model(input_ids=tok[:, None], past_key_values=cache, use_cache=True).logits[:, -1]

        if not self.compile_decode:
            return step
        import torch

        key = id(cache)
        if key not in self._compiled:
            self._compiled[key] = torch.compile(step, mode="reduce-overhead")
        return self._compiled[key]

    def decode(self, cache, n: int, prompts: list[list[int]], new_tokens: int, cold_ids: list[int] | None = None):
        """(ttft_s, aggregate decode tok/s). ``cold_ids``: prefill these (the document) first, timed."""
        import torch

        with torch.inference_mode():
            for layer in cache.layers:  # rewind to the end of the document
                layer.cumulative_length.fill_(n)
            ids = torch.tensor(prompts, device=self.dev)
            step = self._step(cache)
            _sync(self.dev)
            t0 = time.perf_counter()
            if cold_ids is not None:
                for layer in cache.layers:
                    layer.cumulative_length.fill_(0)
                self.prefill(cache, cold_ids)
            out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            tok = out.logits[:, -1].argmax(-1)
            tok.tolist()  # the first token on the host, as the engine's TTFT
            t1 = time.perf_counter()
            for _ in range(new_tokens - 1):
                tok = step(tok).argmax(-1)
            tok.tolist()
            t2 = time.perf_counter()
        return t1 - t0, len(prompts) * (new_tokens - 1) / (t2 - t1)

    def measure(self, context_ids, prompts, new_tokens, repeats, cold: bool):
        """Median TTFT and tok/s over ``repeats`` runs after one untimed warm-up run, and the peak memory."""
        from nectar.evaluation.memory import track_peak_memory

        n, batch = len(context_ids), len(prompts)
        max_len = n + len(prompts[0]) + new_tokens
        prev = self.model.config._attn_implementation
        self.model.set_attn_implementation("sdpa")
        try:
            with track_peak_memory(self.dev) as pm:
                cache = self.document_cache(context_ids, batch, max_len) if not cold or batch > 1 else \
                    self._cache(1, max_len)
                runs = [self.decode(cache, n, prompts, new_tokens, context_ids if cold else None)
                        for _ in range(repeats + 1)][1:]
            del cache
        finally:
            self.model.set_attn_implementation(prev)
        return (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs), pm.peak_bytes)


# ----- reporting -----

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded:smollm2-135m")
    ap.add_argument("--document", default=None, help="UTF-8 text file (default: Python language reference)")
    ap.add_argument("--lengths", default="4096")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--arch", choices=("mlp", "quadrature"), default="mlp")
    ap.add_argument("--rho", type=float, default=0.05)
    ap.add_argument("--depths", default="0,4,4")
    ap.add_argument("--repeats", type=int, default=None, help="default: the evaluate stage's")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baselines")
    ap.add_argument("--hf-compile", choices=("auto", "on", "off"), default="auto",
                    help="compile transformers' decode step (auto: on CUDA)")
    ap.add_argument("--batch", default="1,8,32", help="batch sizes of the batched section ('' to skip)")
    ap.add_argument("--batch-new-tokens", type=int, default=16)
    ap.add_argument("--bandwidth-gbs", type=float, default=None, help="assume this bandwidth instead of measuring")
    ap.add_argument("--json", default=None, help="also write everything here")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from nectar.attention.doc_kv import prefill_document
    from nectar.attention.exact import ExactDocState
    from nectar.evaluation.benchmark import (BENCH_PROMPT, REPEATS, context_of_length, ratios, run_benchmark,
                                             same_architecture, timed_batch)
    from nectar.layout import build_layout
    from nectar.base_model import load_base_model
    from nectar.modules import plan_module
    from nectar.schemas import ModelConfig

    repeats = args.repeats or REPEATS
    lengths = sorted(int(x) for x in args.lengths.split(","))
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if args.model.startswith("random:"):
        base = random_model(args.model, args.dtype, device, max(lengths) + 1024)
    else:
        base = load_base_model(ModelConfig(name=args.model, dtype=args.dtype, device=device))
    layout = build_layout(base.tokenizer, load_document(args.document))
    prompt = layout.prompt(BENCH_PROMPT).ids
    depths = tuple(int(x) for x in args.depths.split(","))
    plan = plan_module(args.arch, base.num_layers, base.num_kv_heads, base.head_dim, max(lengths), base.scaling,
                       args.rho, depths=depths)
    bw = args.bandwidth_gbs * 1e9 if args.bandwidth_gbs else measure_read_bandwidth(base.device)
    bw_note = "given" if args.bandwidth_gbs else "measured: read of 512 MiB (torch sum), best of 5"
    wbytes = weight_bytes(base.model)
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    print(f"model {base.name} ({base.num_layers} layers, {base.num_q_heads} q / {base.num_kv_heads} kv heads, "
          f"d={base.head_dim}) on {device} {args.dtype}, {torch.get_num_threads()} threads; document "
          f"{layout.n} tokens tiled to each n; prompt {len(prompt)} tokens; {args.new_tokens} new tokens; "
          f"median of {repeats}; load average {load:.1f}")
    print(f"bandwidth {bw / 1e9:.1f} GB/s ({bw_note}); weights read per step {wbytes / 1e6:.0f} MB", flush=True)

    res = run_benchmark(base, layout.context_ids, prompt, lengths, same_architecture(base, plan),
                        args.new_tokens, repeats,
                        progress=lambda d, t: print(f"  measured {d}/{t} lengths", flush=True))
    for s in res.skipped:
        print("skipped", s)
    table = [dict(n=r.n_context, system=r.system, B=1, ttft_s=r.ttft_s, tok_s=r.decode_tok_s,
                  peak=r.peak_memory_bytes, state=r.state_bytes) for r in res.rows]
    module_bytes = {r.n_context: r.state_bytes for r in res.rows if r.system == "module"}
    hf = None
    if not args.no_hf:
        compile_decode = args.hf_compile == "on" or (args.hf_compile == "auto" and device == "cuda")
        hf = HFStatic(base, compile_decode)
        for n in lengths:
            ctx = context_of_length(layout.context_ids, n)
            for cold in (False, True):
                ttft, rate, peak = hf.measure(ctx, [prompt], args.new_tokens, repeats, cold)
                table.append(dict(n=n, system=f"hf_static_{'cold' if cold else 'cached'}", B=1, ttft_s=ttft,
                                  tok_s=rate, peak=peak, state=kv_bytes(base, n)))
            print(f"  transformers baseline measured at n={n}", flush=True)
    for row in table:
        per_step = wbytes + (module_bytes[row["n"]] if row["system"] == "module" else kv_bytes(base, row["n"]))
        row["bound_tok_s"] = row["B"] * bw / per_step
    print_table(table)
    summary = print_ratios(table, base, module_bytes, wbytes)

    batched = []
    if args.batch and module_bytes:
        n = max(module_bytes)
        batched = run_batched(base, layout, prompt, n, [int(b) for b in args.batch.split(",")], plan,
                              args.batch_new_tokens, repeats, hf, bw, wbytes, timed_batch, same_architecture,
                              context_of_length, prefill_document, ExactDocState)
    if res.rows:
        print(f"\nmodule: {res.rows[0].note}\nmemory: {res.rows[0].memory_method}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "bandwidth_Bps": bw, "weight_bytes": wbytes,
                                               "load_avg": load, "table": table, "ratios": ratios(res.rows),
                                               "summary": summary, "batched": batched,
                                               "skipped": res.skipped}, indent=2))


def print_table(table) -> None:
    print(f"\n{'n':>7} {'system':<17} {'B':>3} {'TTFT ms':>9} {'tok/s':>8} {'bound':>7} {'of bound':>8} "
          f"{'peak MiB':>9} {'doc state MiB':>13}")
    for r in table:
        print(f"{r['n']:>7} {r['system']:<17} {r['B']:>3} {r['ttft_s'] * 1000:>9.1f} {r['tok_s']:>8.1f} "
              f"{r['bound_tok_s']:>7.1f} {r['tok_s'] / r['bound_tok_s']:>8.0%} {r['peak'] / 2**20:>9.0f} "
              f"{r['state'] / 2**20:>13.2f}")


def print_ratios(table, base, module_bytes, wbytes) -> list[dict]:
    """Module vs the best full cache (the faster of the engine's exact-state path and transformers)."""
    print("\nmodule vs the best full KV cache (TTFT: full/module; tok/s: module/full); bound = the analytic "
          "ratio (decode: bytes per step; TTFT: FLOPs per prompt token)")
    print(f"{'n':>7} {'kind':<7} {'best full':<17} {'TTFT x':>7} {'bound':>6} {'tok/s x':>8} {'bound':>6} "
          f"{'vs engine full: TTFT x':>22} {'tok/s x':>8}")
    out = []
    for n, mbytes in sorted(module_bytes.items()):
        rows = {r["system"]: r for r in table if r["n"] == n and r["B"] == 1}
        mod = rows["module"]
        mparams = mbytes // base.dtype.itemsize
        ttft_bound = prompt_flops(base, n, None) / prompt_flops(base, n, mparams)
        dec_bound = (wbytes + kv_bytes(base, n)) / (wbytes + mbytes)
        for kind in ("cached", "cold"):
            cands = [rows[s] for s in (f"full_{kind}", f"hf_static_{kind}") if s in rows]
            best_rate = max(cands, key=lambda r: r["tok_s"])
            best_ttft = min(cands, key=lambda r: r["ttft_s"])
            engine = rows[f"full_{kind}"]
            e = dict(n=n, kind=kind, best_decode=best_rate["system"], best_ttft=best_ttft["system"],
                     ttft_x=best_ttft["ttft_s"] / mod["ttft_s"], tok_s_x=mod["tok_s"] / best_rate["tok_s"],
                     ttft_x_engine=engine["ttft_s"] / mod["ttft_s"], tok_s_x_engine=mod["tok_s"] / engine["tok_s"],
                     decode_bound=dec_bound, ttft_bound=ttft_bound if kind == "cached" else float("nan"))
            out.append(e)
            print(f"{n:>7} {kind:<7} {best_rate['system']:<17} {e['ttft_x']:>7.2f} {e['ttft_bound']:>6.2f} "
                  f"{e['tok_s_x']:>8.2f} {dec_bound:>6.2f} {e['ttft_x_engine']:>22.2f} {e['tok_s_x_engine']:>8.2f}")
    return out


def run_batched(base, layout, prompt, n, batches, plan, new_tokens, repeats, hf, bw, wbytes, timed_batch,
                same_architecture, context_of_length, prefill_document, ExactDocState) -> list[dict]:
    """B concurrent requests on one document: module, full cache read once per step, read per sequence."""
    ctx = context_of_length(layout.context_ids, n)
    mod = same_architecture(base, plan)(n, ctx)
    kv = prefill_document(base, ctx)
    kvb = kv_bytes(base, n)
    print(f"\nbatched decoding: B requests (the same prompt) on one n={n} document, {new_tokens} new tokens, "
          f"aggregate tok/s (fraction of the bandwidth bound)")
    print(f"{'B':>4} {'module':>15} {'full read-once':>15} {'full per-seq':>15} {'mod/once':>9} {'mod/per-seq':>11} "
          f"{'mod B/B=1':>10}")
    out, base_rate = [], None
    for B in batches:
        prompts = [prompt] * B
        timed_batch(base, mod.provider, n, prompts, 2, 1)  # warm-up at this batch size, not timed
        m_ttft, m_rate = timed_batch(base, mod.provider, n, prompts, new_tokens, repeats)
        timed_batch(base, ExactDocState(kv), n, prompts, 2, 1)
        o_ttft, o_rate = timed_batch(base, ExactDocState(kv), n, prompts, new_tokens, repeats)
        p_rate = float("nan")
        if hf is not None:
            _, p_rate, _ = hf.measure(ctx, prompts, new_tokens, repeats, cold=False)
        bounds = (B * bw / (wbytes + mod.state_bytes), B * bw / (wbytes + kvb), B * bw / (wbytes + B * kvb))
        base_rate = base_rate or (m_rate if B == 1 else None)
        e = dict(B=B, module=m_rate, read_once=o_rate, per_seq=p_rate, bounds=bounds, module_ttft=m_ttft,
                 read_once_ttft=o_ttft, module_vs_b1=(m_rate / base_rate) if base_rate else float("nan"))
        out.append(e)
        cells = [f"{r:7.1f} ({r / bd:4.0%})" for r, bd in zip((m_rate, o_rate, p_rate), bounds)]
        print(f"{B:>4} {cells[0]:>15} {cells[1]:>15} {cells[2]:>15} {m_rate / o_rate:>9.2f} {m_rate / p_rate:>11.2f} "
              f"{e['module_vs_b1']:>10.2f}", flush=True)
    return out


if __name__ == "__main__":
    main()
