"""The vLLM backend against a real vLLM CPU server on the embedded SmolLM2 (one server per session).

The first use builds vLLM's venv (~90-240 s, once per machine) and the first start compiles
(~100 s; later starts reuse torch.compile's cache). Nothing here is mocked: the server is killed
for real in the resume test, a port is really taken in the busy-port test.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import sys
from pathlib import Path

import pytest

from nectar.llm import LLMUnavailableError, make_backend, make_request, server_spec
from nectar.vllm.pool import server_scope
from nectar.llm.vllm_backend import VLLMBackend
from nectar.vllm.server import ServerSpec, VLLMServer
from nectar.vllm.venv import VLLMError, ensure_venv
from nectar.prompts import CONSISTENCY_SCHEMA
from nectar.schemas.artifacts import ChunkRow, PairRow
from nectar.schemas.config import LLMConfig, ModelConfig, SynthesizeConfig
from nectar.tables import read_table

# A server start is ~2 min on an idle 2-core machine, ~4 min under a load average of 30 (and the
# first test also pays the session server's start and, on a fresh machine, vLLM's venv build).
LONG = pytest.mark.timeout(1800)
EMBEDDED = ModelConfig(name="embedded:smollm2-135m")
LLM = LLMConfig(backend="vllm", kv_cache_gib=1.0, max_concurrency=8, max_new_tokens=160, temperature=0.7,
                timeout_s=3600.0)  # a loaded CI machine: never abort a queued request and ask again
TEXT = ("The lighthouse at Kerrow Point was built in 1871 by the engineer Ilse Brandt. Its lamp burned "
        "paraffin until 1952, when it was electrified. The keeper's cottage now holds a small museum of "
        "shipwrecks along the northern coast, including the schooner Margit, lost in the storm of 1899.")


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory):
    spec = server_spec(LLM, EMBEDDED)
    server = VLLMServer(spec, tmp_path_factory.mktemp("vllm") / "vllm.log")
    with server:
        yield server


def _backend(server: VLLMServer, **kw) -> VLLMBackend:
    return VLLMBackend.managed(server, max_concurrency=8, **kw)


@pytest.mark.slow
@LONG
def test_structured_output_parses_and_n_samples_come_back(vllm_server):
    backend = _backend(vllm_server)
    cfg = LLM.model_copy(update={"temperature": 0.0, "max_new_tokens": 96})
    prompt = (f"Answer A: 'Ilse Brandt built it.' Answer B: 'It was built by Ilse Brandt in 1871.' Are they "
              f"consistent? Reply as JSON.\n\n{TEXT}")
    reqs = [make_request(cfg, prompt, json_schema=CONSISTENCY_SCHEMA, seed=s, cache_salt="doc-a") for s in range(4)]
    reqs.append(make_request(LLM, prompt, json_schema=CONSISTENCY_SCHEMA, seed=7, n=3, cache_salt="doc-a"))
    results = backend.chat_many(reqs)
    assert all(r.ok for r in results), [r.error for r in results]
    for r in (s for res in results for s in res.samples()):
        assert isinstance(r.parsed, dict) and isinstance(r.parsed.get("is_consistent"), bool), r.text
        assert 0 <= float(r.parsed["confidence"]) <= 1
    assert len(results[-1].samples()) == 3
    assert backend.describe()["server_version"] == vllm_server.version


def _chunks() -> list[ChunkRow]:
    words = TEXT.split()
    return [ChunkRow(chunk_id=i, start_word=0, end_word=len(words), n_words=len(words), text=TEXT) for i in range(2)]


def _synth_cfg(server: VLLMServer) -> SynthesizeConfig:
    llm = LLM.model_copy(update={"base_url": server.url, "model": server.spec.served_name})
    return SynthesizeConfig(counts={"qa": 2, "summarization": 1, "quoting": 0, "paraphrasing": 0},
                            samples_per_chunk=2, max_field_chars=120, llm=llm)


@pytest.mark.slow
@LONG
def test_a_finished_stage_run_again_sends_no_request(vllm_server, tmp_path):
    from nectar import orchestration
    from nectar.schemas import load_config

    doc = tmp_path / "doc.txt"
    doc.write_text(" ".join([TEXT] * 3))
    llm = {"backend": "vllm", "base_url": vllm_server.url, "model": vllm_server.spec.served_name}
    cfg = load_config("cpu", overrides=[f"synthesize.llm.{k}={v}" for k, v in llm.items()] + [
        "synthesize.max_chunks=1", "synthesize.samples_per_chunk=2", "synthesize.llm.max_new_tokens=160",
        "synthesize.counts.quoting=0", "synthesize.counts.paraphrasing=0", "synthesize.counts.qa=2"])
    ctx = orchestration.prepare_run(str(doc), cfg, run_dir=str(tmp_path / "run"))
    orchestration.run_chunk(ctx)
    first = orchestration.run_synthesize(ctx)
    assert first.manifest.counts["llm"]["backend"] == "vllm"
    assert first.manifest.counts["llm"]["server_version"] == vllm_server.version
    asked = vllm_server.metric("vllm:request_success_total")
    again = orchestration.run_synthesize(ctx)
    assert again.status == "cached"
    assert vllm_server.metric("vllm:request_success_total") == asked  # not one request sent


def test_a_port_in_use_is_a_one_line_error(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        spec = ServerSpec(model="unused", port=port)
        with pytest.raises(VLLMError, match=rf"port {port} on 127.0.0.1 is already in use; free it, or set llm.port=0"):
            VLLMServer(spec, tmp_path / "vllm.log", python="/bin/false").start()


def test_auto_falls_back_to_local_in_one_line_and_vllm_refuses(capsys):
    auto = make_backend(LLMConfig(backend="auto"), ModelConfig(name="tiny:llama"))
    assert auto.name == "local"
    out = capsys.readouterr().err.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("llm: vLLM unavailable, using the local backend (tiny:llama")
    with pytest.raises(VLLMError, match="tiny:llama is a random model built in-process"):
        make_backend(LLMConfig(backend="vllm"), ModelConfig(name="tiny:llama"))


@pytest.mark.slow
@LONG
def test_a_server_that_fails_to_start_is_a_one_line_error_naming_its_log(tmp_path):
    ensure_venv()
    log = tmp_path / "vllm.log"
    spec = ServerSpec(model=str(tmp_path / "no-such-model"), kv_cache_gib=0.5)
    with pytest.raises(VLLMError) as err:
        VLLMServer(spec, log).start()
    message = str(err.value)
    assert "\n" not in message and str(log) in message and "exited with code" in message
    assert log.stat().st_size > 0


@pytest.mark.slow
@LONG
def test_the_server_killed_mid_synthesis_loses_no_finished_request(vllm_server, tmp_path):
    """Runs last: it kills the session's server, then restarts it through a scope (which must stop
    it again when the scope ends)."""
    from nectar.stages.synthesize import synthesize

    cfg = _synth_cfg(vllm_server)
    out = str(tmp_path / "synth")
    # One request in flight at a time: the kill after the first reply leaves the rest unanswered.
    # No restart allowed: this test is about what a stopped stage keeps (the restart is tested below).
    backend = _backend(vllm_server, max_retries=0, max_restarts=0)
    backend.max_concurrency = 1

    def kill_after_first(done: int, total: int) -> None:
        if done >= 1 and vllm_server.running:
            os.killpg(vllm_server.proc.pid, signal.SIGKILL)  # FAILURE INJECTION: the server dies

    with pytest.raises(LLMUnavailableError):
        synthesize(_chunks(), cfg, backend, out, progress=kill_after_first)
    saved = {p.stem: read_table(str(p), PairRow) for p in sorted(Path(out, "partial").glob("*.parquet"))}
    assert 1 <= len(saved) < 8  # 2 chunks x 2 tasks x 2 samples; the first request's 2 samples at least
    vllm_server.stop()

    with server_scope(tmp_path / "logs") as pool:
        server = pool.acquire(vllm_server.spec)  # on a new port: the stage's config is unchanged
        counts = synthesize(_chunks(), cfg, _backend(server), out)
    assert counts["resumed_requests"] == len(saved) and counts["samples"] == 8
    rows = read_table(f"{out}/pairs.parquet", PairRow)
    for name, kept in saved.items():  # finished replies kept byte for byte
        # a job's rows are NAME-<i> ("c0-qa-3"), not another sample's ("c0-qa-s1-0")
        assert [r for r in rows if re.fullmatch(rf"{name}-\d+", r.pair_id)] == kept
    assert not server.running and (tmp_path / "logs" / "vllm-0.log").exists()  # the scope stopped it


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (a new session does not change the parent)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.slow
@LONG
def test_nectar_run_survives_its_vllm_engine_killed_mid_synthesis(tmp_path):
    """The issue's fault test: the engine process of the run's own server is killed while synthesize
    is asking; the same `nectar run` restarts the server, finishes, records the restart, leaves no
    vLLM process behind. Self-study through vLLM on the embedded model, every other stage on the tiny
    preset: the stages after synthesize are not what this tests (with the cpu preset's the test took
    444 s on 2 idle cores, now 290 s)."""
    import json
    import subprocess
    import time

    doc = tmp_path / "doc.txt"
    doc.write_text(" ".join([TEXT] * 6))  # ~430 words
    run = tmp_path / "run"
    # 2 chunks x 4 tasks = 8 requests asked one at a time: the kill after the first leaves 7 to redo
    sets = ["synthesize.max_chunks=2", "synthesize.samples_per_chunk=2", "synthesize.counts.qa=2",
            "synthesize.counts.quoting=1", "synthesize.counts.paraphrasing=1", "synthesize.counts.summarization=1",
            "synthesize.llm.backend=vllm", "synthesize.llm.model=embedded:smollm2-135m",
            # eager (the compile is not what this tests), one request at a time: a kill leaves work to redo
            "synthesize.llm.server_compile=false", "synthesize.llm.max_concurrency=1", "synthesize.llm.kv_cache_gib=1",
            "synthesize.llm.timeout_s=3600"]
    cmd = [str(Path(sys.executable).with_name("nectar")), "run", str(doc), "--preset", "tiny", "--run-dir", str(run)]
    for item in sets:
        cmd += ["--set", item]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed = None
    try:
        deadline = time.monotonic() + 1500
        while killed is None and proc.poll() is None and time.monotonic() < deadline:
            if list(run.glob("**/synthesize*/**/partial/*.parquet")):  # synthesize has answered once
                engines = [p for p in _descendants(proc.pid) if "EngineCore" in _cmdline(p)
                           or "EngineCore" in Path(f"/proc/{p}/comm").read_text(errors="replace")]
                if engines:
                    killed = engines[0]
                    os.kill(killed, signal.SIGKILL)  # FAILURE INJECTION: vLLM's engine dies
            time.sleep(0.5)
        servers = [p for p in _descendants(proc.pid) if "vllm.entrypoints" in _cmdline(p)]
        out, _ = proc.communicate(timeout=2400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert killed is not None, out[-3000:]
    assert proc.returncode == 0, out[-3000:]
    assert "vllm: the managed server died" in out and "restarting it" in out, out[-3000:]
    manifest = json.loads(next(run.glob("**/synthesize/manifest.json")).read_text())
    restarts = manifest["counts"]["llm"]["restarts"]
    assert len(restarts) >= 1 and restarts[0]["reason"], manifest["counts"]["llm"]
    time.sleep(1)
    assert not [p for p in servers + [killed] if Path(f"/proc/{p}").exists() and "vllm" in _cmdline(p)]


@pytest.mark.slow
@LONG
def test_a_server_start_after_the_setup_warm_up_compiles_nothing(tmp_path, monkeypatch):
    """`nectar llm setup`'s warm-up fills the compile cache; the run's start of the same spec then adds
    not one file to it (everything loaded), where the warm-up's own start was free to compile."""
    from nectar.vllm.server import cache_entries, compile_cache_dir
    from nectar.vllm.warmup import warm_up, warmed

    monkeypatch.setenv("NECTAR_VLLM_COMPILE_CACHE", str(tmp_path / "compile-cache"))  # cold, this test's own
    # A 2,048-token step: vLLM's start runs one dummy batch of the whole step budget (8,192 tokens by
    # default with whole prefills) through the compiled model, warm cache or not — 300 s cold and 218 s
    # warm of the test's 613 s on 2 cores; the cache property does not need it.
    spec = ServerSpec(model=server_spec(LLM, EMBEDDED).model, served_name="embedded:smollm2-135m", kv_cache_gib=1.0,
                      max_model_len=2048, max_num_batched_tokens=2048, max_num_seqs=8, compile=True)
    lines: list[str] = []
    stamp = warm_up(spec, tmp_path / "warm.log", concurrency=8, prompt_tokens=600, echo=lines.append)
    assert stamp["start"]["cache_entries_added"] > 0  # the cold start compiled into the cache
    assert any("decode batches of 8 down to 1" in line for line in lines) and lines[-1].startswith("vllm warm-up: done")
    assert warmed(spec) is not None and cache_entries(compile_cache_dir()) == stamp["cache_entries"]
    with VLLMServer(spec, tmp_path / "run.log") as server:
        assert server.compile_info["cache_entries_added"] == 0, server.compile_info
