"""What the real-vLLM server tests share: the slow/skip marks (no vLLM venv: skipped) and two small
documents whose answers differ, so a state leaking between them shows."""
from __future__ import annotations

import os

import pytest

from nectar.vllm.venv import venv_python

VLLM_SERVER_MARKS = [pytest.mark.slow, pytest.mark.timeout(2400), pytest.mark.skipif(
    not os.path.exists(os.path.expanduser(os.environ.get("NECTAR_VLLM_PYTHON", str(venv_python())))),
    reason="no vLLM environment")]

TWO_DOCS = {
    "doc-a": "The lighthouse on Varn Island was bought by Captain Ilse Brandt in 1871. Its keeper kept a "
             "ledger of every ship, and the schooner Meridian ran aground on the northern reef with salt cod.",
    "doc-b": "The observatory at Tarn Ridge was founded by Doctor Amos Keel in 1902. Its telescope was "
             "ground from a single glass blank, and the first comet it found was named after his daughter.",
}
