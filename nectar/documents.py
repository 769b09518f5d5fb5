"""Loading the one document a run is about.

A document is any UTF-8 text: a local path, an fsspec URL (``memory://``, ``s3://``, …) or the
built-in ``pydoc:<topic>`` scheme — a section of CPython's language reference shipped in
``pydoc_data.topics``, a real technical text present on every fresh machine (``pydoc:naming`` is the
default). Newlines are normalised to ``\\n`` and a BOM is dropped, so the same text hashes the same
whatever platform wrote it. Bad input (missing, empty, binary, not UTF-8) raises DocumentError
with the reason.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

DEFAULT_DOCUMENT = "pydoc:naming"
PYDOC_SCHEME = "pydoc:"
# Fraction of control characters (other than tab/newline/CR/form feed) above which a file is
# treated as binary: real text has essentially none, binary formats have many.
MAX_CONTROL_FRACTION = 0.01


class DocumentError(ValueError):
    """The document can't be used: missing, empty, binary or not UTF-8."""


@dataclass(frozen=True)
class DocumentSource:
    name: str  # short human name (file stem or pydoc topic), used in run ids
    uri: str  # what the user passed
    sha256: str  # of the normalised UTF-8 text


def load_document(uri: str) -> tuple[str, DocumentSource]:
    """Read, validate and normalise a document; return its text and where it came from."""
    if uri.startswith(PYDOC_SCHEME):
        topic = uri[len(PYDOC_SCHEME):]
        raw, name = _pydoc_topic(topic).encode("utf-8"), f"pydoc-{topic}"
    else:
        raw, name = _read_bytes(uri), _stem(uri)
    text = normalise(decode_text(raw, uri))
    if not text.strip():
        raise DocumentError(f"document {uri} is empty (only whitespace); give a text with content")
    sha = hashlib.sha256(text.encode("utf-8")).hexdigest()
    return text, DocumentSource(name=name, uri=uri, sha256=sha)


def normalise(text: str) -> str:
    """CRLF/CR → LF and no BOM: the same document always yields the same tokens and hash."""
    return text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n")


def decode_text(raw: bytes, uri: str) -> str:
    if not raw:
        raise DocumentError(f"document {uri} is empty (0 bytes)")
    if b"\x00" in raw:
        offset = raw.index(b"\x00")
        raise DocumentError(f"document {uri} looks binary: NUL byte at offset {offset}; give a UTF-8 text file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DocumentError(
            f"document {uri} is not valid UTF-8: byte {raw[exc.start]:#04x} at offset {exc.start} "
            f"({exc.reason}); convert it to UTF-8 first (e.g. `iconv -f latin1 -t utf-8`)"
        ) from None
    control = sum(1 for ch in text if ord(ch) < 32 and ch not in "\t\n\r\f")
    if control > MAX_CONTROL_FRACTION * len(text):
        raise DocumentError(
            f"document {uri} looks binary: {control} of {len(text)} characters are control characters "
            f"(limit {MAX_CONTROL_FRACTION:.0%}); give a UTF-8 text file"
        )
    return text


def _read_bytes(uri: str) -> bytes:
    if "://" in uri:
        import fsspec

        fs, path = fsspec.core.url_to_fs(uri)
        if not fs.exists(path):
            raise DocumentError(f"document {uri} does not exist")
        if fs.isdir(path):
            raise DocumentError(f"document {uri} is a directory; give one text file")
        return fs.cat_file(path)
    path = Path(uri).expanduser()
    if not path.exists():
        raise DocumentError(f"document {uri} does not exist (looked for {path.resolve()})")
    if path.is_dir():
        raise DocumentError(f"document {uri} is a directory; give one text file")
    return path.read_bytes()


def _stem(uri: str) -> str:
    return Path(uri.rstrip("/").rsplit("/", 1)[-1]).stem or "document"


def pydoc_topics() -> list[str]:
    from pydoc_data.topics import topics

    return sorted(topics)


def _pydoc_topic(topic: str) -> str:
    from pydoc_data.topics import topics

    if topic not in topics:
        by_size = sorted(topics, key=lambda k: -len(topics[k]))
        examples = ", ".join(by_size[:8])
        raise DocumentError(
            f"unknown pydoc topic {topic!r}; {len(topics)} topics exist, e.g. {examples} "
            f"(all: nectar.documents.pydoc_topics())"
        )
    return topics[topic]
