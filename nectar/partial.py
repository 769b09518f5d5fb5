"""Resumable stage work: one small parquet file per finished unit of work.

A stage killed mid-way (Ctrl-C, OOM, a preempted worker) restarts where it stopped: finished
units are files under ``<stage>/partial/``, written atomically, and skipped on the next run. A
key file records what the partial results were computed for (config + inputs); if that changes,
the stale files are discarded rather than mixed into new output. ``ask_saving`` is the LLM
fan-out that fills them (synthesize, verify): replies saved as they arrive, failures asked again.
"""
from __future__ import annotations

from typing import Callable, Sequence, TypeVar

import fsspec

from .llm import ChatBackend, ChatRequest, ChatResult, Progress
from .schemas.base import Artifact
from .tables import read_table, write_table

R = TypeVar("R", bound=Artifact)
KEY_FILE = "key.txt"


class PartialStore:
    def __init__(self, url: str, key: str, row_cls: type[R]):
        self.url = url.rstrip("/")
        self.row_cls = row_cls
        self.fs, self.path = fsspec.core.url_to_fs(self.url)
        key_path = f"{self.path}/{KEY_FILE}"
        if self.fs.exists(key_path) and self.fs.cat_file(key_path).decode() != key:
            self.fs.rm(self.path, recursive=True)  # computed for another config or other inputs
        self.fs.makedirs(self.path, exist_ok=True)
        if not self.fs.exists(key_path):
            self.fs.pipe_file(key_path, key.encode())

    def done(self) -> set[str]:
        names = set()
        for p in self.fs.ls(self.path, detail=False):
            name = p.rstrip("/").rsplit("/", 1)[-1]
            if name.endswith(".parquet"):  # a killed write leaves only "*.parquet.tmp"
                names.add(name[: -len(".parquet")])
        return names

    def write(self, name: str, rows: Sequence[Artifact]) -> None:
        write_table(f"{self.url}/{name}.parquet", rows, self.row_cls)

    def read(self, name: str) -> list[R]:
        return read_table(f"{self.url}/{name}.parquet", self.row_cls)

    def clear(self) -> None:
        if self.fs.exists(self.path):
            self.fs.rm(self.path, recursive=True)


def clear_partial(url: str) -> None:
    """Remove a stage's partial results once its final artifact holds everything."""
    fs, path = fsspec.core.url_to_fs(url.rstrip("/"))
    if fs.exists(path):
        fs.rm(path, recursive=True)


def ask_saving(backend: ChatBackend, requests: Sequence[ChatRequest], names: Sequence[str],
               save: Callable[[int, ChatResult], None], error: type[Exception], what: str, *,
               progress: Progress | None = None, tick: Callable[[], None] | None = None,
               finish: Callable[[], None] | None = None) -> None:
    """A stage's resumable LLM fan-out: send ``requests`` (those no earlier attempt saved) and keep
    each reply as it arrives (``save(i, result)``), so a killed run resumes. A failed request is not
    saved: a re-run asks it again. ``tick`` is called for every reply, ``finish`` after the last one,
    also when the backend raised (e.g. to write what is buffered). Then raises ``error`` naming how
    many failed and the first (``names[i]``: what request i was for)."""
    failures: list[str] = []

    def on_result(i: int, result: ChatResult) -> None:
        if tick is not None:
            tick()
        if result.error is not None:
            failures.append(f"{names[i]}: {result.error}")
            return
        save(i, result)

    try:
        backend.chat_many(list(requests), progress=progress, on_result=on_result)
    finally:
        if finish is not None:
            finish()
    if failures:
        raise error(f"{len(failures)} of {len(requests)} {what} request(s) failed (first: {failures[0]}); "
                    f"the {len(requests) - len(failures)} that succeeded are saved and a re-run asks only "
                    "the failed ones")
