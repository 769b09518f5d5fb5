"""Load benchmark of ``nectar serve``: requests/s and tokens/s at concurrency 1 and 8 against a local
server process, next to the same questions answered without a server.

Systems (the same questions, greedy, up to --max-tokens each):
  ask-sequential   in-process, one question at a time through the decode engine, as ``nectar ask``
                   does (batch 1): the baseline — what an application got before ``nectar serve``
  engine-batch-B   in-process, B questions per call of the same engine (no HTTP, no queue): the
                   most the server's batching can reach on this machine
  serve c=C        a real ``nectar serve`` process on localhost, C clients in flight (the ``openai``
                   async client), non-streamed; tokens counted from the server's usage fields
Prints each system's requests/s, tokens/s and mean latency, then the ratios serve vs ask-sequential
(what batching buys) and serve vs engine-batch (what HTTP, queueing and detokenizing cost).

    python benchmarks/bench_serve.py                     # embedded SmolLM2-135M, pydoc:naming, cpu-preset module
    python benchmarks/bench_serve.py --model tiny        # the tiny random Llama (seconds)
    python benchmarks/bench_serve.py --run-dir runs/<doc-id>/<run-id>   # a trained run as it is

Without --run-dir the module is the run preset's architecture and budget with random weights (speed
depends on the shapes alone; answers are not meaningful), saved in a temporary run directory.
Client and server share the machine's cores: on a 2-core machine the client's own work is part of
what the figures measure.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

QUESTIONS = [
    "What does a name refer to?", "What is a code block?", "Where are free variables resolved?",
    "What does the global statement do?", "How are class blocks scoped?", "What is a binding?",
    "When is a NameError raised?", "What does nonlocal do?", "What is an execution frame?",
    "How do comprehensions scope their names?", "What is the builtins namespace?",
    "What happens on `del` of a name?", "Summarize the section on resolution of names.",
    "What is an UnboundLocalError?", "How do eval and exec see names?", "Quote the first sentence.",
]


def make_run(model: str, document: str, root: Path) -> str:
    """A run directory holding a random-weight module of the preset's shape (timing only)."""
    from nectar.layout import build_layout
    from nectar.base_model import load_base_model
    from nectar.modules import build_module, make_spec, plan_from_config, save_module
    from nectar.orchestration import prepare_run
    from nectar.schemas.presets import load_config

    cfg = load_config("tiny" if model == "tiny" else "cpu")
    ctx = prepare_run(document, cfg, str(root / "run"))
    base = load_base_model(cfg.model)
    n = build_layout(base.tokenizer, ctx.text).n
    plan = plan_from_config(cfg.train.module, base.num_layers, base.num_kv_heads, base.head_dim, n, base.scaling)
    module = build_module(plan)
    save_module(module, make_spec(module, plan, base.name, base.weights_hash, ctx.info.sha256, base.num_q_heads),
                ctx.run.url("train"))
    return ctx.run.root


def in_process(run_dir: str, questions: list[str], max_tokens: int, batch: int) -> dict[str, dict]:
    from nectar.attention.engine import generate
    from nectar.modules.provider import ModuleDocState
    from nectar.serving.loader import load_served_module

    served = load_served_module(run_dir)
    provider = ModuleDocState(served.module)
    prompts = [served.layout.prompt(q).ids for q in questions]
    generate(served.base, provider, served.n_context, prompts[:2], 4)  # warm-up
    out = {}
    t0, tokens, lat = time.perf_counter(), 0, []
    for p in prompts:  # `nectar ask`: one question, one engine call
        t = time.perf_counter()
        tokens += len(generate(served.base, provider, served.n_context, [p], max_tokens).tokens[0])
        lat.append(time.perf_counter() - t)
    out["ask-sequential"] = _row(len(prompts), tokens, time.perf_counter() - t0, lat)
    t0, tokens, lat = time.perf_counter(), 0, []
    for i in range(0, len(prompts), batch):
        t = time.perf_counter()
        res = generate(served.base, provider, served.n_context, prompts[i:i + batch], max_tokens)
        tokens += sum(len(r) for r in res.tokens)
        lat += [time.perf_counter() - t] * len(res.tokens)
    out[f"engine-batch-{batch}"] = _row(len(prompts), tokens, time.perf_counter() - t0, lat)
    return out


def _row(requests: int, tokens: int, seconds: float, latencies: list[float]) -> dict:
    return {"requests": requests, "tokens": tokens, "seconds": seconds, "req_s": requests / seconds,
            "tok_s": tokens / seconds, "latency_s": statistics.mean(latencies)}


class Server:
    def __init__(self, run_dir: str, threads: int, max_batch: int, max_tokens: int, logs: Path):
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nectar.pipeline.cli", "serve", run_dir, "--port", "0", "--max-batch",
             str(max_batch), "--max-tokens", str(max_tokens)],
            stdout=(logs / "stdout.txt").open("w"), stderr=(logs / "stderr.txt").open("w"), env=env, cwd=REPO)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            lines = [ln for ln in (logs / "stdout.txt").read_text().splitlines() if " on http://" in ln]
            if lines:
                self.url = lines[0].split(" on ", 1)[1].strip()
                return
            if self.proc.poll() is not None:
                raise SystemExit(f"nectar serve exited:\n{(logs / 'stderr.txt').read_text()[-2000:]}")
            time.sleep(0.2)
        raise SystemExit("nectar serve did not start in 300 s")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(120)


async def load(url: str, questions: list[str], concurrency: int, max_tokens: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    gate = asyncio.Semaphore(concurrency)
    lat: list[float] = []

    async def one(q: str) -> int:
        async with gate:
            t = time.perf_counter()
            r = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": q}],
                                                     max_tokens=max_tokens, temperature=0)
            lat.append(time.perf_counter() - t)
            return r.usage.completion_tokens

    await asyncio.gather(*(one(q) for q in questions[:2]))  # warm-up
    lat.clear()
    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(q) for q in questions)))
    return _row(len(questions), tokens, time.perf_counter() - t0, lat)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["embedded", "tiny"], default="embedded")
    ap.add_argument("--document", default="pydoc:naming")
    ap.add_argument("--run-dir", help="serve this run instead of a random-weight module")
    ap.add_argument("--requests", type=int, default=16, help="questions per system (cycled from a list of 16)")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    print(f"load before: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f} "
          f"({os.cpu_count()} cores)", flush=True)
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.requests)]
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        run_dir = args.run_dir or make_run(args.model, args.document, Path(tmp))
        rows = in_process(run_dir, questions, args.max_tokens, args.max_batch)
        server = Server(run_dir, args.threads, args.max_batch, max(args.max_tokens, 1), Path(tmp))
        try:
            for c in (int(x) for x in args.concurrency.split(",")):
                rows[f"serve c={c}"] = asyncio.run(load(server.url, questions, c, args.max_tokens))
        finally:
            code = server.stop()
    print(f"run {run_dir}; {args.requests} requests per system, greedy, <= {args.max_tokens} tokens each; "
          f"{args.threads} torch threads; server --max-batch {args.max_batch}; server exit status {code}")
    print(f"{'system':18} {'requests':>8} {'tokens':>7} {'seconds':>8} {'req/s':>7} {'tok/s':>7} {'latency s':>9}")
    for name, r in rows.items():
        print(f"{name:18} {r['requests']:8d} {r['tokens']:7d} {r['seconds']:8.2f} {r['req_s']:7.2f} "
              f"{r['tok_s']:7.1f} {r['latency_s']:9.2f}")
    base, batch = rows["ask-sequential"], rows[f"engine-batch-{args.max_batch}"]
    for name, r in rows.items():
        if name.startswith("serve"):
            print(f"{name}: tok/s {r['tok_s'] / base['tok_s']:.2f}x ask-sequential, "
                  f"{r['tok_s'] / batch['tok_s']:.2f}x engine-batch-{args.max_batch}")
    print(f"load after: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")


if __name__ == "__main__":
    main()
