"""Deployments end to end on a REAL Prefect server (SQLite) with REAL process workers.

Nothing is mocked: ``nectar deploy`` registers the real flows, ``prefect worker start`` subprocesses
pick the runs up and execute the pipeline on the ``tiny`` preset (random 2-layer model, real
stages), and every assertion reads states and artifacts back through the Prefect API. The one
injected failure is real too: the synthesize LLM endpoint points at a closed port on 127.0.0.1.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from nectar.pipeline import deploy as dep
from nectar.pipeline import operations
from nectar.pipeline import server_status
from nectar.pipeline.gpu_slots import GPU_LIMIT
from nectar.pipeline.runs_status import collect

from prefect_procs import REPO_ROOT, free_port, running_worker

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

POOL = "nectar-e2e"
RUN_TIMEOUT_S = 600


def write_document(folder: Path, name: str = "naming.txt") -> Path:
    """A real technical text: the Python reference's "Naming and binding" (the CLI tests' pydoc:naming)."""
    from pydoc_data.topics import topics

    path = folder / name
    path.write_text(topics["naming"])
    return path


def client():
    from prefect.client.orchestration import get_client

    return get_client(sync_client=True)


def counts_of(arts: dict, doc_id: str, stage: str) -> dict:
    return server_status.table_as_dict(arts[f"{doc_id}-{stage}-counts"]["data"])


@pytest.fixture(scope="module")
def deployed(prefect_server, tmp_path_factory):
    """The deployments, registered once, and one worker polling the pool."""
    work = tmp_path_factory.mktemp("e2e")
    wd = work / "data"
    wd.mkdir()
    ids = dep.deploy(pool=POOL, preset="tiny", working_dir=str(wd))
    with running_worker(prefect_server, POOL, "e2e-worker", work):
        yield {"ids": ids, "work": work, "wd": wd}


def test_deploy_registers_pipeline_and_stage_deployments_with_gpu_limits(deployed):
    names = set(deployed["ids"])
    assert names == {"nectar-pipeline/pipeline", *(f"nectar-stage/{s}" for s in
                     ("chunk", "first", "synthesize", "verify", "targets", "train", "promote", "evaluate"))}
    with client() as c:
        pipeline = c.read_deployment_by_name("nectar-pipeline/pipeline")
        assert pipeline.work_pool_name == POOL and pipeline.parameters["preset"] == "tiny"
        assert pipeline.entrypoint == dep.PIPELINE_ENTRYPOINT
        assert pipeline.pull_steps == dep.pull_steps(str(deployed["wd"]))
        assert "document" in pipeline.parameter_openapi_schema["required"]  # the UI asks for it
        train = c.read_deployment_by_name("nectar-stage/train")
        assert train.work_queue_name == dep.GPU_QUEUE and train.parameters == {"stage": "train", "force": True}
        assert c.read_deployment_by_name("nectar-stage/chunk").work_queue_name == "default"
        queue = c.read_work_queue_by_name(dep.GPU_QUEUE, work_pool_name=POOL)
        assert queue.concurrency_limit == 1
        assert c.read_global_concurrency_limit_by_name(GPU_LIMIT).limit == 1
        assert c.read_work_pool(POOL).type == "process"
    # Deploying again updates in place (idempotent), and --gpus changes both limits.
    dep.deploy(pool=POOL, preset="tiny", working_dir=str(deployed["wd"]), gpus=2)
    with client() as c:
        assert c.read_work_queue_by_name(dep.GPU_QUEUE, work_pool_name=POOL).concurrency_limit == 2
        assert c.read_global_concurrency_limit_by_name(GPU_LIMIT).limit == 2
    dep.deploy(pool=POOL, preset="tiny", working_dir=str(deployed["wd"]), gpus=1)


def test_scheduled_document_deployment_is_read_back_with_cron_and_parameters(deployed):
    doc = write_document(deployed["work"], "Employee Handbook.txt")
    dep.ensure_work_pool(POOL, gpus=3)
    ids = dep.schedule_document(str(doc), "30 2 * * 1-5", pool=POOL, preset="tiny",
                                overrides=["train.samples=500"], working_dir=str(deployed["wd"]),
                                timezone="Europe/Paris")
    assert list(ids) == ["nectar-pipeline/doc-employee-handbook"]
    with client() as c:
        d = c.read_deployment_by_name("nectar-pipeline/doc-employee-handbook")
        assert d.parameters == {"document": str(doc), "preset": "tiny", "config_file": None,
                                "overrides": ["train.samples=500"]}
        assert [(s.schedule.cron, s.schedule.timezone, s.active) for s in d.schedules] == [
            ("30 2 * * 1-5", "Europe/Paris", True)]
        assert set(d.tags) == {"nectar", "doc:employee-handbook"}
    with client() as c:  # scheduling leaves the pool's GPU queue limit alone
        assert c.read_work_queue_by_name(dep.GPU_QUEUE, work_pool_name=POOL).concurrency_limit == 3
    dep.ensure_work_pool(POOL, gpus=1)
    with pytest.raises(dep.DeployError, match="invalid cron"):
        dep.schedule_document(str(doc), "every tuesday", pool=POOL, working_dir=str(deployed["wd"]))


@pytest.fixture(scope="module")
def failed_then_retried(deployed):
    """A run whose synthesize endpoint is unreachable, then the same flow run retried after the fix.

    The config file is the "cause": it points synthesize at a closed port. Fixing it (removing that
    section) and pressing Retry — the UI's action, done here through the same API call — re-runs the
    SAME flow run with the same parameters.
    """
    work, wd = deployed["work"], deployed["wd"]
    doc = write_document(work)
    run_dir = str(wd / "runs" / "naming" / "retry")
    config = work / "nectar.yaml"
    port = free_port()  # bound and released: nothing listens there
    config.write_text(yaml.safe_dump({"synthesize": {"llm": {
        "backend": "openai", "base_url": f"http://127.0.0.1:{port}/v1", "model": "unreachable",
        "max_retries": 0, "timeout_s": 5}}}))
    first = operations.trigger(str(doc), preset="tiny", config_file=str(config), run_dir=run_dir)
    failed = operations.wait_for_run(first.id, RUN_TIMEOUT_S, poll_s=1)
    failed_stages = server_status.stage_runs(failed.id)
    failed_arts = server_status.artifacts([s.flow_run_id for s in failed_stages])
    chunk_manifest = (Path(run_dir) / "chunk" / "manifest.json").read_text()

    config.write_text(yaml.safe_dump({"train": {"samples": 2000}}))  # the fix: default (local) LLM
    retried = operations.retry_flow_run(str(first.id))
    done = operations.wait_for_run(retried.id, RUN_TIMEOUT_S, poll_s=1)
    stages = server_status.stage_runs(done.id)
    arts = server_status.artifacts([s.flow_run_id for s in stages])
    return {"first": first, "failed": failed, "failed_stages": failed_stages, "failed_arts": failed_arts,
            "done": done, "stages": stages, "arts": arts, "run_dir": run_dir, "port": port,
            "chunk_manifest": chunk_manifest}


def test_unreachable_llm_fails_the_run_with_its_error_in_the_api(failed_then_retried):
    r = failed_then_retried
    assert r["failed"].state.type.value == "FAILED"
    by_stage = {s.stage: s for s in r["failed_stages"]}
    assert by_stage["chunk"].state == "COMPLETED"
    assert by_stage["synthesize"].state == "FAILED"
    assert by_stage["synthesize"].name.endswith("-synthesize")
    message = by_stage["synthesize"].message or ""
    assert f"http://127.0.0.1:{r['port']}/v1" in message, message  # the unreachable endpoint, named
    doc_id = by_stage["chunk"].name[: -len("-chunk")]
    error_art = r["failed_arts"][f"{doc_id}-synthesize-error"]
    assert error_art["type"] == "markdown" and "synthesize failed" in error_art["data"]
    assert f"--run-dir {r['run_dir']} --only synthesize" in error_art["data"]
    assert "verify" not in by_stage  # the pipeline stopped at the failing stage


def test_retry_completes_the_same_run_with_earlier_stages_cached(failed_then_retried):
    r = failed_then_retried
    assert r["done"].id == r["first"].id and r["done"].run_count >= 2
    assert r["done"].state.type.value == "COMPLETED", r["done"].state.message
    by_stage: dict[str, list] = {}
    for s in r["stages"]:
        by_stage.setdefault(s.stage, []).append(s)
    # The completed chunk subflow is not executed again: Prefect reuses its persisted result, and
    # its manifest on disk is untouched. The failed stage runs again and completes.
    assert [s.state for s in by_stage["chunk"]] == ["COMPLETED"]
    assert (Path(r["run_dir"]) / "chunk" / "manifest.json").read_text() == r["chunk_manifest"]
    assert [s.state for s in by_stage["synthesize"]] == ["FAILED", "COMPLETED"]
    assert all(runs[-1].state == "COMPLETED" for runs in by_stage.values()), by_stage
    doc_id = by_stage["chunk"][0].name[: -len("-chunk")]
    assert counts_of(r["arts"], doc_id, "synthesize")["status"] == "done"
    status = collect(r["run_dir"])[0]
    assert status.state == "complete", [(s.stage, s.state) for s in status.stages]


def test_trigger_again_on_the_same_run_dir_is_all_cache_hits(failed_then_retried):
    """The other way to retry: trigger the document again with the run directory."""
    r = failed_then_retried
    params = r["first"].parameters
    run = operations.trigger(params["document"], preset="tiny", config_file=params["config_file"],
                      run_dir=r["run_dir"])
    done = operations.wait_for_run(run.id, RUN_TIMEOUT_S, poll_s=1)
    assert done.state.type.value == "COMPLETED", done.state.message
    stages = server_status.stage_runs(done.id)
    arts = server_status.artifacts([s.flow_run_id for s in stages])
    doc_id = stages[0].name[: -len("-chunk")]
    assert {s.stage: counts_of(arts, doc_id, s.stage)["status"] for s in stages} == {
        s.stage: "cached" for s in stages}


def test_rerun_one_stage_through_its_deployment(failed_then_retried):
    """nectar-stage/chunk on the existing run: forced, same inputs, so downstream stays valid."""
    run_dir = failed_then_retried["run_dir"]
    before = json.loads((Path(run_dir) / "chunk" / "manifest.json").read_text())
    verify_before = (Path(run_dir) / "verify" / "manifest.json").read_text()
    run = operations.rerun_stage(run_dir, "chunk")
    done = operations.wait_for_run(run.id, RUN_TIMEOUT_S, poll_s=1)
    assert done.state.type.value == "COMPLETED", done.state.message
    assert done.parameters == {"run_dir": run_dir, "stage": "chunk", "force": True}
    after = json.loads((Path(run_dir) / "chunk" / "manifest.json").read_text())
    assert after["started_at"] >= before["finished_at"]  # executed again, not a cache hit
    assert (after["cache_key"], after["outputs"]) == (before["cache_key"], before["outputs"])
    doc_id = json.loads((Path(run_dir) / "run.json").read_text())["doc_id"]
    arts = server_status.artifacts([done.id])
    assert counts_of(arts, doc_id, "chunk")["status"] == "done"
    assert {s.stage: s.state for s in collect(run_dir)[0].stages}["chunk"] == "done"
    # Only that stage ran: downstream manifests are untouched (a --from run would redo them).
    assert (Path(run_dir) / "verify" / "manifest.json").read_text() == verify_before


def test_two_workers_share_the_pool_with_file_url_run_dirs(prefect_server, deployed, tmp_path):
    """Two worker processes (one run each at a time) drain two stage runs on file:// run dirs."""
    from nectar.orchestration import prepare_run
    from nectar.schemas.presets import load_config

    pool = "nectar-two-workers"
    dep.deploy(pool=pool, preset="tiny", working_dir=str(tmp_path))
    doc = write_document(tmp_path)
    config = load_config("tiny")
    run_dirs = [f"file://{tmp_path}/runs/naming/w{i}" for i in range(2)]
    for rd in run_dirs:
        prepare_run(str(doc), config, rd)
    with running_worker(prefect_server, pool, "w-a", tmp_path, limit=1), \
            running_worker(prefect_server, pool, "w-b", tmp_path, limit=1):
        runs = [operations._run("nectar-stage/chunk", {"run_dir": rd, "stage": "chunk"}, ["nectar"])
                for rd in run_dirs]
        done = [operations.wait_for_run(r.id, RUN_TIMEOUT_S, poll_s=1) for r in runs]
    assert [d.state.type.value for d in done] == ["COMPLETED", "COMPLETED"]
    logs = {w: (tmp_path / f"worker-{w}.log").read_text() for w in ("w-a", "w-b")}
    # A worker logs "View at …/flow-run/<id>" when the run executes under it (both may try to
    # submit the same run; the server lets only one win).
    executed = {w: [str(r.id) for r in runs if f"flow-run/{r.id}" in text] for w, text in logs.items()}
    assert sorted(sum(executed.values(), [])) == sorted(str(r.id) for r in runs)
    assert all(len(ids) == 1 for ids in executed.values()), executed  # one each: limit=1
    for rd in run_dirs:
        assert (Path(rd[len("file://"):]) / "chunk" / "manifest.json").exists()


GPU_HOLDER = """
import json, sys, time
from nectar.pipeline.gpu_slots import gpu_slot
with gpu_slot("train") as held:
    start = time.time()
    time.sleep(2.0)
    print(json.dumps({"held": held, "start": start, "end": time.time()}))
"""


def test_gpu_slot_serialises_gpu_stages_across_processes(prefect_server, deployed):
    """Two processes enter gpu_slot("train") at once; with nectar-gpu = 1 they run one after the other."""
    procs = [subprocess.Popen([sys.executable, "-c", GPU_HOLDER], env=prefect_server.env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)
             for _ in range(2)]
    spans = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
        spans.append(json.loads(out.strip().splitlines()[-1]))
    assert all(s["held"] for s in spans)
    first, second = sorted(spans, key=lambda s: s["start"])
    assert second["start"] >= first["end"] - 0.05, spans  # no overlap


DOC_HOLDER = """
import json, sys, time
from nectar.pipeline.gpu_slots import doc_slot
with doc_slot("manual-1a2b3c4d") as held:
    start = time.time()
    time.sleep(2.0)
    print(json.dumps({"held": held, "start": start, "end": time.time()}))
"""


def test_doc_slot_serialises_runs_of_one_document_across_processes(prefect_server):
    """Two processes enter doc_slot for the same document; the limit is created on first use with one slot."""
    procs = [subprocess.Popen([sys.executable, "-c", DOC_HOLDER], env=prefect_server.env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)
             for _ in range(2)]
    spans = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
        spans.append(json.loads(out.strip().splitlines()[-1]))
    assert all(s["held"] for s in spans)
    first, second = sorted(spans, key=lambda s: s["start"])
    assert second["start"] >= first["end"] - 0.05, spans


def test_prefect_yaml_deploys_the_same_deployments(prefect_server, deployed, tmp_path):
    """``prefect deploy --all`` with infra/prefect.yaml registers what ``nectar deploy`` does."""
    env = prefect_server.env(NECTAR_WORK_POOL="nectar-yaml", NECTAR_DATA_DIR=str(tmp_path),
                             NECTAR_PRESET="tiny")
    dep.ensure_work_pool("nectar-yaml")
    out = subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all",
                          "--prefect-file", str(REPO_ROOT / "infra" / "prefect.yaml")],
                         env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    with client() as c:
        deps = c.read_deployments()
        mine = {f"{c.read_flow(d.flow_id).name}/{d.name}": d for d in deps if d.work_pool_name == "nectar-yaml"}
    assert {"nectar-pipeline/pipeline", "nectar-stage/chunk", "nectar-stage/train"} <= set(mine)
    assert mine["nectar-stage/train"].work_queue_name == dep.GPU_QUEUE
    assert mine["nectar-pipeline/pipeline"].parameters["preset"] == "tiny"
    assert mine["nectar-pipeline/pipeline"].pull_steps == dep.pull_steps(str(tmp_path))
