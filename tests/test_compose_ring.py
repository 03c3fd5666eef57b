"""docker/compose.yaml shares the host's IPC namespace, so its ring's name comes from the compose project:
no service writes a ring name of its own, every service takes the same one, and two projects on one host
get two names (checked with ``docker-compose config`` where a compose is installed). The Kubernetes
manifests keep the ring in a pod's own /dev/shm."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

DOCKER = Path(__file__).resolve().parent.parent / "docker"
COMPOSE = DOCKER / "compose.yaml"


def ring_of(service: dict) -> str | None:
    env = service.get("environment") or {}
    if isinstance(env, list):  # the KEY=VALUE form
        env = dict(item.split("=", 1) for item in env)
    return env.get("BLINK_RING")


def test_every_service_takes_the_ring_name_from_the_project() -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    rings = {name: ring_of(service) for name, service in services.items()}
    assert None not in rings.values(), rings  # each says which ring (no image default is relied on)
    assert len(set(rings.values())) == 1, rings
    ring = rings["engine"]
    assert "${COMPOSE_PROJECT_NAME" in ring and "blink-ring" not in ring
    for name, service in services.items():  # no ring name on a command line either
        assert "--ring" not in " ".join(map(str, service.get("command") or [])), name
        assert service.get("ipc") == "host", name


def compose_command() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return None


def config(compose: list[str], project: str | None, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "COMPOSE_PROJECT_NAME"}
    if project is not None:
        env["COMPOSE_PROJECT_NAME"] = project
    return subprocess.run([*compose, "-f", str(COMPOSE), *args, "config"], capture_output=True, text=True,
                          env=env, cwd=DOCKER, timeout=120)


def test_two_projects_get_two_rings() -> None:
    compose = compose_command()
    if compose is None:
        pytest.skip("no docker-compose or docker compose installed")
    names = {}
    for project in ("alpha", "beta"):
        out = config(compose, project)
        assert out.returncode == 0, out.stderr
        services = yaml.safe_load(out.stdout)["services"]
        names[project] = {ring_of(s) for s in services.values()}
    assert names == {"alpha": {"blink-alpha"}, "beta": {"blink-beta"}}
    if compose == ["docker-compose"]:  # 1.x: -p alone does not reach the file, which is refused, not shared
        out = config(compose, None, "-p", "gamma")
        assert out.returncode != 0 and "COMPOSE_PROJECT_NAME" in out.stderr
    else:  # v2: the project name, however given, is the file's COMPOSE_PROJECT_NAME
        out = config(compose, None, "-p", "gamma")
        assert out.returncode == 0, out.stderr
        assert {ring_of(s) for s in yaml.safe_load(out.stdout)["services"].values()} == {"blink-gamma"}


def test_kubernetes_pods_keep_the_ring_to_themselves() -> None:
    for manifest in sorted((DOCKER / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(manifest.read_text()):
            if not doc:
                continue
            text = yaml.safe_dump(doc)
            assert "hostIPC: true" not in text, manifest.name
            pod = doc.get("spec", {}).get("template", {}).get("spec")
            if pod is None:
                continue
            shm = [m for c in pod["containers"] for m in c.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
            volumes = {v["name"]: v for v in pod.get("volumes", [])}
            assert shm, manifest.name
            assert all(volumes[m["name"]].get("emptyDir", {}).get("medium") == "Memory" for m in shm), manifest.name
