"""synthesize: instruction/response pairs from each chunk with the paper's prompts (App. A.1, H).

One request per (chunk, task type) with count > 0, drawing ``samples_per_chunk`` samples (n; each
sample is a job of its own, with its own pairs and partial file): the paper's scratchpad prompt, asked as
JSON-schema structured output {"scratchpad", "pairs": [{instruction, response}] × count} so the
scratchpad still comes first; without a schema the paper's plain form "<scratchpad>…</scratchpad>
[ … ]" is parsed tolerantly. Every request's rows are written to ``partial/c{chunk}-{task}.parquet``
as soon as it finishes, so a killed run resumes without redoing finished requests. A reply that
doesn't parse becomes one row with ``parse_error`` set — counted, never dropped. A request that
failed outright (the server answered 5xx after its retries, timed out, sent garbage) is not a reply:
it is not saved, the stage fails naming it, and the re-run asks it again (as verify does).
``requests.json`` records every request's seed and sampling settings; re-runs keep finished replies
rather than sample them again, so a re-run is reproducible even where a batching server's output
depends on what else was in the batch.
"""
from __future__ import annotations

import json
from typing import Any, Callable

from ..llm import ChatBackend, ChatResult, make_request
from ..llm.parsing import find_all_json, find_json
from ..prompts import synthesis_prompt, synthesis_schema
from ..schemas.artifacts import ChunkRow, PairRow
from ..schemas.base import stable_hash
from ..schemas.config import TASK_TYPES, SynthesizeConfig, TaskType
from ..storage import atomic_write
from ..tables import write_table
from ..partial import PartialStore, ask_saving

PAIRS_FILE = "pairs.parquet"
REQUESTS_FILE = "requests.json"
# Small models name the fields differently; these are read as instruction / response.
_INSTRUCTION_KEYS = ("instruction", "question", "prompt", "query")
_RESPONSE_KEYS = ("response", "answer", "output")


class SynthesizeError(RuntimeError):
    """Some synthesis requests failed outright (server, timeout); what succeeded is saved for the re-run."""


def synthesize(chunks: list[ChunkRow], cfg: SynthesizeConfig, backend: ChatBackend, out_url: str,
               progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Write ``<out_url>/pairs.parquet`` (PairRow) and return counts."""
    chunks = chunks[: cfg.max_chunks] if cfg.max_chunks is not None else chunks
    prompts = [(c, task, cfg.counts[task]) for c in chunks for task in TASK_TYPES if cfg.counts.get(task, 0) > 0]
    if not prompts:
        raise ValueError("synthesize has nothing to do: no chunks, or every synthesize.counts entry is 0")
    samples = samples_for(cfg, backend)
    jobs = [_job_name(c, task, k) for c, task, _ in prompts for k in range(samples)]
    store = PartialStore(f"{out_url.rstrip('/')}/partial", _partial_key(chunks, cfg), PairRow)
    finished = store.done()
    # A prompt is asked again only for its samples not yet saved (a resumed n-request asks the rest).
    pending = [(c, task, n, [k for k in range(samples) if _job_name(c, task, k) not in finished])
               for c, task, n in prompts]
    pending = [p for p in pending if p[3]]
    salt = _cache_salt(chunks)
    requests = [
        make_request(cfg.llm, synthesis_prompt(task, c.text, n, cfg.llm.structured_output),
                     json_schema=synthesis_schema(n, cfg.max_field_chars),
                     seed=_seed(cfg.llm.seed, c.chunk_id, task, ks[0]), n=len(ks), cache_salt=salt)
        for c, task, n, ks in pending
    ]

    def save(i: int, result: ChatResult) -> None:
        c, task, _, ks = pending[i]
        for k, sample in zip(ks, result.samples()):
            store.write(_job_name(c, task, k), rows_from_result(c.chunk_id, task, sample, k))

    base = len(jobs) - sum(len(p[3]) for p in pending)
    report = (lambda d, t: progress(d, len(requests))) if progress else None
    if report:
        report(0, len(requests))
    ask_saving(backend, requests, [_job_name(c, task, ks[0]) for c, task, _, ks in pending], save, SynthesizeError,
               "synthesis", progress=report)

    rows = [row for name in jobs for row in store.read(name)]
    out = out_url.rstrip('/')
    write_table(f"{out}/{PAIRS_FILE}", rows, PairRow)
    atomic_write(f"{out}/{REQUESTS_FILE}", json.dumps(_request_log(prompts, cfg, salt, samples), indent=1))
    store.clear()  # pairs.parquet holds everything now; a forced re-run starts fresh
    return _counts(rows, len(prompts), len(jobs), len(chunks), resumed=base)


def samples_for(cfg: SynthesizeConfig, backend: ChatBackend) -> int:
    """``samples_per_chunk``, except 1 when ``backend: auto`` fell back to the local loop: the data
    scale the preset sets is for vLLM's throughput, and the fallback keeps the local loop's time."""
    return 1 if cfg.llm.backend == "auto" and backend.name == "local" else cfg.samples_per_chunk


def _request_log(prompts: list, cfg: SynthesizeConfig, salt: str, samples: int) -> dict[str, Any]:
    """Every request's seed and the sampling settings they share (the manifest lists this file)."""
    llm = cfg.llm
    return {"sampling": {"temperature": llm.temperature, "top_p": llm.top_p, "max_new_tokens": llm.max_new_tokens,
                         "n": samples, "structured_output": llm.structured_output},
            "cache_salt": salt,
            "requests": [{"job": _job_name(c, task, 0), "seed": _seed(llm.seed, c.chunk_id, task, 0)}
                         for c, task, _ in prompts]}


def rows_from_result(chunk_id: int, task: TaskType, result: ChatResult, sample: int = 0) -> list[PairRow]:
    pairs, error = parse_pairs(result)
    stem = f"c{chunk_id}-{task}" + (f"-s{sample}" if sample else "")
    rows = [PairRow(pair_id=f"{stem}-{k}", chunk_id=chunk_id, task=task, instruction=ins, response=resp,
                    raw_output=result.text) for k, (ins, resp) in enumerate(pairs)]
    if error is not None:
        rows.append(PairRow(pair_id=f"{stem}-{len(pairs)}", chunk_id=chunk_id, task=task, instruction="",
                            response="", raw_output=result.text, parse_error=error))
    return rows


def parse_pairs(result: ChatResult) -> tuple[list[tuple[str, str]], str | None]:
    """The (instruction, response) pairs in a reply, and an error describing what didn't parse."""
    if result.error is not None:
        return [], f"request failed: {result.error}"
    text = result.text
    obj = find_json(text, lambda v: isinstance(v, dict) and isinstance(v.get("pairs"), list))
    items = obj["pairs"] if obj is not None else find_json(text, _is_pair_list)
    if items is None:  # e.g. cut off by the token limit: keep the items that did complete
        items = find_all_json(text, _is_pair_dict)
    cut = " (the reply was cut off at max_new_tokens)" if result.finish_reason == "length" else ""
    if not items:
        return [], "no JSON list of {instruction, response} pairs in the reply" + cut
    pairs, bad = [], []
    for k, item in enumerate(items):
        ins, resp = _field(item, _INSTRUCTION_KEYS), _field(item, _RESPONSE_KEYS)
        if ins and resp:
            pairs.append((ins, resp))
        else:
            bad.append(k)
    if not pairs:
        return [], f"{len(items)} item(s) but none has a non-empty instruction and response" + cut
    if bad:
        return pairs, f"item(s) {bad} lack a non-empty instruction or response" + cut
    return pairs, None


def _field(item: Any, keys: tuple[str, ...]) -> str:
    if not isinstance(item, dict):
        return ""
    for key in keys:
        value = item.get(key)
        if isinstance(value, str) and value.strip():
            return value.strip()
    return ""


def _is_pair_dict(value: Any) -> bool:
    return isinstance(value, dict) and bool(_field(value, _INSTRUCTION_KEYS)) and any(k in value for k in _RESPONSE_KEYS)


def _is_pair_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value) and any(
        _is_pair_dict(v) for v in value)


def _job_name(chunk: ChunkRow, task: str, sample: int = 0) -> str:
    return f"c{chunk.chunk_id}-{task}" + (f"-s{sample}" if sample else "")


def _seed(seed: int, chunk_id: int, task: str, sample: int = 0) -> int:
    """Per-request seed: fixed by (config seed, chunk, task, first sample asked), so a resumed run
    asks with the same seed; sample 0 keeps the seed of the one-sample form."""
    key = {"seed": seed, "chunk": chunk_id, "task": task}
    return int(stable_hash(key if sample == 0 else {**key, "sample": sample})[:8], 16)


def _cache_salt(chunks: list[ChunkRow]) -> str:
    """One prefix-cache namespace per document (vLLM's cache_salt)."""
    return stable_hash([c.text for c in chunks])[:16]


def _partial_key(chunks: list[ChunkRow], cfg: SynthesizeConfig) -> str:
    return stable_hash({"config": cfg.cache_dict(), "chunks": [(c.chunk_id, c.text) for c in chunks]})


def _counts(rows: list[PairRow], n_requests: int, n_samples: int, n_chunks: int, resumed: int) -> dict[str, Any]:
    by_task = {t: 0 for t in TASK_TYPES}
    for r in rows:
        if r.parse_error is None:
            by_task[r.task] += 1
    return {
        "chunks": n_chunks, "requests": n_requests, "samples": n_samples, "resumed_requests": resumed,
        "pairs": sum(by_task.values()), "pairs_by_task": by_task,
        "parse_failures": sum(1 for r in rows if r.parse_error is not None),
    }
