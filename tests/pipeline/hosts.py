"""Several "hosts" on one machine, for the multi-host test: a real PostgreSQL cluster (Debian's
postgresql, a throwaway data directory on 127.0.0.1), a Prefect server backed by it, and Prefect
workers that each run in a network namespace of their own with their own hostname (UTS namespace)
and their own PREFECT_HOME — all a second machine would have — joined to the server by a veth pair
on a private bridge. Nothing is routed off the machine: the bridge has no uplink and the namespaces
have no route but their /24.

Everything started here is stopped by its pid (and the namespaces and links deleted) on exit.
Each context manager raises ``Unavailable`` with the reason when the machine can't provide it
(no root, no ``ip netns``, no PostgreSQL), for the test to skip with.
"""
from __future__ import annotations

import glob
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from prefect_procs import PREFECT, REPO_ROOT, PrefectServer, _wait_healthy, free_port, stop_process_group


class Unavailable(RuntimeError):
    """What this machine lacks for the multi-host test (the skip reason)."""


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=60)


# ------------------------------------------------------------------------------------- PostgreSQL

def _pg_bin(name: str) -> str:
    hits = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if not hits:
        raise Unavailable(f"PostgreSQL's {name} not found under /usr/lib/postgresql (apt-get install postgresql)")
    return hits[-1]


@dataclass
class Postgres:
    url: str  # postgresql+asyncpg://… for Prefect
    data: Path
    pid: int


@contextmanager
def postgres() -> Iterator[Postgres]:
    """A fresh cluster owned by the ``postgres`` user (PostgreSQL refuses to run as root), listening
    on 127.0.0.1 only, trust auth (loopback, throwaway), stopped and deleted at the end."""
    initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
    if os.geteuid() != 0:
        raise Unavailable("needs root to run PostgreSQL as the postgres user")
    if _run("id", "-u", "postgres", check=False).returncode != 0:
        raise Unavailable("no postgres system user (apt-get install postgresql creates it)")
    root = Path(tempfile.mkdtemp(prefix="nectar-pg-", dir="/tmp"))
    shutil.chown(root, "postgres", "postgres")
    data, port = root / "data", free_port()
    as_pg = ["runuser", "-u", "postgres", "--"]
    started = False
    try:
        _run(*as_pg, initdb, "-D", str(data), "-A", "trust", "-U", "prefect", "--no-sync")
        _run(*as_pg, pg_ctl, "-D", str(data), "-l", str(root / "postgres.log"), "-w", "-t", "60", "-o",
             f"-c listen_addresses=127.0.0.1 -p {port} -k {root} -c fsync=off", "start")
        started = True
        pid = int((data / "postmaster.pid").read_text().split()[0])
        _run(*as_pg, _pg_bin("createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "prefect", "prefect")
        yield Postgres(f"postgresql+asyncpg://prefect@127.0.0.1:{port}/prefect", data, pid)
    except subprocess.CalledProcessError as exc:
        raise Unavailable(f"PostgreSQL did not start: {exc.cmd[-1]}: {exc.stderr.strip()[-300:]}") from None
    finally:
        if started:
            _run(*as_pg, pg_ctl, "-D", str(data), "-m", "fast", "-w", "stop", check=False)
        shutil.rmtree(root, ignore_errors=True)


# ------------------------------------------------------------------------------ network namespaces

@dataclass
class Network:
    bridge: str
    server_ip: str
    hosts: dict[str, tuple[str, str]]  # host name → (namespace, its address)


@contextmanager
def private_network(host_names: list[str]) -> Iterator[Network]:
    """A bridge with the server's address and, per host, a namespace joined to it by a veth pair."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        raise Unavailable("needs root and iproute2's `ip` for network namespaces")
    tag = secrets.token_hex(2)
    subnet = f"10.213.{int(tag, 16) % 250 + 1}"
    bridge, namespaces, links = f"nxbr{tag}", [], []
    probe = _run("ip", "netns", "add", f"nx{tag}probe", check=False)
    if probe.returncode != 0:
        raise Unavailable(f"`ip netns add` failed (no CAP_SYS_ADMIN in this container?): {probe.stderr.strip()}")
    _run("ip", "netns", "del", f"nx{tag}probe", check=False)
    try:
        _run("ip", "link", "add", bridge, "type", "bridge")
        links.append(bridge)
        _run("ip", "addr", "add", f"{subnet}.1/24", "dev", bridge)
        _run("ip", "link", "set", bridge, "up")
        hosts = {}
        for i, name in enumerate(host_names):
            ns, outer, inner = f"nx{tag}{name}", f"nx{tag}o{i}", f"nx{tag}i{i}"
            _run("ip", "netns", "add", ns)
            namespaces.append(ns)
            _run("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
            links.append(outer)
            _run("ip", "link", "set", outer, "master", bridge)
            _run("ip", "link", "set", outer, "up")
            _run("ip", "link", "set", inner, "netns", ns)
            addr = f"{subnet}.{10 + i}"
            _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", inner)
            _run("ip", "-n", ns, "link", "set", inner, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            hosts[name] = (ns, addr)
        yield Network(bridge, f"{subnet}.1", hosts)
    finally:
        for ns in namespaces:
            kill_namespace(ns)
            _run("ip", "netns", "del", ns, check=False)
        for link in links:
            _run("ip", "link", "del", link, check=False)


def namespace_pids(ns: str) -> list[int]:
    out = _run("ip", "netns", "pids", ns, check=False).stdout.split()
    return [int(p) for p in out if p.isdigit()]


def kill_namespace(ns: str) -> list[int]:
    """SIGKILL every process in the namespace: the host loses power (the worker and its flow runs)."""
    pids = namespace_pids(ns)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


# ---------------------------------------------------------------------------------- server, workers

@contextmanager
def prefect_server_on(db: Postgres, host: str, home: Path) -> Iterator[PrefectServer]:
    """``prefect server start`` on ``host`` (the bridge address), its database the PostgreSQL above."""
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    server = PrefectServer(f"http://{host}:{port}/api", home, None, home / "server.log")  # type: ignore[arg-type]
    env = server.env(PREFECT_API_DATABASE_CONNECTION_URL=db.url, PREFECT_SERVER_UI_ENABLED="false")
    env.pop("PREFECT_API_URL")
    with open(server.log_path, "w") as log:
        server.process = subprocess.Popen(
            [*PREFECT, "server", "start", "--host", host, "--port", str(port), "--analytics-off"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_healthy(server, 120.0)
        yield server
    finally:
        stop_process_group(server.process)


@contextmanager
def worker_on_host(server: PrefectServer, net: Network, name: str, pool: str, home: Path,
                   limit: int = 1, **env: str) -> Iterator[subprocess.Popen]:
    """A process worker inside host ``name``'s namespace, with its own hostname and PREFECT_HOME: it
    reaches only the server's address (and the shared run directory, like an NFS mount)."""
    ns, _ = net.hosts[name]
    home.mkdir(parents=True, exist_ok=True)
    worker_env = server.env(PREFECT_HOME=str(home), PREFECT_LOCAL_STORAGE_PATH=str(home / "storage"),
                            PREFECT_RESULTS_PERSIST_BY_DEFAULT="false", PREFECT_WORKER_QUERY_SECONDS="1",
                            PREFECT_WORKER_PREFETCH_SECONDS="5", **env)
    cmd = ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c",
           f'hostname {name} && exec "$@"', "sh", *PREFECT, "worker", "start", "--pool", pool,
           "--type", "process", "--name", name, "--limit", str(limit)]
    with open(home / "worker.log", "w") as log:
        proc = subprocess.Popen(cmd, env=worker_env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        yield proc
    finally:
        stop_process_group(proc, grace_s=10)
        kill_namespace(ns)  # any flow run the worker left behind
