"""The ``vllm:`` systems of ``nectar compare`` without a server: their names and kind in the registry, the
jobs they make (the run's ρ only), the one-line refusals before anything runs (no vLLM venv, a model vLLM
cannot load, no trained module, a composition), a row left out in one line when its server fails, and the
markdown: served rows kept out of the full-vocabulary tables, in a section that says their basis."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from nectar.comparison import SYSTEMS, CompareInputError, System, resolve
from nectar.comparison import jobs as jobs_mod
from nectar.comparison import served_rows
from nectar.comparison.compose import plan_systems
from nectar.comparison.served_rows import check_served, score_served
from nectar.comparison.table import comparison_markdown, served_markdown
from nectar.evaluation.teacher import EvalPair
from nectar.schemas import ComparisonRow
from nectar.tables import read_table, write_table
from nectar.vllm.venv import VLLMError

SERVED = ["vllm:trained", "vllm:attention_matching_kv@int8", "vllm:attention_matching_kv@int4"]


def test_the_served_systems_are_named_opt_in_and_name_the_state_they_export():
    assert [s.name for s in SYSTEMS.values() if s.kind == "served"] == SERVED
    assert [SYSTEMS[n].served for n in SERVED] == ["trained", "attention_matching_kv@int8",
                                                   "attention_matching_kv@int4"]
    assert not any(s.kind == "served" for s in resolve(None))  # never in the default set: each starts vLLM
    assert [s.name for s in resolve(["vllm:attention_matching_kv@int4", "none", "full"])] == \
        ["none", "full", "vllm:attention_matching_kv@int4"]
    with pytest.raises(ValueError, match="names the state it serves"):
        System("vllm:x", "served", "no state", default=False)
    with pytest.raises(ValueError, match="opt-in only"):
        System("vllm:x", "served", "default", served="trained")
    with pytest.raises(ValueError, match="names the state it serves"):
        System("evict2", "method", "", method="evict", served="trained")


def test_a_served_system_is_one_job_at_the_runs_budget(monkeypatch):
    ctx = SimpleNamespace(parent=object(), config=SimpleNamespace(train=SimpleNamespace(module=SimpleNamespace(rho=0.1))))
    monkeypatch.setattr(jobs_mod, "validate", lambda c, systems, rhos: (resolve(systems), [0.1, 0.05]))
    jobs = jobs_mod.plan_jobs(ctx, ["none", "vllm:trained", "evict"], [0.05])
    assert [j.key for j in jobs] == ["none", "evict@0.1", "evict@0.05", "vllm:trained@0.1"]


def _ctx(tmp_path, model="embedded:smollm2-135m", trained=True):
    run = SimpleNamespace(root=str(tmp_path / "run"), exists=lambda stage, name: trained)
    return SimpleNamespace(config=SimpleNamespace(model=SimpleNamespace(name=model)), run=run)


def test_no_vllm_venv_is_one_line_naming_the_setup_command(tmp_path, monkeypatch):
    monkeypatch.delenv("NECTAR_VLLM_PYTHON", raising=False)
    monkeypatch.setenv("NECTAR_VLLM_VENV", str(tmp_path / "no-venv"))
    with pytest.raises(CompareInputError) as err:
        check_served(_ctx(tmp_path), resolve(["none", "vllm:trained"]))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("system vllm:trained: no vLLM environment at ")
    assert "`nectar llm setup`" in msg and "NECTAR_VLLM_PYTHON" in msg
    check_served(_ctx(tmp_path), resolve(["none", "evict"]))  # no served system: vLLM is not needed


def test_a_model_vllm_cannot_load_or_no_trained_module_is_refused_in_one_line(tmp_path, monkeypatch):
    python = tmp_path / "python"
    python.write_text("")
    monkeypatch.setenv("NECTAR_VLLM_PYTHON", str(python))  # a vLLM is there: the next check speaks
    with pytest.raises(CompareInputError, match="model 'tiny:llama' has no model folder vLLM can load"):
        check_served(_ctx(tmp_path, model="tiny:llama"), resolve(["vllm:attention_matching_kv@int4"]))
    with pytest.raises(CompareInputError, match="system vllm:trained: .* has no trained module.*"
                                                "vllm:attention_matching_kv@int4"):
        check_served(_ctx(tmp_path, trained=False), resolve(["vllm:trained"]))
    check_served(_ctx(tmp_path, trained=False), resolve(["vllm:attention_matching_kv@int4"]))  # the refit: fitted


def test_a_composition_refuses_a_served_system():
    with pytest.raises(CompareInputError, match="vllm:trained: a composition is not served by vLLM"):
        plan_systems(["none", "full", "vllm:trained"], None)


def test_a_served_row_whose_server_fails_is_left_out_in_one_line(monkeypatch, capsys):
    def fails(ctx, base, doc_kv, probes, job, log):
        assert [p.pair_id for p in probes] == ["p2"]  # scored on the probes only
        raise VLLMError("vLLM exited with status 1 during startup; see /tmp/x/server.log\n(last lines …)")

    monkeypatch.setattr(served_rows, "served_row", fails)
    job = jobs_mod.Job(SYSTEMS["vllm:trained"], 0.1)
    pairs = [EvalPair("p1", "qa", ("test",), (1, 2, 3), 1), EvalPair("p2", "qa", ("probes",), (1, 2, 3), 1)]
    notes: dict = {}
    assert score_served(None, None, None, pairs, [job], notes) == []
    line = capsys.readouterr().out.strip()
    assert line == ("served row vllm:trained@0.1 left out: vLLM exited with status 1 during startup; "
                    "see /tmp/x/server.log (last lines …)")
    assert notes["served"]["vllm:trained@0.1"]["error"].startswith("vLLM exited with status 1")
    notes = {}
    assert score_served(None, None, None, pairs[:1], [job], notes) == []  # no probes: nothing to score it on
    assert "no held-out probes" in notes["served"]["vllm:trained@0.1"]["error"]


SERVED_NOTE = {"pairs": 51, "tokens": 1445, "top_k": 100, "state": "trained", "m": 412, "bias": True, "bytes": 4_843_216,
               "vllm": "0.32.0", "recovered_vllm": [0.4123, 0.35, 0.47], "recovered_torch": [0.4125, 0.351, 0.471],
               "recovered_torch_exact": [0.45, 0.39, 0.51], "kl_torch_vllm": [2e-6, 1e-6, 3e-6],
               "kl_vllm": [0.8, 0.7, 0.9]}


def _row(system, kind, rec, basis=None):
    return ComparisonRow(system=system, kind=kind, rho=None if kind == "reference" else 0.1, state_bytes=0 if
                         system == "none" else 1_000_000, split="probes", n_pairs=51, n_tokens=1445,
                         kl_to_full=1 - rec, recovered_kl=rec, recovered_kl_ci_low=rec - 0.05,
                         recovered_kl_ci_high=rec + 0.05, kl_basis=basis).model_dump()


def test_served_rows_are_kept_out_of_the_full_vocabulary_tables_and_shown_with_their_basis(tmp_path):
    served = ComparisonRow(**{k: v for k, v in _row("vllm:trained", "served", 0.4123, "top-100 buckets").items()
                              if k != "schema_version"})
    url = str(tmp_path / "comparison.parquet")
    write_table(url, [served], ComparisonRow)
    assert read_table(url, ComparisonRow) == [served]  # the kind and its basis round-trip
    rows = [_row("none", "reference", 0.0), _row("evict", "method", 0.3), served.model_dump()]
    md = comparison_markdown(rows, {"run": "runs/x"})
    assert "| evict | method |" in md and "vllm:trained" not in md
    section = served_markdown({"vllm:trained@0.1": SERVED_NOTE,
                               "vllm:attention_matching_kv@int4@0.1": {"error": "no vLLM environment at /x"}})
    assert "## Served by vLLM: probe KL over vLLM's top-100 buckets" in section
    assert "not comparable with the tables above" in section
    assert ("| vllm:trained@0.1 | trained, m=412, β (NECTAR backend), 4.84 MB as vLLM loads it, vLLM 0.32.0 | 51 | 1445 | 41.2 [35.0, 47.0] | "
            "41.2 [35.1, 47.1] | 45.0 [39.0, 51.0] | 0.000002 [0.000001, 0.000003] |") in section
    assert "- vllm:attention_matching_kv@int4@0.1: left out: no vLLM environment at /x" in section
    assert served_markdown({}) == ""


def test_the_measured_server_is_stopped_on_an_error_and_on_a_stop_signal_and_when_forced_out(monkeypatch):
    """``measured_server`` (the compare's and the benchmark's one server block): ``stop()`` (its process group)
    on leaving the block however it is left, and registered with nectar.shutdown meanwhile, so a forced exit
    (``os._exit``: no atexit) stops it too."""
    from nectar import shutdown
    from nectar.serving.engines import vllm as engine

    events = []

    class FakeServer:
        def __init__(self, spec, log_path, python, startup_timeout_s):
            events.append(("new", python))

        def start(self):
            events.append("start")

        def stop(self, grace_s=20.0):
            events.append(("stop", grace_s))

    monkeypatch.setattr(engine, "prepare", lambda dirs, opts, log: ("spec", "/tmp/x/server.log", ["doc"]))
    monkeypatch.setattr(engine, "ensure_plugin", lambda python: events.append("plugin"))
    monkeypatch.setattr(engine, "VLLMServer", FakeServer)
    opts = engine.VLLMOptions(python="/venv/bin/python")
    for raised in (OSError("connection refused"), shutdown.Interrupted()):
        events.clear()
        with pytest.raises(type(raised)):
            with engine.measured_server("run", opts) as (server, spec, doc):
                assert (spec, doc) == ("spec", "doc")
                registered = list(shutdown._S.cleanups)
                assert any("vLLM server (/tmp/x/server.log)" == name for _, name, _ in registered)
                raise raised
        assert events == ["plugin", ("new", "/venv/bin/python"), "start", ("stop", 20.0)]
        assert not any("vLLM server" in name for _, name, _ in shutdown._S.cleanups)  # removed once stopped
    events.clear()
    with engine.measured_server("run", opts):
        cleanup = next(fn for _, name, fn in shutdown._S.cleanups if name.startswith("vLLM server"))
        cleanup(True)  # what a forced exit runs: the server stopped without waiting
    assert ("stop", 0.0) in events
