"""A corpus: many documents, one run directory each — what to run, skip or retry (no Prefect here).

``nectar run`` and ``nectar trigger`` accept many documents; this module turns what the user gave
into entries, each with its own run directory, and says what each needs from what its run
directory holds (the run directories are the record, docs/design.md §4):

    expand(["docs/", "more/*.txt", "corpus.jsonl", "s3://b/x.txt"]) → [CorpusEntry, …]
    plan_entries(entries, config_for, runs_root)                       → [PlannedDoc, …] (checked)
    progress(run_dir)                                                  → DocProgress (done / failed at S / …)
    action(progress)                                                   → skip | start | retry

A manifest is a file named ``*.jsonl`` (one ``{"document": …, "run_dir": …, "set": [k=v, …]}``
per line), ``*.yaml``/``*.yml`` (a list of such mappings or of plain URIs) or ``*.manifest`` /
``*.list`` (one URI per line). ``#`` starts a comment in the line formats. A bad entry is one
line naming the file, the line and what a good entry looks like.
"""
from __future__ import annotations

import glob as globlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from ..documents import PYDOC_SCHEME, load_document
from ..schemas.config import STAGES, PipelineConfig
from .context import check_run, default_run_dir
from .executor import RunDir, doc_id_for, stage_status

MANIFEST_JSON = (".jsonl",)
MANIFEST_YAML = (".yaml", ".yml")
MANIFEST_LINES = (".manifest", ".list")
_GOOD_ENTRY = '{"document": PATH_OR_URL, "run_dir": DIR (optional), "set": ["section.key=value", …] (optional)}'


class CorpusError(ValueError):
    """A corpus argument or manifest entry that names no usable document; the message is one line."""


@dataclass(frozen=True)
class CorpusEntry:
    document: str
    run_dir: str | None = None
    overrides: tuple[str, ...] = ()
    origin: str = ""  # where it came from (argument, or manifest:line), for error lines


@dataclass(frozen=True)
class PlannedDoc:
    entry: CorpusEntry
    doc_id: str
    run_dir: str

    @property
    def document(self) -> str:
        return self.entry.document


@dataclass(frozen=True)
class DocProgress:
    """Where a document's run stands, from its run directory alone."""

    state: str  # done | failed | partial | new
    stage: str | None = None  # failed: the stage that failed; partial: the next stage to run
    error: str | None = None  # failed: the error's first line
    stages_done: int = 0


# ------------------------------------------------------------------------------------------ expand

def is_manifest(path: str) -> bool:
    return path.endswith(MANIFEST_JSON + MANIFEST_YAML + MANIFEST_LINES)


def _is_url(item: str) -> bool:
    return "://" in item or item.startswith(PYDOC_SCHEME)


def expand(items: Iterable[str]) -> list[CorpusEntry]:
    """Paths, globs, directories (their visible files, sorted), manifests and URLs → entries, in
    order, each document once (the first mention wins)."""
    out: dict[str, CorpusEntry] = {}
    for item in items:
        for entry in _expand_one(item):
            key = entry.document if _is_url(entry.document) else os.path.abspath(entry.document)
            out.setdefault(key, entry)
    if not out:
        raise CorpusError("no documents given: name files, globs, a directory or a manifest (*.jsonl)")
    return list(out.values())


def _expand_one(item: str) -> list[CorpusEntry]:
    if _is_url(item):
        return [CorpusEntry(item, origin=item)]
    if any(ch in item for ch in "*?["):
        hits = sorted(p for p in globlib.glob(item) if os.path.isfile(p))
        if not hits:
            raise CorpusError(f"{item}: the pattern matches no file; check the path and quote it for the shell")
        return [CorpusEntry(p, origin=item) for p in hits if not is_manifest(p)]
    if os.path.isdir(item):
        files = sorted(os.path.join(item, n) for n in os.listdir(item)
                       if not n.startswith(".") and os.path.isfile(os.path.join(item, n)))
        docs = [f for f in files if not is_manifest(f)]
        if not docs:
            raise CorpusError(f"{item}: the directory holds no document (hidden files and manifests are skipped)")
        return [CorpusEntry(f, origin=item) for f in docs]
    if not os.path.exists(item):
        raise CorpusError(f"{item}: no such file or directory")
    if is_manifest(item):
        return read_manifest(item)
    return [CorpusEntry(item, origin=item)]


# ---------------------------------------------------------------------------------------- manifests

def read_manifest(path: str) -> list[CorpusEntry]:
    """The entries of a manifest; a malformed entry raises CorpusError naming its line."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(MANIFEST_YAML):
        raw = _yaml_entries(path, text)
    else:
        raw = [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1)
               if line.strip() and not line.lstrip().startswith("#")]
        if path.endswith(MANIFEST_JSON):
            raw = [(n, _json_line(path, n, line)) for n, line in raw]
    base = os.path.dirname(os.path.abspath(path))
    entries = [_entry(path, n, value, base) for n, value in raw]
    if not entries:
        raise CorpusError(f"manifest {path}: no entries; add one per line: {_GOOD_ENTRY}")
    return entries


def _yaml_entries(path: str, text: str) -> list[tuple[int, Any]]:
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise CorpusError(f"manifest {path}{where}: not YAML ({getattr(exc, 'problem', exc)}); "
                          "write a list of document URIs or of mappings " + _GOOD_ENTRY) from None
    if not isinstance(data, list):
        raise CorpusError(f"manifest {path}: expected a YAML list of entries, got {type(data).__name__}")
    return [(i, v) for i, v in enumerate(data, 1)]  # YAML entries are numbered by position


def _json_line(path: str, n: int, line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise CorpusError(f"manifest {path} line {n}: not JSON ({exc.msg} at column {exc.colno}): "
                          f"{line[:80]!r}; each line is {_GOOD_ENTRY}") from None


def _entry(path: str, n: int, value: Any, base: str) -> CorpusEntry:
    where = f"manifest {path} {'entry' if path.endswith(MANIFEST_YAML) else 'line'} {n}"
    if isinstance(value, str):
        value = {"document": value}
    if not isinstance(value, dict):
        raise CorpusError(f"{where}: expected a document URI or a mapping, got {type(value).__name__} "
                          f"{str(value)[:60]!r}; write {_GOOD_ENTRY}")
    unknown = sorted(set(value) - {"document", "run_dir", "set"})
    if unknown:
        raise CorpusError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: document, run_dir, set")
    doc = value.get("document")
    if not isinstance(doc, str) or not doc.strip():
        raise CorpusError(f"{where}: 'document' is missing or not a string; write {_GOOD_ENTRY}")
    sets = value.get("set", [])
    if not isinstance(sets, list) or not all(isinstance(s, str) and "=" in s for s in sets):
        raise CorpusError(f"{where}: 'set' must be a list of 'section.key=value' strings, got {sets!r}")
    run_dir = value.get("run_dir")
    if run_dir is not None and not isinstance(run_dir, str):
        raise CorpusError(f"{where}: 'run_dir' must be a string, got {run_dir!r}")
    if not _is_url(doc):
        doc = doc if os.path.isabs(doc) else os.path.join(base, doc)  # relative to the manifest
        if not os.path.isfile(doc):
            raise CorpusError(f"{where}: {doc} does not exist; fix the path (relative paths are "
                              "relative to the manifest)")
    return CorpusEntry(doc, run_dir, tuple(sets), origin=f"{path}:{n}")


# ---------------------------------------------------------------------------------------- planning

def plan_entries(entries: list[CorpusEntry], config_for: Callable[[CorpusEntry], PipelineConfig],
                 runs_root: str) -> list[PlannedDoc]:
    """Each entry's document checked (readable, fits the window) and its run directory fixed:
    the entry's own, or ``<runs_root>/<doc-id>/<preset>-<config hash>``. Raises on the first bad
    one, naming its origin — before any run is created."""
    planned = []
    for entry in entries:
        config = config_for(entry)
        try:
            _, source = load_document(entry.document)
            doc_id = doc_id_for(source.name, source.sha256)
            run_dir = entry.run_dir or default_run_dir(doc_id, config, runs_root)
            check_run(entry.document, config, run_dir)
        except CorpusError:
            raise
        except Exception as exc:  # DocumentError, ContextTooLongError, RunDirMismatch: one line each
            raise CorpusError(f"{entry.origin or entry.document}: {exc}") from None
        planned.append(PlannedDoc(entry, doc_id, run_dir))
    return planned


def progress(run_dir: str, verify: bool = False) -> DocProgress:
    """done / failed (at which stage) / partial (next stage) / new, from the run directory.

    ``verify`` reads every output byte (a stale stage counts as not done): the check before
    skipping; polling while runs go uses the manifests only."""
    from .runners import available_stages

    run = RunDir(run_dir)
    if not run.exists("run.json"):
        return DocProgress("new", STAGES[0])
    done = 0
    for stage in (s for s in STAGES if s in set(available_stages())):
        st = stage_status(run, stage, verify=verify)
        if st["state"] in ("done", "cached"):
            done += 1
            continue
        if st["state"] == "failed":
            return DocProgress("failed", stage, (st["error"] or "").strip().splitlines()[0][:200] or None, done)
        return DocProgress("partial", stage, stages_done=done)
    return DocProgress("done", stages_done=done)


def action(p: DocProgress) -> str:
    """skip a finished document; retry a failed one (its completed stages are cache hits, so it
    resumes at the failed stage); start the others (new, or killed part-way: resumed likewise)."""
    if p.state == "done":
        return "skip"
    return "retry" if p.state == "failed" else "start"


@dataclass
class DocRow:
    """One line of the corpus table."""

    document: str
    doc_id: str
    run_dir: str
    state: str  # done | skipped | running | queued | failed | crashed
    stage: str = ""
    attempts: int = 0
    host: str = ""
    detail: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"document": self.document, "doc_id": self.doc_id, "state": self.state, "stage": self.stage,
                "attempts": self.attempts, "host": self.host, "detail": self.detail, "run_dir": self.run_dir}


def summary(rows: Iterable[DocRow]) -> str:
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.state] = counts.get(r.state, 0) + 1
    return ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
