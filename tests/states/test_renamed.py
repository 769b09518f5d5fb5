"""The product's method was renamed kvzip → recon_fit (nectar/schemas/renamed.py, the one alias
table): old configs, regimes, system names and run directories keep loading, and the stage cache keys
are computed over the NEW name — an old config and a new one agree, and a stage an old release cached
under ``kvzip`` is recomputed once (cached must mean still correct), never matched by name."""
from __future__ import annotations

import json
from types import SimpleNamespace

from nectar.comparison.systems import resolve
from nectar.orchestration.executor import cache_key
from nectar.orchestration.runners import _stage_config
from nectar.schemas import PipelineConfig, load_config
from nectar.schemas.base import stable_hash


def test_an_old_config_loads_as_the_new_one_with_the_same_hashes(tmp_path):
    new = load_config("cpu", regime="recon_fit")
    assert load_config("cpu", regime="kvzip") == new == load_config("cpu")  # the cpu default is recon_fit
    old_dump = new.model_dump(mode="json")
    old_dump["train"]["module"]["init"] = "kvzip"  # what run.json of an old run directory says
    (tmp_path / "old.yaml").write_text(json.dumps({"train": {"module": {"init": "kvzip"}}}))
    assert load_config("cpu", str(tmp_path / "old.yaml")) == new
    old = PipelineConfig.model_validate(old_dump)
    assert old == new and old.train.module.init == "recon_fit"
    assert stable_hash(old.cache_dict()) == stable_hash(new.cache_dict())  # the run id
    stage_old, stage_new = (_stage_config(SimpleNamespace(config=c), "train") for c in (old, new))
    assert stage_old == stage_new and "recon" in stage_new  # the train stage still depends on reconstruction
    assert stage_new["train"]["module"]["init"] == "recon_fit"


def test_a_stage_cached_under_the_old_name_is_recomputed_not_reused():
    cfg = _stage_config(SimpleNamespace(config=load_config("cpu")), "train")
    spelled_old = json.loads(json.dumps(cfg).replace('"init": "recon_fit"', '"init": "kvzip"'))
    assert spelled_old != cfg
    # an old release's cache key (over "kvzip") differs from this one's: the stage runs again, once
    assert cache_key("train", spelled_old, {"targets": "x"}) != cache_key("train", cfg, {"targets": "x"})


def test_old_system_and_regime_names_resolve_to_the_new_systems():
    assert [s.name for s in resolve(["kvzip_fit_qa@int4", "kvzip_select", "kvzip", "kvpress:kvzip:int4"])] == \
        ["recon_fit_regime", "recon_select", "recon_fit_qa@int4", "kvpress:kvzip:int4"]
    assert resolve(["kvzip_fit@int4"])[0].method == "recon_fit"


def test_an_old_run_directory_opens_with_the_new_name(tmp_path, capsys):
    from sample_document import DOC

    from nectar import orchestration
    from nectar.orchestration.context import open_run

    (tmp_path / "doc.txt").write_text(DOC)
    ctx = orchestration.prepare_run(str(tmp_path / "doc.txt"), load_config("tiny", regime="recon_fit"),
                                    str(tmp_path / "run"))
    manifest = tmp_path / "run" / "run.json"
    text = manifest.read_text()
    assert '"init": "recon_fit"' in text
    manifest.write_text(text.replace('"init": "recon_fit"', '"init": "kvzip"'))  # as an old release wrote it
    old = open_run(str(tmp_path / "run"))
    assert old.config == ctx.config and old.config.train.module.init == "recon_fit"


def test_an_old_name_is_said_once_on_stderr_whichever_kinds_read_it(capsys, monkeypatch):
    import importlib

    mod = importlib.import_module("nectar.schemas.renamed")

    monkeypatch.setattr(mod, "_said", set())
    assert mod.renamed("init", "kvzip") == "recon_fit"
    assert mod.renamed("method", "kvzip") == "recon_fit"
    assert mod.renamed("regime", "kvzip") == "recon_fit"
    assert mod.renamed("system", "kvzip_fit_qa@int4") == "recon_fit_qa@int4"
    assert mod.renamed("system", "recon_fit_qa@int4") == "recon_fit_qa@int4"  # a current name: silent
    err = capsys.readouterr().err.splitlines()
    assert err == ["note: 'kvzip' is read as 'recon_fit' (renamed; docs/architecture.md)",
                   "note: 'kvzip_fit_qa@int4' is read as 'recon_fit_qa@int4' (renamed; docs/architecture.md)"]
