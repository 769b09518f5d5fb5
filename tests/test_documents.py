"""load_document: the built-in pydoc scheme, local files, fsspec URLs and every kind of bad input."""
from __future__ import annotations

import hashlib

import fsspec
import pytest

from nectar.documents import DEFAULT_DOCUMENT, DocumentError, load_document


def test_default_pydoc_document_is_real_text():
    text, src = load_document(DEFAULT_DOCUMENT)
    assert "namespace" in text and len(text.split()) > 500
    assert src.name == "pydoc-naming" and src.uri == DEFAULT_DOCUMENT
    assert src.sha256 == hashlib.sha256(text.encode()).hexdigest()


def test_unknown_pydoc_topic_lists_valid_ones():
    with pytest.raises(DocumentError, match=r"unknown pydoc topic 'nope'.*e\.g\..*specialnames"):
        load_document("pydoc:nope")


def test_local_file_newlines_and_bom_normalised(tmp_path):
    a = tmp_path / "a.txt"
    b = tmp_path / "b.txt"
    a.write_bytes("\ufeffline one\r\nline two\rline three\n".encode())
    b.write_bytes(b"line one\nline two\nline three\n")
    (ta, sa), (tb, sb) = load_document(str(a)), load_document(str(b))
    assert ta == tb == "line one\nline two\nline three\n"
    assert sa.sha256 == sb.sha256 and sa.name == "a"


def test_fsspec_url():
    with fsspec.open("memory://docs/manual.txt", "wb") as f:
        f.write("A manual about widgets.\n".encode())
    text, src = load_document("memory://docs/manual.txt")
    assert text == "A manual about widgets.\n" and src.name == "manual"
    with pytest.raises(DocumentError, match="does not exist"):
        load_document("memory://docs/missing.txt")


def test_missing_file(tmp_path):
    with pytest.raises(DocumentError, match="does not exist"):
        load_document(str(tmp_path / "nope.txt"))


def test_directory_is_rejected(tmp_path):
    with pytest.raises(DocumentError, match="directory"):
        load_document(str(tmp_path))


@pytest.mark.parametrize("content", [b"", b"   \n\t \r\n"])
def test_empty_or_whitespace_only(tmp_path, content):
    p = tmp_path / "empty.txt"
    p.write_bytes(content)
    with pytest.raises(DocumentError, match="empty"):
        load_document(str(p))


def test_binary_with_nul_bytes(tmp_path):
    p = tmp_path / "blob.bin"
    p.write_bytes(b"PK\x03\x04" + b"\x00" * 20 + b"payload")
    with pytest.raises(DocumentError, match=r"binary: NUL byte at offset 4"):
        load_document(str(p))


def test_binary_by_control_characters(tmp_path):
    p = tmp_path / "ctl.dat"
    p.write_bytes(("abc\x01\x02\x03\x04" * 50).encode())
    with pytest.raises(DocumentError, match=r"control characters \(limit 1%\)"):
        load_document(str(p))


def test_non_utf8_names_the_byte_offset(tmp_path):
    p = tmp_path / "latin1.txt"
    p.write_bytes("caf\u00e9 au lait".encode("latin-1"))
    with pytest.raises(DocumentError, match=r"not valid UTF-8: byte 0xe9 at offset 3"):
        load_document(str(p))
