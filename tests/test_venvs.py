"""nectar.venvs: the one venv builder (vLLM's and kvpress's venvs): built once, stamped last, a failed
step is one line naming the fix and the log; the stamps the two venvs had before keep them ready."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from nectar import venvs


class ToyEnvError(venvs.VenvError):
    pass


def _spec(tmp_path: Path, steps) -> venvs.VenvSpec:
    return venvs.VenvSpec(name="toy", root=tmp_path / "toy-venv", stamp="stamp.json", pins=("toy==1",),
                          steps=tuple(steps), fix="fix: do the thing", log=tmp_path / "toy-setup.log",
                          base_python=sys.executable, error=ToyEnvError, step_timeout_s=120)


def test_a_venv_is_built_once_and_stamped_last(tmp_path):
    ran = tmp_path / "ran"
    spec = _spec(tmp_path, [("-c", f"open({str(ran)!r}, 'a').write('x')")])
    assert not venvs.ready(spec)
    said = []
    facts = venvs.ensure(spec, echo=said.append)
    assert venvs.ready(spec) and facts["pins"] == ["toy==1"] and facts["bytes"] > 0
    assert json.loads((spec.root / "stamp.json").read_text())["pins"] == ["toy==1"]
    assert "$ " in spec.log.read_text() and len(said) == 2
    assert venvs.ensure(spec) == facts and ran.read_text() == "x"  # ready: nothing run again
    other_pins = dataclasses.replace(spec, pins=("toy==2",))
    assert not venvs.ready(other_pins)  # a pin changed: built again


def test_a_failing_step_is_one_line_with_the_fix_and_the_log(tmp_path):
    spec = _spec(tmp_path, [("-c", "import sys; print('no wheel for toy'); sys.exit(3)")])
    with pytest.raises(ToyEnvError) as err:
        venvs.ensure(spec)
    message = str(err.value)
    assert "\n" not in message
    assert "toy venv:" in message and "exit 3" in message and "no wheel for toy" in message
    assert "fix: do the thing" in message and str(spec.log) in message
    assert not venvs.ready(spec)  # no stamp: the next call builds again


def test_the_vllm_and_kvpress_stamps_written_before_keep_their_venvs_ready(tmp_path, monkeypatch):
    from nectar.kvpress.env import MARKER, _pins, read_env
    from nectar.vllm.venv import STAMP, _pins as vllm_pins, venv_ready

    vllm_root, kv_root = tmp_path / "vllm-venv", tmp_path / "kvpress-venv"
    monkeypatch.setenv("NECTAR_VLLM_VENV", str(vllm_root))
    for root in (vllm_root, kv_root):
        (root / "bin").mkdir(parents=True)
        (root / "bin" / "python").write_text("")
    assert not venv_ready() and read_env(kv_root) is None
    # the stamps as the two builders wrote them before there was one builder
    assert STAMP == ".nectar-vllm-installed" and MARKER == "nectar-env.json"
    (vllm_root / STAMP).write_text(json.dumps({"pins": list(vllm_pins()), "seconds": 91.0}))
    (kv_root / MARKER).write_text(json.dumps({"pins": _pins(), "build_s": 121.5, "bytes": 1, "python": "3.11.7"},
                                             indent=1))
    assert venv_ready()
    env = read_env(kv_root)
    assert env is not None and env.facts["build_s"] == 121.5 and env.python == kv_root / "bin" / "python"


def test_the_vllm_plugin_entry_point_installs_into_a_fresh_venv_once(tmp_path):
    """``ensure_plugin`` on a new venv (as on a fresh machine's vLLM venv): the entry point vLLM looks up is
    there afterwards, a second call changes nothing, and the checkout gains no build files."""
    import subprocess

    from nectar.vllm.venv import PLUGIN_DIR, ensure_plugin, plugin_installed

    before = sorted(p.name for p in PLUGIN_DIR.iterdir())
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "venv")], check=True)
    python = str(tmp_path / "venv" / "bin" / "python")
    assert not plugin_installed(python)
    ensure_plugin(python, log_path=tmp_path / "plugin.log")
    assert plugin_installed(python)
    probe = ("import importlib.metadata as m; "
             "print([e.value for e in m.entry_points(group='vllm.general_plugins') if e.name == 'nectar'])")
    out = subprocess.run([python, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['nectar_vllm_entry:register']"
    mtime = (tmp_path / "plugin.log").stat().st_mtime_ns
    ensure_plugin(python, log_path=tmp_path / "plugin.log")  # already there: no pip run, the log untouched
    assert (tmp_path / "plugin.log").stat().st_mtime_ns == mtime
    assert sorted(p.name for p in PLUGIN_DIR.iterdir()) == before
