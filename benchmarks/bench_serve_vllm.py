"""vLLM serving a document's state vs vLLM serving the full document, same machine, one run.

Both servers run the same base model (default: the embedded SmolLM2-135M) with prefix caching on;
they run one after the other, never together. Each answers ``--clients`` concurrent streaming
``/v1/completions`` requests of ``--new-tokens`` tokens (no stop) about a document of ``--doc-tokens``
tokens:

  state    the NECTAR KV connector with a plain-KV state of m pseudo-tokens (``nectar.vllm.connector``),
           vLLM's own attention; prompt = m placeholders + the question. --preset P sizes it as the β-free
           refit ``attention_matching_kv@intB`` at P's budget (the fallback `--engine vllm` serves without
           the plugin); without --preset, m = ρ·n. The state's keys/values are RANDOM (seeded) — its size,
           not its content, sets the speed.
  backend  the product's state through NECTAR's attention backend plugin (``nectar.vllm.backend``): per-layer
           widths of P's module plan (ragged layers padded with β = −inf to the widest, m placeholders),
           random β; the state held once per server and attended by one GEMM per document and step.
  full   plain vLLM; prompt = the document's n tokens + the question; one warm-up request first,
         so every timed request finds the document in vLLM's prefix cache.

Reported per system: output tokens/s over the whole burst (all clients' tokens / wall time), mean and
p50/p90 time-to-first-token, the ratio state/full, and why: the decode step time (median gap between
a request's tokens while every request is in flight), the server's CPU seconds per token, vLLM's own
scheduler gauges polled during the burst (most requests running / waiting at once, KV-cache use,
preemptions, prefix-cache hit rate), and the step's lower bounds (bytes every step must read: the
weights + each sequence's KV, at this machine's measured read bandwidth; its GFLOP).

    python benchmarks/bench_serve_vllm.py --doc-tokens 8064 --clients 32 --new-tokens 64 --systems backend,state,full
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
import urllib.request

import torch

from nectar.base_model import embedded_smollm2_dir
from nectar.ports import free_port
from nectar.vllm.format import STATE_FORMAT, STATE_VERSION
from nectar.vllm.serve import ServedDocument, placeholder_token, state_server_spec
from nectar.shutdown import handling_signals
from nectar.vllm.server import VLLMServer
from nectar.vllm.venv import ensure_plugin, interpreter


def random_state(path: str, cfg, m: int, n: int, seed: int = 0, widths: list[int] | None = None) -> None:
    """A state file of the right shape for ``cfg`` (a transformers config) with seeded random KV; with
    ``widths`` (per layer) also a random β, −inf past each layer's width (the backend's ragged form)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    hkv = cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    tensors = {}
    for i in range(cfg.num_hidden_layers):
        tensors[f"k.{i}"] = torch.randn(hkv, m, d, generator=g)  # [hkv, m, d]
        tensors[f"v.{i}"] = torch.randn(hkv, m, d, generator=g)
        if widths is not None:
            beta = torch.randn(hkv, m, generator=g)
            beta[:, widths[i]:] = float("-inf")
            tensors[f"b.{i}"] = beta  # [hkv, m]
    meta = {"format": STATE_FORMAT, "version": STATE_VERSION, "base_model": "bench", "base_model_hash": "random",
            "doc_sha256": "random", "n": str(n), "m": str(m), "num_layers": str(cfg.num_hidden_layers),
            "num_kv_heads": str(hkv), "head_dim": str(d), "source": "random", "dtype": "float32",
            "bias": "1" if widths is not None else "0"}
    save_file(tensors, path, metadata=meta)


def preset_sizes(preset: str, cfg, n: int) -> tuple[list[int], int]:
    """(the module plan's per-layer widths, the β-free refit's m at the same bytes and bits) for ``preset``."""
    from nectar.modules.builder import plan_from_config
    from nectar.schemas import load_config
    from nectar.states import method_plan

    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    plan = plan_from_config(load_config(preset).train.module, num_layers=cfg.num_hidden_layers,
                            num_kv_heads=cfg.num_key_value_heads, head_dim=d, n_context=n, scaling=d ** -0.5)
    return list(plan.quad_pairs), method_plan("attention_matching_kv", plan, plan.bits).quad_pairs[0]


def one_request(url: str, body: dict, out: list, i: int) -> None:
    t0 = time.perf_counter()
    req = urllib.request.Request(url + "/v1/completions", json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    stamps = []  # arrival time of every streamed token
    with urllib.request.urlopen(req, timeout=3600) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk["choices"] and chunk["choices"][0].get("text") is not None:
                stamps.append(time.perf_counter())
    out[i] = (stamps[0] - t0, len(stamps), time.perf_counter() - t0, stamps)


def metric_values(url: str) -> dict[str, float]:
    """vLLM's Prometheus gauges/counters of interest, summed over their labels."""
    want = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
            "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
    got = dict.fromkeys(want, 0.0)
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in got:
                got[name] += float(line.rsplit(" ", 1)[1])
    return got


class Watch:
    """While a burst runs: the server's scheduler state (polled from /metrics) and its CPU seconds."""

    def __init__(self, url: str, pid: int):
        self.url, self.pid, self.samples, self.stop = url, pid, [], threading.Event()
        self.before, self.cpu0 = metric_values(url), cpu_seconds(pid)
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        while not self.stop.wait(0.5):
            try:
                self.samples.append(metric_values(self.url))
            except OSError:
                pass

    def finish(self) -> dict:
        self.stop.set()
        self.thread.join()
        after, cpu = metric_values(self.url), cpu_seconds(self.pid) - self.cpu0
        top = lambda k: max((s[k] for s in self.samples), default=float("nan"))  # noqa: E731
        queries = after["vllm:prefix_cache_queries_total"] - self.before["vllm:prefix_cache_queries_total"]
        hits = after["vllm:prefix_cache_hits_total"] - self.before["vllm:prefix_cache_hits_total"]
        return {"max_running": top("vllm:num_requests_running"), "max_waiting": top("vllm:num_requests_waiting"),
                "max_kv_cache_usage": top("vllm:kv_cache_usage_perc"),
                "preemptions": after["vllm:num_preemptions_total"] - self.before["vllm:num_preemptions_total"],
                "prefix_cache_hit_rate": hits / queries if queries else float("nan"), "server_cpu_s": cpu}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its descendants (vLLM forks its engine core)."""
    import psutil

    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return sum(sum(p.cpu_times()[:2]) for p in procs if p.is_running())


def burst(url: str, bodies: list[dict], pid: int | None = None) -> dict:
    out: list = [None] * len(bodies)
    threads = [threading.Thread(target=one_request, args=(url, b, out, i)) for i, b in enumerate(bodies)]
    watch = Watch(url, pid) if pid else None
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttft = sorted(o[0] for o in out)
    tokens = sum(o[1] for o in out)
    # decode step time: gaps between a request's successive tokens while every request is in flight
    # (after the last first token, before the first request ends)
    lo, hi = max(o[3][0] for o in out), min(o[3][-1] for o in out)
    gaps = sorted(b - a for o in out for a, b in zip(o[3], o[3][1:]) if a >= lo and b <= hi)
    row = {"clients": len(bodies), "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
           "ttft_mean_s": statistics.mean(ttft), "ttft_p50_s": ttft[len(ttft) // 2],
           "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))],
           "step_p50_s": gaps[len(gaps) // 2] if gaps else float("nan"), "step_gaps": len(gaps),
           "loadavg_1m": (load0 + os.getloadavg()[0]) / 2}
    if watch:
        row.update(watch.finish())
        row["cpu_s_per_token"] = row["server_cpu_s"] / tokens
    return row


def bytes_per_step(cfg, dtype: str, contexts: list[int]) -> dict[str, float]:
    """What one decode step must read at least: every weight once + each sequence's whole KV cache
    (the CPU kernel reads a shared prefix once per sequence), and its floating-point work."""
    size = 2 if dtype in ("bfloat16", "float16") else 4
    hkv, layers = cfg.num_key_value_heads, cfg.num_hidden_layers
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    h, inter, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    per_layer = h * (cfg.num_attention_heads * d) * 2 + h * hkv * d * 2 + 3 * h * inter  # q,o + k,v + mlp
    params = layers * per_layer + vocab * h  # the (tied) output projection is read every step
    kv_token = 2 * layers * hkv * d * size
    linear_flops = 2 * params * len(contexts)
    attn_flops = sum(4 * layers * cfg.num_attention_heads * d * c for c in contexts)
    return {"weights_gb": params * size / 1e9, "kv_gb": kv_token * sum(contexts) / 1e9,
            "linear_gflop": linear_flops / 1e9, "attention_gflop": attn_flops / 1e9}


def read_bandwidth_gb_s(gb: float = 1.0, repeats: int = 5) -> float:
    """This machine's streaming read bandwidth as torch sees it (a sum over a large bf16 tensor)."""
    x = torch.ones(int(gb * 1e9 / 2), dtype=torch.bfloat16)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return gb / best


def run_server(spec, log) -> VLLMServer:
    ensure_plugin(interpreter(build=False))  # the same plugin `nectar serve --engine vllm` installs
    server = VLLMServer(spec, log, python=interpreter(build=False), startup_timeout_s=3600)
    t0 = time.perf_counter()
    server.start()
    print(f"  healthy after {time.perf_counter() - t0:.0f} s ({log})", flush=True)
    return server


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(embedded_smollm2_dir()))
    ap.add_argument("--doc-tokens", type=int, default=8064)
    ap.add_argument("--rho", type=float, default=0.05, help="without --preset: the state's m = ρ·n")
    ap.add_argument("--preset", default="cpu", help="size the states as this preset's module and its refit "
                    "('' : m = ρ·n for the state, the backend needs a preset)")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-gib", type=int, default=2)
    ap.add_argument("--enforce-eager", action="store_true", help="both servers without torch.compile")
    ap.add_argument("--systems", default="state,full")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="both servers' running batch (default --clients)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="both servers' tokens per step")
    ap.add_argument("--cpu-bind", default=f"0-{os.cpu_count() - 1}",
                    help="both servers' VLLM_CPU_OMP_THREADS_BIND (default every core; 'auto': vLLM's own)")
    ap.add_argument("--out", default=None, help="JSON results file")
    args = ap.parse_args()

    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(args.model)
    tok = AutoTokenizer.from_pretrained(args.model)
    pid, _ = placeholder_token(tok)
    n, m = args.doc_tokens, max(1, round(args.rho * args.doc_tokens))
    widths = None
    if args.preset:
        widths, m = preset_sizes(args.preset, cfg, n)
    g = torch.Generator().manual_seed(1)
    # A document of n ordinary tokens (random ids from the vocabulary's word range: speed only).
    document = torch.randint(1000, min(len(tok), 40000), (n,), generator=g).tolist()
    questions = [tok(f"Question {i}: what does the document say about item {i}?", add_special_tokens=False)["input_ids"]
                 for i in range(args.clients)]
    common = {"max_tokens": args.new_tokens, "temperature": 0.0, "ignore_eos": True}
    tmp = tempfile.mkdtemp(prefix="bench_serve_vllm_")
    results = {"model": args.model, "n": n, "m": m, "preset": args.preset, "backend_widths": widths,
               "clients": args.clients, "new_tokens": args.new_tokens,
               "dtype": args.dtype, "enforce_eager": args.enforce_eager, "cpus": os.cpu_count(),
               "loadavg_start": os.getloadavg()[0], "max_num_seqs": args.max_num_seqs or args.clients,
               "max_num_batched_tokens": args.max_num_batched_tokens, "kv_cache_gib": args.kv_cache_gib,
               "cpu_bind": args.cpu_bind,
               "read_bandwidth_gb_s": read_bandwidth_gb_s()}
    limits = {"max_num_seqs": args.max_num_seqs or args.clients, "max_num_batched_tokens": args.max_num_batched_tokens}
    window = n + max(map(len, questions)) + args.new_tokens  # SmolLM2: at most 8,192
    for system in args.systems.split(","):
        port = free_port()
        bind = None if args.cpu_bind == "auto" else args.cpu_bind
        settings = dict(served_name="bench", port=port, dtype=args.dtype, enforce_eager=args.enforce_eager,
                        kv_cache_gib=args.kv_cache_gib, cpu_bind=bind, **limits)
        if system == "state":
            state = os.path.join(tmp, "state.safetensors")
            random_state(state, cfg, m, n)
            spec = state_server_spec(args.model, [ServedDocument("bench", state, m)], pid, max_model_len=m + window - n,
                                     **settings)
            bodies = [{"model": "bench", "prompt": [pid] * m + q, "cache_salt": "bench", **common} for q in questions]
        elif system == "backend":
            if widths is None:
                raise SystemExit("--systems backend needs --preset (its per-layer widths)")
            mb = max(widths)
            state = os.path.join(tmp, "backend.safetensors")
            random_state(state, cfg, mb, n, widths=widths)
            spec = state_server_spec(args.model, [ServedDocument("bench", state, mb, bias=True)], pid,
                                     max_model_len=mb + window - n, **settings)
            bodies = [{"model": "bench", "prompt": [pid] * mb + q, "cache_salt": "bench", **common} for q in questions]
        else:
            spec = state_server_spec(args.model, [], pid, max_model_len=window, **settings)  # plain vLLM: no connector
            bodies = [{"model": "bench", "prompt": document + q, **common} for q in questions]
        print(f"{system}: starting vLLM on port {port}", flush=True)
        server = run_server(spec, os.path.join(tmp, f"{system}.log"))
        try:
            warm = burst(server.root_url, [{**bodies[0], "max_tokens": 1}])  # fills the prefix cache
            results[system] = {"warmup_ttft_s": warm["ttft_mean_s"], **burst(server.root_url, bodies, server.proc.pid)}
        finally:
            server.stop()
        if system == "backend":  # the state read once per step (float32), each request's own tokens
            own = bytes_per_step(cfg, args.dtype, [len(q) + args.new_tokens // 2 for q in questions])
            state_gb = 2 * sum(widths) * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4 / 1e9
            bound = {**own, "kv_gb": own["kv_gb"] + state_gb, "attention_gflop": own["attention_gflop"] + sum(
                4 * cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads) * w for w in widths)
                * len(questions) / 1e9}
        else:
            prefix = m if system == "state" else n
            bound = bytes_per_step(cfg, args.dtype, [prefix + len(q) + args.new_tokens // 2 for q in questions])
        bound["read_s"] = (bound["weights_gb"] + bound["kv_gb"]) / results["read_bandwidth_gb_s"]
        results[system]["per_step"] = bound
        print(f"  {system}: {json.dumps(results[system])}", flush=True)
    for system in ("state", "backend"):
        if system in results and "full" in results:
            key = "" if system == "state" else "backend_"
            results[f"{key}tok_s_ratio"] = results[system]["tok_s"] / results["full"]["tok_s"]
            results[f"{key}ttft_ratio"] = results[system]["ttft_mean_s"] / results["full"]["ttft_mean_s"]
    if "state" in results and "backend" in results:
        results["backend_vs_state_tok_s"] = results["backend"]["tok_s"] / results["state"]["tok_s"]
    results["loadavg_end"] = os.getloadavg()[0]
    print(json.dumps(results, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    with handling_signals():  # SIGTERM/Ctrl-C raise, so each server's `finally: server.stop()` runs
        main()
