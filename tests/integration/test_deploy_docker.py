"""deploy/docker: both Dockerfiles pass hadolint, the build context holds what they COPY,
and their install step (deploy/docker/install.sh, the very script the images run) installs
a kiln wheel built from this tree into a fresh venv whose entrypoint serves and passes the
image's HEALTHCHECK. No Docker engine here, so the image itself is never built."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.integration.deploy_helpers import ENTRYPOINT, dockerfile_instruction, run_container

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "deploy" / "docker"
DOCKERFILES = (DOCKER / "Dockerfile", DOCKER / "Dockerfile.cuda")
HADOLINT = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")


def test_hadolint_passes() -> None:
    out = subprocess.run(
        [HADOLINT, "--no-color", *map(str, DOCKERFILES)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN cd /src && pip install kiln-serve\n")
    assert subprocess.run([HADOLINT, str(bad)], capture_output=True, timeout=60).returncode != 0


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_contract(dockerfile: Path) -> None:
    assert json.loads(dockerfile_instruction(dockerfile, "ENTRYPOINT")) == ENTRYPOINT
    assert ENTRYPOINT[:2] == ["kiln", "serve"] and "/models" in ENTRYPOINT
    assert dockerfile_instruction(dockerfile, "USER").split(":")[0] != "0"
    assert dockerfile_instruction(dockerfile, "EXPOSE").split() == ["8000", "8001", "8002"]
    assert dockerfile_instruction(dockerfile, "STOPSIGNAL") == "SIGTERM"
    assert "/v2/health/ready" in dockerfile_instruction(dockerfile, "HEALTHCHECK")
    assert '"/models"' in dockerfile_instruction(dockerfile, "VOLUME")
    assert "kiln-install" in dockerfile.read_text()  # the tested install script


def test_build_context_holds_what_the_dockerfiles_copy() -> None:
    # .dockerignore: '*' then '!path' exceptions (the only form used there)
    lines = [x.strip() for x in (ROOT / ".dockerignore").read_text().splitlines()]
    kept = [x[1:].rstrip("/") for x in lines if x.startswith("!")]
    assert "*" in lines
    for dockerfile in DOCKERFILES:
        for line in re.sub(r"\\\n", " ", dockerfile.read_text()).splitlines():
            if line.startswith("COPY ") and "--from=" not in line:
                for src in line.split()[1:-1]:
                    src = src.rstrip("/")
                    assert (ROOT / src).exists(), src
                    assert any(fnmatch.fnmatch(src, k) or src.startswith(k + "/") for k in kept), (
                        src
                    )


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The kiln wheel, built from this tree as the image's build stage builds it."""
    out = tmp_path_factory.mktemp("wheel")
    # The build stage's context: pyproject.toml, README.md and src/ only.
    context = tmp_path_factory.mktemp("context")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, context / name)
    shutil.copytree(
        ROOT / "src", context / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
    )
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--quiet",
        "-w",
        str(out),
        str(ROOT),
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    (found,) = out.glob("kiln_serve-*.whl")
    return found


def test_install_script_installs_a_serving_kiln(
    wheel: Path, example_repo: Path, tmp_path: Path
) -> None:
    venv = tmp_path / "opt-kiln"
    # The full dependency install would download ~1 GB (onnxruntime, grpcio, ...) on every
    # run; instead the test venv borrows this environment's dependencies through a .pth
    # and install.sh runs with --no-deps: the wheel, its entry point and its package data
    # are the real ones. (A .pth line adds a path but does not run that path's own .pth
    # files, so this environment's editable kiln stays invisible.)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    (site / "borrowed-deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    env = dict(
        os.environ,
        KILN_PIP_ARGS="--no-deps --quiet",
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    )
    out = subprocess.run(
        ["sh", str(DOCKER / "install.sh"), str(venv), str(wheel)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "kiln, version" in out.stdout  # install.sh's own `kiln --version` check
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import kiln; print(kiln.__file__)"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert where.stdout.startswith(str(venv)), where.stdout  # the wheel's kiln, not the tree's

    # The image's ENTRYPOINT from the venv, then its HEALTHCHECK command.
    port = free_port()
    argv = [
        str(venv / "bin" / "kiln"),
        *ENTRYPOINT[1:],
        f"--http-port={port}",
        f"--grpc-port={free_port()}",
        f"--metrics-port={free_port()}",
    ]
    proc = run_container(argv, {"/models": example_repo}, tmp_path, port)
    try:
        check = json.loads(
            dockerfile_instruction(DOCKER / "Dockerfile", "HEALTHCHECK").split("CMD", 1)[1]
        )
        check = [
            str(venv / "bin" / check[0]),
            *(a.replace(":8000/", f":{port}/") for a in check[1:]),
        ]
        assert subprocess.run(check, timeout=30).returncode == 0
        broken = [*check[:-1], check[-1].replace("/v2/health/ready", "/v2/health/nothing")]
        assert subprocess.run(broken, capture_output=True, timeout=30).returncode != 0
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0
