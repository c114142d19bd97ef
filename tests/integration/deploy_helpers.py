"""Helpers for the deploy tests: the image's entrypoint, and running a container's argv
as a local ``kiln serve`` subprocess (the only way to run it without a container engine)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.integration.test_deploy_files import metric_names

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"

# Custom resources the Kubernetes schemas do not know: (apiVersion, required dotted paths).
KNOWN_CRDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "ServiceMonitor": ("monitoring.coreos.com/v1", ("spec.selector.matchLabels", "spec.endpoints")),
    "PrometheusRule": ("monitoring.coreos.com/v1", ("spec.groups",)),
    "ClusterServingRuntime": (
        "serving.kserve.io/v1alpha1",
        ("spec.supportedModelFormats", "spec.protocolVersions", "spec.containers"),
    ),
    "InferenceService": (
        "serving.kserve.io/v1beta1",
        ("spec.predictor.model.modelFormat.name", "spec.predictor.model.storageUri"),
    ),
}


def dockerfile_instruction(path: Path, name: str) -> str:
    """The last ``NAME ...`` instruction of a Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", path.read_text())
    found = [line for line in text.splitlines() if line.startswith(name + " ")]
    assert found, (path, name)
    return found[-1][len(name) + 1 :].strip()


ENTRYPOINT: list[str] = json.loads(dockerfile_instruction(DOCKERFILE, "ENTRYPOINT"))


def container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in pod["containers"] if c["name"] == name]
    return found


def metric_names_in(promql: str) -> set[str]:
    """Metric names in a PromQL expression or an adapter template (``<<.Series>>`` cut)."""
    return metric_names(re.sub(r"<<[^>]*>>", "", promql))


def scrape_names(url: str) -> set[str]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {
        re.split(r"[{ ]", line, maxsplit=1)[0]
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def run_container(
    argv: list[str], mounts: dict[str, Path], workdir: Path, http_port: int
) -> subprocess.Popen[bytes]:
    """Start a container's command line here: ``kiln`` is this interpreter's, the
    container's paths (``mounts``) map to local folders, 0.0.0.0 binds to loopback."""
    prefix: list[str] = []
    if argv[0] == "kiln":
        # The interpreter's own path is never a container path (the checkout may live
        # under /tmp, which is also a mount below).
        prefix, argv = [sys.executable, "-m", "kiln"], argv[1:]
    local = list(prefix)
    for arg in argv:
        arg = arg.replace("0.0.0.0", "127.0.0.1")
        for inside, outside in mounts.items():
            pattern = rf"(^|=){re.escape(inside)}(?=/|$)"
            if re.search(pattern, arg):  # one mount per arg: outside may be under /tmp
                arg = re.sub(pattern, rf"\g<1>{outside}", arg)
                break
        local.append(arg)
    log = workdir / "kiln.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", XDG_STATE_HOME=str(workdir / "state"))
    with open(log, "wb") as out:
        proc = subprocess.Popen(local, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{local} exited {proc.returncode}:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=1):
                return proc
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.1)
    proc.kill()
    proc.wait()
    raise TimeoutError(f"{local} not ready:\n{log.read_text()}")
