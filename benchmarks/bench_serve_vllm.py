"""vLLM serving a document's state vs vLLM serving the full document, same machine, one run.

Both servers run the same base model (default: the embedded SmolLM2-135M) with prefix caching on;
they run one after the other, never together. Each answers ``--clients`` concurrent streaming
``/v1/completions`` requests of ``--new-tokens`` tokens (no stop) about a document of ``--doc-tokens``
tokens:

  state  the NECTAR KV connector with an m = ρ·n pseudo-token state (``nectar.serving.vllm_connector``);
         prompt = m placeholders + the question. The state's keys/values are RANDOM (seeded) — its
         size, not its content, sets the speed.
  full   plain vLLM; prompt = the document's n tokens + the question; one warm-up request first,
         so every timed request finds the document in vLLM's prefix cache.

Reported per system: output tokens/s over the whole burst (all clients' tokens / wall time), mean and
p50/p90 time-to-first-token, and the ratio state/full.

    python benchmarks/bench_serve_vllm.py --doc-tokens 8064 --clients 32 --new-tokens 64
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
from nectar.serving.vllm_engine import (ServedDocument, VLLMServer, free_port, placeholder_token, server_command,
                                        server_env)
from nectar.serving.vllm_format import STATE_FORMAT, STATE_VERSION


def random_state(path: str, cfg, m: int, n: int, seed: int = 0) -> None:
    """A state file of the right shape for ``cfg`` (a transformers config) with seeded random KV."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    hkv = cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    tensors = {}
    for i in range(cfg.num_hidden_layers):
        tensors[f"k.{i}"] = torch.randn(hkv, m, d, generator=g)  # [hkv, m, d]
        tensors[f"v.{i}"] = torch.randn(hkv, m, d, generator=g)
    meta = {"format": STATE_FORMAT, "version": STATE_VERSION, "base_model": "bench", "base_model_hash": "random",
            "doc_sha256": "random", "n": str(n), "m": str(m), "num_layers": str(cfg.num_hidden_layers),
            "num_kv_heads": str(hkv), "head_dim": str(d), "source": "random", "dtype": "float32"}
    save_file(tensors, path, metadata=meta)


def one_request(url: str, body: dict, out: list, i: int) -> None:
    t0 = time.perf_counter()
    req = urllib.request.Request(url + "/v1/completions", json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    first, tokens = None, 0
    with urllib.request.urlopen(req, timeout=3600) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk["choices"] and chunk["choices"][0].get("text") is not None:
                if first is None:
                    first = time.perf_counter() - t0
                tokens += 1
    out[i] = (first, tokens, time.perf_counter() - t0)


def burst(url: str, bodies: list[dict]) -> dict:
    out: list = [None] * len(bodies)
    threads = [threading.Thread(target=one_request, args=(url, b, out, i)) for i, b in enumerate(bodies)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttft = sorted(o[0] for o in out)
    tokens = sum(o[1] for o in out)
    return {"clients": len(bodies), "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
            "ttft_mean_s": statistics.mean(ttft), "ttft_p50_s": ttft[len(ttft) // 2],
            "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))]}


def run_server(cmd, env, log, port) -> VLLMServer:
    server = VLLMServer(cmd, env, log, port)
    t0 = time.perf_counter()
    server.wait_healthy(3600)
    print(f"  healthy after {time.perf_counter() - t0:.0f} s ({log})", flush=True)
    return server


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(embedded_smollm2_dir()))
    ap.add_argument("--doc-tokens", type=int, default=8064)
    ap.add_argument("--rho", type=float, default=0.05)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-gib", type=int, default=2)
    ap.add_argument("--enforce-eager", action="store_true", help="both servers without torch.compile")
    ap.add_argument("--systems", default="state,full")
    ap.add_argument("--out", default=None, help="JSON results file")
    args = ap.parse_args()

    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(args.model)
    tok = AutoTokenizer.from_pretrained(args.model)
    pid, _ = placeholder_token(tok)
    n, m = args.doc_tokens, max(1, round(args.rho * args.doc_tokens))
    g = torch.Generator().manual_seed(1)
    # A document of n ordinary tokens (random ids from the vocabulary's word range: speed only).
    document = torch.randint(1000, min(len(tok), 40000), (n,), generator=g).tolist()
    questions = [tok(f"Question {i}: what does the document say about item {i}?", add_special_tokens=False)["input_ids"]
                 for i in range(args.clients)]
    common = {"max_tokens": args.new_tokens, "temperature": 0.0, "ignore_eos": True}
    tmp = tempfile.mkdtemp(prefix="bench_serve_vllm_")
    results = {"model": args.model, "n": n, "m": m, "clients": args.clients, "new_tokens": args.new_tokens,
               "dtype": args.dtype, "enforce_eager": args.enforce_eager, "cpus": os.cpu_count(),
               "loadavg_start": os.getloadavg()[0]}
    window = n + max(map(len, questions)) + args.new_tokens  # SmolLM2: at most 8,192
    for system in args.systems.split(","):
        port = free_port()
        if system == "state":
            state = os.path.join(tmp, "state.safetensors")
            random_state(state, cfg, m, n)
            cmd = server_command(args.model, [ServedDocument("bench", state, m)], pid, port, served_name="bench",
                                 dtype=args.dtype, max_model_len=m + window - n, enforce_eager=args.enforce_eager)
            bodies = [{"model": "bench", "prompt": [pid] * m + q, "cache_salt": "bench", **common} for q in questions]
        else:
            cmd = server_command(args.model, [], pid, port, served_name="bench", dtype=args.dtype,
                                 max_model_len=window, enforce_eager=args.enforce_eager)
            i = cmd.index("--kv-transfer-config")
            cmd = cmd[:i] + cmd[i + 2:]  # plain vLLM: no connector
            bodies = [{"model": "bench", "prompt": document + q, **common} for q in questions]
        print(f"{system}: starting vLLM on port {port}", flush=True)
        server = run_server(cmd, server_env(args.kv_cache_gib), os.path.join(tmp, f"{system}.log"), port)
        try:
            warm = burst(server.url, [{**bodies[0], "max_tokens": 1}])  # fills the prefix cache
            results[system] = {"warmup_ttft_s": warm["ttft_mean_s"], **burst(server.url, bodies)}
        finally:
            server.stop()
        print(f"  {system}: {json.dumps(results[system])}", flush=True)
    if "state" in results and "full" in results:
        results["tok_s_ratio"] = results["state"]["tok_s"] / results["full"]["tok_s"]
        results["ttft_ratio"] = results["state"]["ttft_mean_s"] / results["full"]["ttft_mean_s"]
    results["loadavg_end"] = os.getloadavg()[0]
    print(json.dumps(results, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
