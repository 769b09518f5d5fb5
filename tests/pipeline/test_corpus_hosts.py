"""A corpus over two hosts, on this machine: PostgreSQL → Prefect server → two workers in network
namespaces of their own (own hostname, own PREFECT_HOME, reaching only the server's address over a
veth pair, sharing the run directories by path as an NFS mount would) — see hosts.py.

`nectar trigger DOCS/ --wait` runs 4 tiny-preset documents. The test watches the runs land on both
workers, then kills every process of host-a while its document is mid-run (the host loses power).
Prefect marks that flow run Crashed when its heartbeats stop (the automation `nectar deploy`
creates), the corpus command retries it, host-b takes it over — the run lock and the document's
slot of the dead host expire — and finishes it from the stage it reached. Then `nectar status` of
the corpus, the corpus artifact, and a second `nectar trigger` that skips all four.

Real PostgreSQL, real server, real workers and flow runs; the only injected fault is the kill.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import pytest

from nectar.orchestration.corpus import progress
from nectar.pipeline import deploy as dep

from hosts import Unavailable, kill_namespace, postgres, prefect_server_on, private_network, worker_on_host
from prefect_procs import REPO_ROOT

# Under a load average of 35 on the 2 cores, checking the 4 documents took 3.5 min and a tiny run 4.5 min:
# the limits leave room for that (the test took 9 min at load 11-14).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

POOL = "nectar-hosts"
TOPICS = ("naming", "function", "calls", "numeric-types")  # pydoc topics of similar length (~6 k chars)
CRASH_AFTER_S = 60  # 2x the workers' heartbeat period below: a loaded machine's late beat is not a death
HOST_ENV = {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30", "NECTAR_LOCK_HEARTBEAT_S": "3", "NECTAR_LOCK_STALE_S": "15",
            "NECTAR_SLOT_LEASE_S": "60", "OMP_NUM_THREADS": "1"}


def _client():
    from prefect.client.orchestration import get_client

    return get_client(sync_client=True)


def _corpus_runs(tag: str):
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    with _client() as c:
        return c.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[tag])))


def _submissions(flow_run_id) -> list[str]:
    """The hosts that ran the flow run's attempts, oldest first (each attempt's first log line names
    its host; a worker's "submitting" line is not proof: two workers can both claim a run, the
    server then rejects one — seen at a load average of 100)."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    from nectar.pipeline.flows import RUNS_ON

    with _client() as c:
        logs = c.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])),
                           sort=LogSort.TIMESTAMP_ASC, limit=200)
    return [log.message[len(RUNS_ON):].split()[0] for log in logs if log.message.startswith(RUNS_ON)]


@pytest.fixture
def cluster(tmp_path: Path):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with ExitStack() as stack:
        try:
            db = stack.enter_context(postgres())
            net = stack.enter_context(private_network(["host-a", "host-b"]))
        except Unavailable as exc:
            pytest.skip(str(exc))
        server = stack.enter_context(prefect_server_on(db, net.server_ip, tmp_path / "server"))
        stack.enter_context(temporary_settings(updates={PREFECT_API_URL: server.api_url}))
        shared = tmp_path / "shared"  # what both hosts mount
        (shared / "docs").mkdir(parents=True)
        from pydoc_data.topics import topics

        for name in TOPICS:
            (shared / "docs" / f"{name}.txt").write_text(topics[name])
        dep.deploy(pool=POOL, preset="tiny", working_dir=str(shared), crash_after_s=CRASH_AFTER_S)
        workers = {h: stack.enter_context(worker_on_host(server, net, h, POOL, tmp_path / h, **HOST_ENV))
                   for h in net.hosts}
        yield {"server": server, "net": net, "shared": shared, "workers": workers, "db": db}


def _nectar(server, *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "nectar.pipeline.cli", *args], env=server.env(), cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def test_a_corpus_over_two_hosts_survives_a_dead_host(cluster):
    server, net, shared = cluster["server"], cluster["net"], cluster["shared"]
    started = time.monotonic()
    cli = _nectar(server, "trigger", str(shared / "docs"), "--wait", "--retries", "2", "--timeout", "2000",
                  "--corpus", "four")
    try:
        _corpus_with_a_dead_host(cluster, cli, started)
    finally:
        if cli.poll() is None:  # a failed or interrupted test leaves no command behind
            cli.kill()
            cli.wait(10)


def _corpus_with_a_dead_host(cluster, cli: subprocess.Popen, started: float) -> None:
    server, net, shared = cluster["server"], cluster["net"], cluster["shared"]

    # Both hosts take runs (each worker runs one at a time); kill host-a while its run is mid-pipeline.
    killed_run, deadline = None, time.monotonic() + 1200
    while killed_run is None and time.monotonic() < deadline and cli.poll() is None:
        running = [fr for fr in _corpus_runs("corpus:four") if fr.state and fr.state.type.value == "RUNNING"]
        on = {fr.id: (_submissions(fr.id) or ["?"])[-1] for fr in running}
        if {"host-a", "host-b"} <= set(on.values()):
            victim = next(fr for fr in running if on[fr.id] == "host-a")
            run_dir = victim.parameters["run_dir"]
            if (Path(run_dir) / "chunk" / "manifest.json").exists():  # at least one stage behind it
                assert kill_namespace(net.hosts["host-a"][0]), "host-a had no process to kill"
                killed_run = victim
                killed_at = time.monotonic()
        time.sleep(1.0)
    assert killed_run is not None, f"never saw both hosts running:\n{cli.stdout.read() if cli.poll() is not None else ''}"

    out, _ = cli.communicate(timeout=2100)
    elapsed = time.monotonic() - started
    assert cli.returncode == 0, out[-6000:]
    assert "corpus four: 4 done" in out, out[-4000:]

    runs = _corpus_runs("corpus:four")
    assert len(runs) == 4 and all(fr.state.type.value == "COMPLETED" for fr in runs), \
        [(fr.name, fr.state.name) for fr in runs]
    hosts_used = {h for fr in runs for h in _submissions(fr.id)}
    assert hosts_used == {"host-a", "host-b"}, hosts_used

    # The killed document: Crashed by the heartbeat automation, retried, finished by host-b.
    with _client() as c:
        states = [s.type.value for s in c.read_flow_run_states(killed_run.id)]
        final = c.read_flow_run(killed_run.id)
    assert "CRASHED" in states and states[-1] == "COMPLETED", states
    assert _submissions(killed_run.id)[0] == "host-a" and _submissions(killed_run.id)[-1] == "host-b"
    assert final.run_count >= 2
    for fr in runs:
        assert progress(fr.parameters["run_dir"], verify=True).state == "done", fr.parameters["run_dir"]

    # The corpus artifact: one table, four rows, all done.
    with _client() as c:
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

        arts = c.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["corpus-four"])))
    latest = max(arts, key=lambda a: a.created)
    rows = latest.data if isinstance(latest.data, list) else __import__("json").loads(latest.data)
    assert sorted(r["state"] for r in rows) == ["done"] * 4

    # `nectar status` of the corpus: four complete runs.
    status = _nectar(server, "status", str(shared / "runs"))
    text, _ = status.communicate(timeout=300)
    assert status.returncode == 0, text
    assert "4 runs: 4 complete" in text, text[-3000:]

    # Again: every document is finished, nothing is triggered.
    again = _nectar(server, "trigger", str(shared / "docs"), "--corpus", "four")
    text, _ = again.communicate(timeout=300)
    assert again.returncode == 0 and "4 skipped" in text, text[-3000:]
    assert len(_corpus_runs("corpus:four")) == 4
    print(f"\ncorpus of 4 over 2 hosts: {elapsed:.0f} s, host-a killed {killed_at - started:.0f} s in; "
          f"load {os.getloadavg()}")
