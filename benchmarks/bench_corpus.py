"""Documents per hour through Prefect: one corpus, 1 worker then 2 workers, back to back.

    python benchmarks/bench_corpus.py --preset tiny --docs 4 --workers 1,2 [--out bench_corpus.json]

Starts a real Prefect server (SQLite in a temporary PREFECT_HOME, 127.0.0.1), runs ``nectar deploy``,
then for each worker count: that many ``prefect worker start --limit 1`` processes, ``nectar
trigger`` of a corpus of ``--docs`` CPython reference topics (each worker count gets a fresh runs
root, so nothing is cached) followed to the end, and the wall time from trigger to the last
document done. Prints one JSON line per worker count with the load average before and after.
Everything it starts is stopped by its pid.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
TOPICS = ("naming", "function", "calls", "numeric-types", "typesseq-mutable", "sequence-types", "operator-summary",
          "try")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(home: Path, api: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               PREFECT_WORKER_QUERY_SECONDS="1", PREFECT_WORKER_PREFETCH_SECONDS="5")
    if api:
        env["PREFECT_API_URL"] = api
    return env


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    # A timeout's SIGTERM must still stop the server and workers (the finally below), not orphan them.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from pydoc_data.topics import topics

    work = Path(tempfile.mkdtemp(prefix="nectar-bench-corpus-"))
    home, port = work / "prefect", _port()
    api = f"http://127.0.0.1:{port}/api"
    procs: list[subprocess.Popen] = []
    results = []
    try:
        server_env = _env(home, None) | {"PREFECT_SERVER_UI_ENABLED": "false",
                                         "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home}/db.sqlite"}
        home.mkdir(parents=True)
        server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                                   str(port), "--analytics-off"], env=server_env, stdout=open(work / "server.log", "w"),
                                  stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(server)
        for _ in range(240):
            try:
                if httpx.get(f"{api}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        docs = work / "docs"
        docs.mkdir()
        for name in TOPICS[: args.docs]:
            (docs / f"{name}.txt").write_text(topics[name])
        nectar = [sys.executable, "-m", "nectar.pipeline.cli"]
        subprocess.run([*nectar, "deploy", "--pool", "bench", "--preset", args.preset, "--working-dir", str(work)],
                       env=_env(home, api), check=True, capture_output=True)
        for n in (int(x) for x in args.workers.split(",")):
            workers = [subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", "bench", "--type",
                                         "process", "--name", f"w{n}-{i}", "--limit", "1"], env=_env(home, api),
                                        cwd=work, stdout=open(work / f"worker-{n}-{i}.log", "w"),
                                        stderr=subprocess.STDOUT, start_new_session=True) for i in range(n)]
            procs.extend(workers)
            time.sleep(5)  # workers registered and polling
            load0, t0 = os.getloadavg(), time.monotonic()
            done = subprocess.run([*nectar, "trigger", str(docs), "--runs", str(work / f"runs-{n}"), "--wait",
                                   "--corpus", f"bench-{n}", "--timeout", "7200"], env=_env(home, api),
                                  capture_output=True, text=True)
            wall = time.monotonic() - t0
            row = {"preset": args.preset, "docs": args.docs, "workers": n, "wall_s": round(wall, 1),
                   "docs_per_hour": round(args.docs * 3600 / wall, 1), "rc": done.returncode,
                   "load_before": [round(x, 2) for x in load0], "load_after": [round(x, 2) for x in os.getloadavg()],
                   "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            print(json.dumps(row), flush=True)
            if done.returncode != 0:
                print(done.stdout[-3000:], done.stderr[-3000:], file=sys.stderr)
            results.append(row)
            for w in workers:
                _stop(w)
    finally:
        for p in reversed(procs):
            _stop(p)
        shutil.rmtree(work, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
