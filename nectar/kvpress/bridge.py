"""Score kvpress presses on the run's exact token sequences, through the worker in kvpress's own venv.

``score_presses`` writes what the worker needs (nectar/kvpress/worker.py's docstring has the file
protocol): the document prefix ids and every selected pair's ids exactly as ``nectar compare``
scores them, and OUR full-context model's log-probs at the scored positions (so KL is to this
project's full model, token for token). It runs the worker and turns its per-pair sums back into
``PairSums``, so a kvpress row gets the same columns, bytes and paired intervals as every other row.

Budgets follow bytes: a press at budget ρ and ``bits`` keeps the share of the document's (layer, KV
head, token) entries whose stored bytes are ρ of the document KV cache at the model's dtype, so int4
(0.5625 bytes a value with its fp16 scale and zero per 64 values) keeps 7.1× more entries than fp32.
"""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..attention.exact import ExactDocState
from ..attention.forward import query_logits
from ..evaluation.teacher import EvalPair, PairSums
from ..quantization import quantized_nbytes
from ..base_model import BaseLM, cache_dir, embedded_smollm2_dir
from ..schemas.config import ModelConfig
from . import worker
from .env import KvpressEnvError, ensure_env

WORKER = Path(worker.__file__)
QUANTIZATION_PY = Path(__file__).resolve().parents[1] / "quantization.py"  # the worker loads it by path
# Largest per-token KL(ours ‖ kvpress) the guard accepts on the uncompressed cache: the two models run
# the same float32 weights through different attention code, which leaves ~1e-6 nats; a wrong model,
# tokenization or position is orders of magnitude above.
GUARD_TOLERANCE = 1e-3
DEFAULT_GROUP = 64


class KvpressError(RuntimeError):
    """The kvpress rows cannot be produced (one line: why, and the fix)."""


@dataclass(frozen=True)
class PressJob:
    key: str  # the comparison's job key, e.g. "kvpress:kvzip@0.05"
    press: str  # a name of worker.PRESSES
    rho: float  # share of the document KV cache's bytes
    bits: int = 32  # storage precision of the kept keys and values (32, 8, 4)
    group: int = DEFAULT_GROUP


@dataclass
class PressResult:
    sums: PairSums
    press_s: float  # document → compressed (and quantized) cache
    score_s: float
    kept_entries: int
    state_bytes: int


@dataclass
class BridgeResult:
    results: dict[str, PressResult] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # job key → why it has no row
    guard_max_kl: float | None = None
    facts: dict = field(default_factory=dict)


def entry_bytes(head_dim: int, bits: int, group: int = DEFAULT_GROUP) -> int:
    """Stored bytes of one (layer, KV head, token) entry: its key and value rows at ``bits``."""
    return 2 * quantized_nbytes((head_dim,), bits, group)  # bits 32: plain float32


def compression_ratio(rho: float, head_dim: int, bits: int, group: int = DEFAULT_GROUP,
                      kv_bytes_per_value: int = 4) -> float:
    """kvpress's ``compression_ratio`` (share of entries dropped) for a byte budget ρ at ``bits``."""
    kept = rho * 2 * head_dim * kv_bytes_per_value / entry_bytes(head_dim, bits, group)
    if not 0 < kept < 1:
        raise KvpressError(f"ρ = {rho:g} at {bits} bits keeps {kept:.0%} of the document's entries; a press needs "
                           "a share in (0, 1): lower ρ or raise the bits")
    return 1.0 - kept


def model_folder(base: BaseLM, cfg: ModelConfig) -> Path:
    """A folder kvpress can load the run's model from: the embedded model's converted folder, the
    run's own model folder, or (a tiny in-memory model) a copy saved once under the cache."""
    if cfg.name == "embedded:smollm2-135m":
        return embedded_smollm2_dir()
    path = Path(cfg.name).expanduser()
    if path.is_dir():
        return path
    target = cache_dir() / "kvpress-models" / base.weights_hash[:16]
    if not (target / "config.json").exists():
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        base.model.save_pretrained(tmp)
        base.tokenizer.save_pretrained(tmp)
        tmp.rename(target)
    return target


def scored_rows(pair: EvalPair) -> int:
    """Response tokens of a pair (rows of the reference): logits t−1 score token t ≥ response_start."""
    return len(pair.ids) - pair.response_start


@torch.no_grad()
def write_reference(base: BaseLM, doc_kv, pairs: list[EvalPair], n: int, path: Path) -> int:
    """OUR full-context log-probs at every scored position, float32 [K, V] (pairs in order)."""
    provider = ExactDocState(doc_kv)
    k = sum(scored_rows(p) for p in pairs)
    vocab = base.model.get_output_embeddings().weight.shape[0]
    ref = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(k, vocab))
    row = 0
    for p in pairs:
        ids = torch.tensor([p.ids], dtype=torch.long, device=base.device)  # [1, m]
        logits = query_logits(base, provider, ids, n)[0]  # [m, V]
        rows = torch.arange(p.response_start - 1, len(p.ids) - 1, device=base.device)
        ref[row: row + len(rows)] = torch.log_softmax(logits[rows].float(), dim=-1).cpu().numpy()
        row += len(rows)
    ref.flush()
    del ref
    return k


def request(base: BaseLM, model_dir: Path, doc_ids: list[int], pairs: list[EvalPair],
            jobs: list[PressJob], threads: int | None, score_once: bool = True) -> tuple[dict, dict[str, str]]:
    """The worker's request, and {job key: why} for the jobs no press can run (e.g. a byte budget
    that keeps more than every entry at that precision): those are left out, the others run.
    ``score_once``: KVzip's jobs share one scoring pass (the worker's SCORED_ONCE; the same masks)."""
    bytes_per_value = torch.finfo(base.dtype).bits // 8
    ratios, errors = {}, {}
    for j in jobs:
        try:
            ratios[j.key] = compression_ratio(j.rho, base.head_dim, j.bits, j.group, bytes_per_value)
        except KvpressError as exc:
            errors[j.key] = str(exc)
    runnable = [j for j in jobs if j.key in ratios]
    req = {
        "model_dir": str(model_dir), "dtype": str(base.dtype).removeprefix("torch."),
        "doc_ids": list(map(int, doc_ids)), "tolerance": GUARD_TOLERANCE, "threads": threads,
        "score_once": score_once,
        "quantization_py": str(QUANTIZATION_PY) if any(j.bits != 32 for j in runnable) else None,
        "pairs": [{"pair_id": p.pair_id, "ids": list(map(int, p.ids)), "response_start": p.response_start}
                  for p in pairs],
        **rope_request(base),
        "jobs": [{"key": j.key, "press": j.press, "bits": j.bits, "group": j.group, "compression_ratio": ratios[j.key]}
                 for j in runnable],
    }
    return req, errors


def rope_request(base: BaseLM) -> dict:
    """The RoPE our model runs with, for the worker to load the model folder with: a run's
    ``model.yarn_factor`` / ``model.rope_scaling`` is applied at load (base_model.apply_rope_scaling),
    not written into the folder (the embedded model's folder is its own), and a folder saved from a
    tiny model may carry another run's scaling. Without it the positions rotate differently and the
    guard refuses every row (KL 4.6 at 7.7k tokens under YaRN ×2)."""
    config = base.model.config
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:  # a config without rope_parameters (transformers < 5): the folder's own is all there is
        return {}
    return {"rope_parameters": params, "max_position_embeddings": int(config.max_position_embeddings)}


def run_worker(python: Path, workdir: Path, timeout_s: float | None = None) -> dict:
    """Run the worker in kvpress's venv; its stderr goes to WORKDIR/worker.log."""
    log_path = workdir / "worker.log"
    with open(log_path, "w") as log:
        proc = subprocess.run([str(python), str(WORKER), str(workdir)], stdout=log, stderr=subprocess.STDOUT,
                              timeout=timeout_s)
    if proc.returncode != 0:
        lines = [ln for ln in log_path.read_text().splitlines() if ln.strip()]
        raise KvpressError(f"the kvpress worker failed ({lines[-1].strip()[:300] if lines else 'no output'}); "
                           f"full log: {log_path}")
    return json.loads((workdir / "result.json").read_text())


def parse_result(raw: dict, jobs: list[PressJob]) -> BridgeResult:
    out = BridgeResult(guard_max_kl=raw["guard"]["max_token_kl"],
                       facts={k: raw.get(k) for k in ("kvpress_version", "transformers_version", "torch_version",
                                                      "prefill_s", "guard", "unavailable")})
    if raw.get("refused"):
        out.errors = {j.key: raw["refused"] for j in jobs}
        return out
    for j in jobs:
        r = raw["jobs"].get(j.key) or {"error": "no result from the worker"}
        if "error" in r:
            out.errors[j.key] = r["error"]
            continue
        s = r["sums"]
        sums = PairSums(*(np.asarray(s[k], dtype=np.float64) for k in ("correct", "nll", "kl", "n")))
        out.results[j.key] = PressResult(sums, r["press_s"], r["score_s"], int(r["kept_entries"]),
                                         int(r["state_bytes"]))
    return out


def score_presses(base: BaseLM, cfg: ModelConfig, doc_ids: list[int], doc_kv, pairs: list[EvalPair],
                  jobs: list[PressJob], workdir: str | Path, threads: int | None = None,
                  log: Callable[[str], None] = print, model_dir: str | Path | None = None,
                  score_once: bool = True) -> BridgeResult:
    """Every press job's per-pair sums on ``pairs`` (raises KvpressEnvError / KvpressError).
    ``model_dir``: the folder kvpress loads (default: the run's model, ``model_folder``); ``score_once``:
    see ``request``."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    env = ensure_env(log=log)
    req, skipped = request(base, Path(model_dir) if model_dir else model_folder(base, cfg), doc_ids, pairs, jobs,
                           threads, score_once)
    (workdir / "request.json").write_text(json.dumps(req))
    t0 = time.perf_counter()
    ref = workdir / "reference.npy"
    k = write_reference(base, doc_kv, pairs, len(doc_ids), ref)
    log(f"kvpress: reference log-probs of {len(pairs)} pairs ({k} tokens) in {time.perf_counter() - t0:.0f} s; "
        f"{len(jobs)} press jobs in {env.root}")
    try:
        raw = run_worker(env.python, workdir)
    finally:
        ref.unlink(missing_ok=True)  # [K, V] float32: ~0.2 MB a token, not worth keeping
    out = parse_result(raw, [j for j in jobs if j.key not in skipped])
    out.errors.update(skipped)
    out.facts["env"] = {"root": str(env.root), **env.facts}
    if math.isfinite(out.guard_max_kl or math.nan):
        log(f"kvpress guard: largest per-token KL to this project's full model {out.guard_max_kl:.2e} "
            f"(tolerance {GUARD_TOLERANCE:g})")
    return out


__all__ = ["BridgeResult", "KvpressEnvError", "KvpressError", "PressJob", "PressResult", "score_presses",
           "compression_ratio", "GUARD_TOLERANCE"]
