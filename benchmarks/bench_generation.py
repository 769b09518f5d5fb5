"""Generation benchmark (paper App. F): NECTAR module vs the full KV cache, against document length.

For every n in --lengths, one prompt is answered after an n-token document by
  module       a module of the chosen architecture at the budget for n (random init: timing only)
  full_cold    the document is prefilled first, then the prompt (baseline 1)
  full_cached  the document KV already exists — a prefix cache (baseline 2)
and, with --hf-reference, the same prefix-cached decode through plain transformers (sdpa attention,
no NECTAR code), to show the full-cache baseline above is not a slowed-down strawman.
Prints TTFT, decode tokens/s, peak memory and the bytes standing in for the document, then the
ratios module vs full_cold and module vs full_cached. Decoding is greedy, exactly --new-tokens.

    python benchmarks/bench_generation.py                                  # embedded SmolLM2, CPU
    python benchmarks/bench_generation.py --lengths 512,1024,2048,4096 --arch quadrature
    python benchmarks/bench_generation.py --model random:qwen3-1.7b --device cuda --dtype bfloat16 \
        --lengths 4096,16384,32768 --new-tokens 64 --hf-reference
``random:smollm2`` / ``random:qwen3-1.7b`` are those architectures with random weights (only the
tokenizer and config are needed, so they run on machines without the weights): speed depends on
the shapes alone.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def load_document(path: str | None) -> str:
    if path:
        return Path(path).read_text(encoding="utf-8")
    from pydoc_data.topics import topics  # the Python language reference: on every machine

    return "\n\n".join(topics[k] for k in sorted(topics))[:200_000]


def random_model(name: str, dtype: str, device: str, window: int):
    """An architecture with random weights, built from the embedded model's tokenizer/config files."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from nectar.models import BaseModel, _weights_fingerprint, cache_dir

    path = cache_dir() / "models" / "smollm2-135m-instruct"
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
    config.max_position_embeddings = max(window, config.max_position_embeddings)
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(config).to(getattr(torch, dtype)).eval()
    model.requires_grad_(False)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return BaseModel(model=model, tokenizer=tok, name=name, weights_hash=_weights_fingerprint(model, name),
                     num_layers=config.num_hidden_layers, num_q_heads=config.num_attention_heads,
                     num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                     max_context_tokens=config.max_position_embeddings)


def hf_cached_reference(base, context_ids: list[int], prompt: list[int], new_tokens: int,
                        repeats: int) -> dict:
    """Prefix-cached greedy decode with plain transformers (default attention, DynamicCache)."""
    import copy

    import torch
    from transformers import DynamicCache

    dev = base.device
    cache = DynamicCache(config=base.model.config)
    with torch.no_grad():
        for s in range(0, len(context_ids), 2048):
            base.model(torch.tensor([context_ids[s:s + 2048]], device=dev), past_key_values=cache, use_cache=True)
    ttfts, rates = [], []
    for i in range(repeats + 1):  # the first pass warms up and is not counted
        c = copy.deepcopy(cache)
        with torch.no_grad():
            _sync(dev)
            t0 = time.perf_counter()
            nxt = base.model(torch.tensor([prompt], device=dev), past_key_values=c, use_cache=True).logits[:, -1].argmax(-1)
            _sync(dev)
            t1 = time.perf_counter()
            for _ in range(new_tokens - 1):
                nxt = base.model(nxt[:, None], past_key_values=c, use_cache=True).logits[:, -1].argmax(-1)
            _sync(dev)
            t2 = time.perf_counter()
        if i > 0:
            ttfts.append(t1 - t0)
            rates.append((new_tokens - 1) / (t2 - t1))
        del c
    return {"ttft_s": statistics.median(ttfts), "decode_tok_s": statistics.median(rates)}


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded:smollm2-135m")
    ap.add_argument("--document", default=None, help="UTF-8 text file (default: Python language reference)")
    ap.add_argument("--lengths", default="512,1024,2048,4096")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--arch", choices=("mlp", "quadrature"), default="mlp")
    ap.add_argument("--rho", type=float, default=0.05)
    ap.add_argument("--depths", default="0,4,4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--hf-reference", action="store_true")
    ap.add_argument("--json", default=None, help="also write rows and ratios here")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from nectar.evaluation.benchmark import BENCH_PROMPT, context_of_length, ratios, run_benchmark, same_architecture
    from nectar.layout import build_layout
    from nectar.models import load_base_model
    from nectar.modules import plan_module
    from nectar.schemas import ModelConfig

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
    print(f"model {base.name} ({base.num_layers} layers, {base.num_q_heads} q / {base.num_kv_heads} kv heads, "
          f"d={base.head_dim}) on {device} {args.dtype}, {torch.get_num_threads()} threads; document "
          f"{layout.n} tokens tiled to each n; prompt {len(prompt)} tokens; {args.new_tokens} new tokens; "
          f"median of {args.repeats}", flush=True)
    res = run_benchmark(base, layout.context_ids, prompt, lengths, same_architecture(base, plan),
                        args.new_tokens, args.repeats,
                        progress=lambda d, t: print(f"  measured {d}/{t} lengths", flush=True))
    for s in res.skipped:
        print("skipped", s)
    refs = {}
    if args.hf_reference:
        for n in lengths:
            refs[n] = hf_cached_reference(base, context_of_length(layout.context_ids, n), prompt,
                                          args.new_tokens, args.repeats)
    print_table(res.rows, refs)
    rat = ratios(res.rows)
    print_ratios(rat)
    if res.rows:
        print(f"\nmodule: {res.rows[0].note}\nmemory: {res.rows[0].memory_method}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": [r.model_dump() for r in res.rows],
                                               "ratios": rat, "hf_reference": refs, "skipped": res.skipped},
                                              indent=2))


def print_table(rows, refs) -> None:
    print(f"\n{'n':>7} {'system':<13} {'TTFT ms':>10} {'tok/s':>8} {'peak MiB':>9} {'doc state MiB':>13}")
    for r in rows:
        print(f"{r.n_context:>7} {r.system:<13} {r.ttft_s * 1000:>10.1f} {r.decode_tok_s:>8.1f} "
              f"{r.peak_memory_bytes / 2**20:>9.0f} {r.state_bytes / 2**20:>13.2f}")
        if r.system == "full_cached" and r.n_context in refs:
            ref = refs[r.n_context]
            print(f"{r.n_context:>7} {'hf_cached':<13} {ref['ttft_s'] * 1000:>10.1f} {ref['decode_tok_s']:>8.1f}"
                  f" {'':>9} {r.state_bytes / 2**20:>13.2f}   (plain transformers, reference)")


def print_ratios(rat) -> None:
    print("\nmodule vs full KV cache (TTFT: full/module; tok/s: module/full; memory: full/module)")
    print(f"{'n':>7} {'TTFT×cold':>10} {'TTFT×cached':>12} {'tok/s×cold':>11} {'tok/s×cached':>13} "
          f"{'mem×cold':>9} {'mem×cached':>11} {'bytes×':>8}")
    for e in rat:
        print(f"{e['n_context']:>7} {e['ttft_speedup_vs_cold']:>10.2f} {e['ttft_speedup_vs_cached']:>12.2f} "
              f"{e['decode_speedup_vs_cold']:>11.2f} {e['decode_speedup_vs_cached']:>13.2f} "
              f"{e['peak_memory_ratio_vs_cold']:>9.2f} {e['peak_memory_ratio_vs_cached']:>11.2f} "
              f"{e['state_bytes_ratio']:>8.1f}")


if __name__ == "__main__":
    main()
