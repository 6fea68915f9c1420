"""docker-compose.yml, the env example and the Dockerfile: validated without running docker.

`docker-compose config -q` (Debian's docker-compose v1) runs when the binary is installed
and skips otherwise; this test installs nothing. The structure checks need only PyYAML (a
transformers dependency).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from pagedserve.flags import FLAGS, env_name

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / "deploy" / "pagedserve.env.example"
FLAG_ENV_NAMES = {env_name(flag) for flag, *_ in FLAGS}


@pytest.fixture(scope="module")
def compose() -> dict:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load(COMPOSE.read_text())


def _env_file_names(path: Path) -> list[str]:
    names = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            names.append(line.split("=", 1)[0])
    return names


@pytest.mark.skipif(shutil.which("docker-compose") is None,
                    reason="docker-compose (v1) not installed")
def test_docker_compose_config_validates(tmp_path):
    result = subprocess.run(["docker-compose", "-f", str(COMPOSE), "config", "-q"],
                            capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
    # the scaled service must stay scalable: the resolved config names no container
    resolved = subprocess.run(["docker-compose", "-f", str(COMPOSE), "config"],
                              capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert resolved.returncode == 0, resolved.stderr
    assert "PAGEDSERVE_ROUTER: tcp://router:5557" in resolved.stdout


def test_services_router_and_scalable_executor(compose):
    services = compose["services"]
    assert set(services) == {"keygen", "router", "executor", "executor-decode"}
    router, executor = services["router"], services["executor"]
    assert "container_name" not in executor  # `--scale executor=N`
    assert "ports" not in executor  # executors connect out; they open no port
    assert executor["command"] == ["executor"] and router["command"] == ["router"]
    assert executor["depends_on"]["router"]["condition"] == "service_healthy"
    published = [str(p).rsplit(":", 1)[-1] for p in router["ports"]]
    assert sorted(published) == ["50051", "8000", "9400"]  # gRPC, HTTP, metrics; never 5557
    assert executor["volumes"] == router["volumes"]
    assert router["volumes"][0].endswith(":/models:ro")


def test_decode_executors_are_the_executor_in_decode_mode_behind_a_profile(compose):
    """Disaggregation is opt-in: `executor-decode` starts only with its profile, and is
    the executor service but for its mode (the executor's own mode from EXECUTOR_MODE)."""
    services = compose["services"]
    executor, decode = services["executor"], services["executor-decode"]
    assert decode["profiles"] == ["disaggregated"] and "profiles" not in executor
    assert executor["environment"]["PAGEDSERVE_DISAGGREGATION_MODE"] == \
        "${EXECUTOR_MODE:-null}"
    assert decode["environment"] == {**executor["environment"],
                                     "PAGEDSERVE_DISAGGREGATION_MODE": "decode"}
    same = {k: v for k, v in executor.items() if k != "environment"}
    assert {k: v for k, v in decode.items() if k not in ("environment", "profiles")} == same


def test_router_healthcheck_uses_pagedserve_healthcheck(compose):
    test = compose["services"]["router"]["healthcheck"]["test"]
    assert test[:3] == ["CMD", "pagedserve", "healthcheck"]
    assert test[test.index("--service") + 1] == ""


def test_wiring_by_service_name_and_curve_on_the_executor_socket(compose):
    services = compose["services"]
    router_env = services["router"]["environment"]
    executor_env = services["executor"]["environment"]
    assert executor_env["PAGEDSERVE_ROUTER"] == "tcp://router:5557"
    assert router_env["PAGEDSERVE_EXECUTOR_BIND"] == "tcp://0.0.0.0:5557"
    # CURVE covers the non-loopback bind: keys from the one-shot keygen service, no
    # --allow-insecure anywhere
    assert router_env["PAGEDSERVE_CURVE_KEYS"] == executor_env["PAGEDSERVE_CURVE_KEYS"] == "/keys"
    assert "ALLOW_INSECURE" not in COMPOSE.read_text().split("services:")[1]
    assert "keys:/keys:ro" in services["router"]["volumes"]
    assert services["executor"]["volumes"] == services["router"]["volumes"]
    assert services["router"]["depends_on"]["keygen"]["condition"] == \
        "service_completed_successfully"
    keygen = services["keygen"]
    assert "pagedserve keygen /keys --exist-ok" in " ".join(keygen["command"])  # idempotent
    assert keygen["volumes"] == ["keys:/keys"] and "ports" not in keygen
    assert "keys" in compose["volumes"]


def test_environment_names_are_real_flags(compose):
    names = list(_env_file_names(ENV_EXAMPLE))
    for service in compose["services"].values():
        names += list(service.get("environment", {}))
    unknown = sorted(n for n in names if n.startswith("PAGEDSERVE_") and n not in FLAG_ENV_NAMES)
    assert not unknown, f"not PAGEDSERVE_<FLAG> of pagedserve.flags.FLAGS: {unknown}"
    assert all(n.startswith("PAGEDSERVE_") for n in _env_file_names(ENV_EXAMPLE))
    assert "PAGEDSERVE_MODEL" in names


def test_env_example_values_parse_as_their_flags():
    types = {env_name(flag): type_ for flag, type_, *_ in FLAGS}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, value = line.split("=", 1)
            types[name](value)  # raises on a bad value, as `pagedserve` would


def test_dockerfile_cpu_by_default_with_cuda_switch():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", text, re.M)
    assert re.search(r"^ARG TORCH_INDEX=https://download\.pytorch\.org/whl/cpu$", text, re.M)
    assert "-c constraints.txt" in text
    assert re.search(r'^ENTRYPOINT \["pagedserve"\]$', text, re.M)
    # every package folder of pyproject's package-dir is copied into the image
    for folder in ("pagedserve", "protos", "kvmanager", "router", "executor", "kernels"):
        assert re.search(rf"^COPY {folder} \./{folder}$", text, re.M), folder
