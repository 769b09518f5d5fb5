"""What checking a cached stage costs: re-reading and hashing every output byte (issue 13).

Builds a targets group shaped like the ``cpu`` preset's (SmolLM2-135M: 30 layers, 9 query heads,
d = 64, top-K 32; 2876 query tokens, chunk 64 / shard 1024 tokens, the real ``create_targets`` layout
with crc32c codecs) filled with random values — the bytes and files the check reads are the same as
a real run's — then runs it through ``run_stage`` and times:

* ``record``   the manifest's digests when the stage completes (every Zarr file read back once;
               atomic_write's files are digested as they are written)
* ``check``    the cached-stage check: every file re-read and re-hashed (warm page cache, the usual
               case right after a run, and cold: each file evicted with posix_fadvise first)
* ``memo``     the same check again in the same process: files already hashed by this process and
               unchanged since (same inode, size, mtime, ctime) are not read again
* ``stat``     the rejected alternative, sizes and mtimes only (cannot see a same-size zeroed shard)
* ``bound``    sha256 of the same bytes from memory, one core: the floor for a full content check

    python benchmarks/bench_integrity.py                 # ~400 MB, the cpu preset's targets
    python benchmarks/bench_integrity.py --tokens 10000  # bigger
    python benchmarks/bench_integrity.py --existing runs/<doc>/<run>/targets/targets.zarr   # a real one, read only
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import tempfile
import time

import numpy as np


def build_group(stage_dir: str, tokens: int, seed: int = 0) -> int:
    from nectar.schemas.artifacts import TargetsHeader
    from nectar.targets.store import create_targets

    L, H, d, K = 30, 9, 64, 32
    header = TargetsHeader(model="embedded:smollm2-135m", model_hash="bench", doc_sha256="bench", n_context=1528,
                           num_layers=L, num_q_heads=H, num_kv_heads=3, head_dim=d, scaling=d ** -0.5, top_k=K,
                           dtype="float32", n_pairs=32, n_tokens=tokens, split_pairs={"train": 26, "test": 6})
    g = create_targets(f"{stage_dir}/targets.zarr", header, chunk_tokens=64, shard_tokens=1024)
    rng = np.random.default_rng(seed)
    shard = g["q"].shards[0]
    for start in range(0, tokens, shard):
        stop = min(tokens, start + shard)
        n = stop - start
        g["q"][start:stop] = rng.standard_normal((n, L, H, d), dtype=np.float32)
        g["A"][start:stop] = rng.standard_normal((n, L, H, d), dtype=np.float32)
        g["alpha"][start:stop] = rng.standard_normal((n, L, H), dtype=np.float32)
        g["topk_ids"][start:stop] = rng.integers(0, 49152, (n, K), dtype=np.int32)
        g["topk_logprobs"][start:stop] = -rng.random((n, K), dtype=np.float32)
        g["token_ids"][start:stop] = rng.integers(0, 49152, n, dtype=np.int32)
        g["positions"][start:stop] = np.arange(1528 + start, 1528 + stop, dtype=np.int32)
        g["response_mask"][start:stop] = rng.random(n) > 0.3
    g["pair_offsets"][:] = np.linspace(0, tokens, 33).astype(np.int64)
    g["pair_split"][:] = np.array([0] * 26 + [1] * 6, dtype=np.int8)
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(f"{stage_dir}/targets.zarr") for f in fs)


def evict(root: str) -> None:
    for r, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(r, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2876, help="query tokens (2876 = bench_targets' 32 pairs)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to build the run (default: a temp dir, removed after)")
    ap.add_argument("--existing", default=None, help="time digest + warm check of this file or folder instead "
                                                     "(read only, nothing written)")
    args = ap.parse_args()
    if args.existing:
        return existing(args.existing, args.repeats)

    from nectar import integrity
    from nectar.orchestration.executor import RunDir, check_stage, run_stage

    root = args.dir or tempfile.mkdtemp(prefix="bench-integrity-")
    try:
        run = RunDir(f"{root}/run")
        stage_dir = run.makedirs("targets")
        timings: dict[str, float] = {}

        def body(url: str):
            t0 = time.perf_counter()
            nbytes = build_group(url, args.tokens)
            timings["write"], timings["bytes"] = time.perf_counter() - t0, nbytes
            timings["body_end"] = time.perf_counter()
            return ["targets.zarr"], {"bytes": nbytes}

        outcome = run_stage(run, "targets", {}, {"document": "bench"}, body)
        timings["record"] = outcome.manifest.duration_s - timings["write"]  # digests + manifest write
        manifest = outcome.manifest
        nbytes, nfiles = timings["bytes"], len(manifest.files)

        cpu: dict[str, float] = {}

        def timed(fn, prepare=lambda: None, name: str = "") -> list[float]:
            out, c = [], []
            for _ in range(args.repeats):
                prepare()
                t0, c0 = time.perf_counter(), time.process_time()
                assert fn() == []
                out.append(time.perf_counter() - t0)
                c.append(time.process_time() - c0)
            cpu[name] = statistics.median(c)
            return out

        def clear_memo() -> None:
            integrity._MEMO.clear()

        warm = timed(lambda: check_stage(run, "targets", manifest), clear_memo, "warm")
        cold = timed(lambda: check_stage(run, "targets", manifest), lambda: (clear_memo(), evict(stage_dir)), "cold")
        check_stage(run, "targets", manifest)
        memo = timed(lambda: check_stage(run, "targets", manifest), name="memo")

        def stat_only() -> list:
            bad = []
            for rel, d in manifest.files.items():
                st = os.stat(f"{stage_dir}/{rel}")
                if st.st_size != d.size:
                    bad.append(rel)
            return bad

        stat = timed(stat_only, name="stat")
        blob = np.random.default_rng(1).bytes(int(nbytes))
        t0, c0 = time.perf_counter(), time.process_time()
        hashlib.sha256(blob).hexdigest()
        bound, bound_cpu = time.perf_counter() - t0, time.process_time() - c0

        mb = nbytes / 1e6
        load = os.getloadavg()
        print(f"targets group: {mb:.1f} MB in {nfiles} files ({args.tokens} tokens, SmolLM2-135M shapes, "
              f"chunk 64 / shard 1024); threads={integrity.HASH_THREADS} cpus={os.cpu_count()} "
              f"load(1m)={load[0]:.2f}; repeats={args.repeats}, median [min-max]")
        print(f"{'what':<34}{'wall s':>22}{'MB/s':>10}{'CPU s':>10}")

        def row(name: str, values: list[float], key: str) -> None:
            med = statistics.median(values)
            print(f"{name:<34}{med:>10.3f} [{min(values):.3f}-{max(values):.3f}]{mb / med:>10.0f}{cpu[key]:>10.3f}")

        print(f"{'write (build the group)':<34}{timings['write']:>10.3f}{'':>12}{mb / timings['write']:>10.0f}")
        print(f"{'record digests at completion':<34}{timings['record']:>10.3f}{'':>12}{mb / timings['record']:>10.0f}")
        row("check, warm page cache", warm, "warm")
        row("check, cold (evicted)", cold, "cold")
        row("check, memo (same process)", memo, "memo")
        row("stat only (rejected: blind)", stat, "stat")
        print(f"{'sha256 from memory, 1 core':<34}{bound:>10.3f}{'':>12}{mb / bound:>10.0f}{bound_cpu:>10.3f}")
        print(f"check warm / sha256 bound = {statistics.median(warm) / bound:.2f}x; "
              f"check warm / write = {statistics.median(warm) / timings['write']:.2f}x")
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


def existing(path: str, repeats: int) -> None:
    """Digest an existing output once, then time the warm check against those digests."""
    import fsspec

    from nectar import integrity

    fs, p = fsspec.core.url_to_fs(path)
    parent, name = p.rstrip("/").rsplit("/", 1)
    t0 = time.perf_counter()
    files = integrity.digest_outputs(fs, parent, [name])
    record = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        integrity._MEMO.clear()
        t0 = time.perf_counter()
        assert integrity.check_outputs(fs, parent, files, [name]) == []
        times.append(time.perf_counter() - t0)
    mb = sum(f.size for f in files.values()) / 1e6
    med = statistics.median(times)
    print(f"{path}: {mb:.1f} MB in {len(files)} files; load(1m)={os.getloadavg()[0]:.2f}; repeats={repeats}")
    print(f"digest once: {record:.3f} s ({mb / record:.0f} MB/s); check, warm page cache: median {med:.3f} s "
          f"[{min(times):.3f}-{max(times):.3f}] ({mb / med:.0f} MB/s)")


if __name__ == "__main__":
    main()
