"""A real ``nectar serve`` child process on a free port, for the server tests and the benchmark."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]


class ServerProcess:
    """A real ``nectar serve`` child process; its output goes to files (a full pipe would block it)."""

    def __init__(self, run_dir: str | list[str], logs: Path, *args: str, api_key: str | None = None):
        runs = [run_dir] if isinstance(run_dir, str) else list(run_dir)
        env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        env.pop("NECTAR_API_KEY", None)
        keys = ["--api-key", api_key] if api_key else []
        self.api_key = api_key or "unused"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.out, self.err = logs / "stdout.txt", logs / "stderr.txt"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nectar.pipeline.cli", "serve", *runs, "--port", "0", *keys, *args],
            stdout=self.out.open("w"), stderr=self.err.open("w"), env=env, cwd=REPO)
        self.url = self._wait_for_url(timeout=180)
        self.models = [m["id"] for m in httpx.get(f"{self.url}/models", headers=self.headers).json()["data"]]
        self.model = self.models[0]

    def _wait_for_url(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.out.read_text().splitlines():
                if " on http://" in line and "model(s)" in line:
                    url = line.split(" on ", 1)[1].strip()
                    self._wait_healthy(url.removesuffix("/v1"), deadline)
                    return url
            if self.proc.poll() is not None:
                raise RuntimeError(f"nectar serve exited with {self.proc.returncode}:\n{self.err.read_text()[-3000:]}")
            time.sleep(0.2)
        self.proc.kill()
        raise TimeoutError(f"nectar serve did not start in {timeout} s:\n{self.err.read_text()[-3000:]}")

    @staticmethod
    def _wait_healthy(root: str, deadline: float) -> None:
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{root}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)

    @property
    def root(self) -> str:
        return self.url.removesuffix("/v1")

    def health(self) -> dict:
        return httpx.get(f"{self.root}/health").json()

    def terminate(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
