"""Cluster manifests follow the documented schemas; a sweep on a real multi-node Ray cluster survives a lost node."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import yaml

from autocompress.config.build import run_spec_from_dict
from autocompress.config.compose import compose_dict

from .conftest import ROOT
from .test_resume import TINY_RUN, kill_group, start_cli, wait_for

CLUSTER = ROOT / "cluster"
LAUNCHER = [CLUSTER / "aws.yaml", CLUSTER / "gcp.yaml"]
KUBERAY = [CLUSTER / "kuberay" / "raycluster.yaml", CLUSTER / "kuberay" / "rayjob.yaml"]

# Fields of the ray.io/v1 API reference (KubeRay 1.5+, https://docs.ray.io/en/latest/cluster/kubernetes/references/api.html)
RAY_CLUSTER_SPEC = {
    "suspend", "managedBy", "autoscalerOptions", "headServiceAnnotations", "enableInTreeAutoscaling",
    "gcsFaultToleranceOptions", "headGroupSpec", "rayVersion", "workerGroupSpecs", "authOptions",
}  # fmt: skip
HEAD_GROUP_SPEC = {"template", "headService", "enableIngress", "rayStartParams", "serviceType"}
WORKER_GROUP_SPEC = {
    "suspend", "groupName", "replicas", "minReplicas", "maxReplicas", "idleTimeoutSeconds", "rayStartParams",
    "template", "scaleStrategy", "numOfHosts",
}  # fmt: skip
RAY_JOB_SPEC = {
    "activeDeadlineSeconds", "backoffLimit", "rayClusterSpec", "submitterPodTemplate", "metadata", "clusterSelector",
    "submitterConfig", "managedBy", "deletionStrategy", "entrypoint", "runtimeEnvYAML", "jobId", "submissionMode",
    "entrypointResources", "entrypointNumCpus", "entrypointNumGpus", "ttlSecondsAfterFinished",
    "shutdownAfterJobFinishes", "suspend",
}  # fmt: skip


def ray_version() -> str:
    import ray

    return str(ray.__version__)


# --------------------------------------------------------------------------- manifests


@pytest.mark.parametrize("path", LAUNCHER, ids=lambda p: p.name)
def test_launcher_config_follows_rays_schema(path: Path) -> None:
    import jsonschema
    import ray

    config = yaml.safe_load(path.read_text())
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    jsonschema.validate(config, schema)  # unknown fields fail: the schema forbids additional properties
    types = config["available_node_types"]
    assert config["head_node_type"] in types
    gpu_types = [t for t in types if t != config["head_node_type"]]
    assert len(gpu_types) >= 2 and all("gpu" in t for t in gpu_types)
    if config["provider"]["type"] == "gcp":
        assert all(types[t]["resources"].get("GPU", 0) > 0 for t in gpu_types)
    assert config["docker"]["worker_image"].startswith(f"rayproject/ray:{ray_version()}-") and "gpu" in config["docker"]["worker_image"]
    assert any("[vllm]" in c and "pip install" in c for c in config["setup_commands"])
    assert {".venv", "results", ".git"} <= set(config["rsync_exclude"])
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        assert any("RAY_AUTH_MODE=token ray start" in c for c in config[key])
    assert "--num-cpus=0" in " ".join(config["head_start_ray_commands"])


def _cluster_spec_fields(spec: dict[str, Any]) -> None:
    assert set(spec) <= RAY_CLUSTER_SPEC, set(spec) - RAY_CLUSTER_SPEC
    assert spec["rayVersion"] == ray_version() and spec["authOptions"] == {"mode": "token"}
    assert set(spec["headGroupSpec"]) <= HEAD_GROUP_SPEC
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    for group in spec["workerGroupSpecs"]:
        assert set(group) <= WORKER_GROUP_SPEC, set(group) - WORKER_GROUP_SPEC
        (container,) = group["template"]["spec"]["containers"]
        assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    mounts = [c["volumeMounts"] for g in [spec["headGroupSpec"], *spec["workerGroupSpecs"]] for c in g["template"]["spec"]["containers"]]
    assert all({"name": "results", "mountPath": "/mnt/results"} in m for m in mounts)


@pytest.mark.parametrize("path", KUBERAY, ids=lambda p: p.name)
def test_kuberay_manifest_uses_documented_fields(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] in ("RayCluster", "RayJob")
    if doc["kind"] == "RayCluster":
        _cluster_spec_fields(doc["spec"])
        return
    assert set(doc["spec"]) <= RAY_JOB_SPEC, set(doc["spec"]) - RAY_JOB_SPEC
    _cluster_spec_fields(doc["spec"]["rayClusterSpec"])
    assert doc["spec"]["entrypoint"].startswith("python -m autocompress.sweep +scenario=h100_batched")
    assert "resume=auto" in doc["spec"]["entrypoint"] and doc["spec"]["backoffLimit"] >= 1
    pvc = yaml.safe_load((CLUSTER / "kuberay" / "results-pvc.yaml").read_text())
    assert pvc["kind"] == "PersistentVolumeClaim" and pvc["spec"]["accessModes"] == ["ReadWriteMany"]


def _commands() -> list[tuple[str, list[str]]]:
    """Every `python -m autocompress.X ARGS` in cluster/ (YAML comments and fields, README, Dockerfile)."""
    found = []
    for path in sorted(CLUSTER.rglob("*")):
        if path.is_file():
            for module, rest in re.findall(r"python -m (autocompress\.\w+)([^\n`'\\]*)", path.read_text()):
                args = [a for a in shlex.split(rest.split(" #")[0]) if not a.startswith("-")]
                if args:  # a command line, not a mention in prose
                    found.append((module, args))
    return found


def test_cluster_commands_exist_in_the_project() -> None:
    commands = _commands()
    assert {m for m, _ in commands} == {"autocompress.sweep", "autocompress.profile"} and len(commands) >= 8
    for module, args in commands:
        assert importlib.util.find_spec(module) is not None, module
        run_spec_from_dict(compose_dict(*args))  # every override names a real key with a valid value
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "vllm" in extras
    dockerfile = (CLUSTER / "Dockerfile").read_text()
    assert f"rayproject/ray:{ray_version()}-" in dockerfile and '-e ".[vllm]"' in dockerfile
    for folder in re.findall(r"COPY --chown=\S+ (\S+) ", dockerfile):
        assert (ROOT / folder).exists(), folder


# --------------------------------------------------------------------------- a real multi-node cluster on this machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalCluster:
    """Separate raylets on this machine, each `ray start --block` in its own process group (killing the group
    is losing the node), with their own temp dir and ports (other Ray instances here are left alone) and
    token authentication on, as on a real cluster."""

    def __init__(self) -> None:
        import psutil

        self._psutil = psutil
        self.temp = Path(tempfile.mkdtemp(prefix="acr", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
        token = self.temp / "auth_token"
        token.write_text(secrets.token_hex(32))
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        self.env.update(
            RAY_AUTH_MODE="token",
            RAY_AUTH_TOKEN_PATH=str(token),
            RAY_USAGE_STATS_ENABLED="0",
            RAY_health_check_period_ms="1000",  # notice a lost node in seconds, not tens of seconds
            RAY_health_check_timeout_ms="1000",
            RAY_health_check_failure_threshold="3",
        )
        self.port = _free_port()
        self.nodes: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        ports = [f"--{flag}={_free_port()}" for flag in ("dashboard-agent-listen-port", "metrics-export-port", "runtime-env-agent-port")]
        cmd = [str(Path(sys.executable).parent / "ray"), "start", "--block", "--node-ip-address=127.0.0.1", *ports, *args]
        with open(self.temp / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.nodes[name] = proc
        deadline = time.time() + 90
        while "Ray runtime started" not in (self.temp / f"{name}.log").read_text(errors="replace"):
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"node {name} did not start:\n{(self.temp / f'{name}.log').read_text()[-2000:]}")
            time.sleep(0.3)
        return proc

    def start(self, workers: int) -> None:
        head = ["--head", f"--port={self.port}", "--num-cpus=0", f"--temp-dir={self.temp}", "--include-dashboard=false"]
        self._start("head", *head, f"--ray-client-server-port={_free_port()}")
        for i in range(workers):
            self._start(f"worker{i}", f"--address={self.address}", "--num-cpus=1")

    def processes(self, name: str) -> list[Any]:
        """The live processes of node `name`: its `ray start` process and everything it started (raylet, workers)."""
        with contextlib.suppress(self._psutil.Error):
            root = self._psutil.Process(self.nodes[name].pid)
            return [root, *root.children(recursive=True)]
        return []

    def kill(self, name: str) -> None:
        kill_group(self.nodes[name])
        self.nodes[name].wait(timeout=30)

    def shutdown(self) -> None:
        """Kill every node's group, then any process still naming this cluster's temp dir (a stray worker)."""
        for proc in self.nodes.values():
            kill_group(proc)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
        for p in self._psutil.process_iter(["pid", "cmdline"]):
            with contextlib.suppress(self._psutil.Error):
                if str(self.temp) in " ".join(p.info["cmdline"] or []):
                    p.kill()
        shutil.rmtree(self.temp, ignore_errors=True)


@pytest.fixture
def local_cluster() -> Iterator[LocalCluster]:
    cluster = LocalCluster()
    try:
        yield cluster
    finally:
        cluster.shutdown()


def _running_trial(cluster: LocalCluster, name: str) -> bool:
    for p in cluster.processes(name):
        with contextlib.suppress(Exception):
            if "ImplicitFunc" in " ".join(p.cmdline()) or "ImplicitFunc" in p.name():
                return True
    return False


@pytest.mark.cluster
def test_sweep_on_a_multi_node_cluster_survives_a_lost_node(tmp_path: Path, local_cluster: LocalCluster) -> None:
    local_cluster.start(workers=2)
    log, run = tmp_path / "sweep.log", tmp_path / "cpu_interactive" / "mn"
    args = [*TINY_RUN, "search.steps=150", "sweep.num_trials=4", "sweep.max_failures=2", f"results.dir={tmp_path}"]
    args += ["results.run_id=mn", f"ray.address={local_cluster.address}"]
    sweep = start_cli("autocompress.sweep", *args, log=log, env=local_cluster.env)
    try:
        wait_for(log, "running 4 of 4 searches", sweep, timeout=120)
        deadline = time.time() + 120
        while not _running_trial(local_cluster, "worker0"):  # lose the node while it runs a search
            assert time.time() < deadline and sweep.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(1.0)
        local_cluster.kill("worker0")
        assert sweep.wait(timeout=240) == 0, log.read_text()[-3000:]
    finally:
        kill_group(sweep, signal.SIGKILL)
    text = log.read_text()
    trials = pd.read_parquet(run / "trials.parquet")
    assert len(trials) == 4 and (trials["status"] == "ok").all(), trials[["status", "error"]]
    assert re.search(r"failed \(attempt 1 of 3\): .*; retrying", text), text[-3000:]  # the lost node's trial ran again
    assert json.loads((run / "metadata.json").read_text())["status"] == "complete"
