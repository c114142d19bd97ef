"""System shared memory cannot be turned against the server (issue #25, items 1-3).

The server opens a client's /dev/shm object with its own rights, so only plain objects of
its own user are accepted: no symlink out of /dev/shm, no object of another user, no hard
link, no FIFO or directory, and kiln's own Python-backend arenas are out of reach. A
client that truncates its object gets a 400 (the server used to die of SIGBUS), and the
number of registrations is bounded. Every refusal says the same thing, so a client cannot
tell a missing object from a forbidden one. Tests run as root: another user's object is
made with ``os.chown``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import stat
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from tests.conftest import KilnProcess

SHM = Path("/dev/shm")
NBYTES = 16 * 4
NOBODY = 65534


@pytest.fixture
def server(kiln_server: KilnProcess) -> KilnProcess:
    return kiln_server


@pytest.fixture
def http(server: KilnProcess) -> Iterator[httpclient.InferenceServerClient]:
    client = httpclient.InferenceServerClient(server.http_url)
    client.unregister_system_shared_memory()
    yield client
    client.unregister_system_shared_memory()
    client.close()


@pytest.fixture
def grpc(server: KilnProcess) -> Iterator[grpcclient.InferenceServerClient]:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.unregister_system_shared_memory()
    yield client
    client.unregister_system_shared_memory()
    client.close()


@pytest.fixture
def tag() -> Iterator[str]:
    tag = uuid.uuid4().hex[:8]
    yield tag
    for path in SHM.glob(f"kiln_sec_*{tag}*"):
        if path.is_dir() and not path.is_symlink():
            path.rmdir()
        else:
            path.unlink()


def _refusal(
    client: httpclient.InferenceServerClient, key: str, size: int = NBYTES, name: str = "r"
) -> str:
    with pytest.raises(InferenceServerException) as err:
        client.register_system_shared_memory(name, key, size)
    assert err.value.status() == "400"
    return str(err.value.message())


def _simple_inputs(region: str) -> list[httpclient.InferInput]:
    inputs = [
        httpclient.InferInput("INPUT0", [1, 16], "INT32"),
        httpclient.InferInput("INPUT1", [1, 16], "INT32"),
    ]
    inputs[0].set_shared_memory(region, NBYTES, offset=0)
    inputs[1].set_shared_memory(region, NBYTES, offset=NBYTES)
    return inputs


def _still_serves(server: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(server.http_url)
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [
        httpclient.InferInput("INPUT0", [1, 16], "INT32"),
        httpclient.InferInput("INPUT1", [1, 16], "INT32"),
    ]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(a)
    np.testing.assert_array_equal(client.infer("simple", inputs).as_numpy("OUTPUT0"), a + a)


def test_symlink_out_of_dev_shm_is_refused_and_its_target_untouched(
    http: httpclient.InferenceServerClient, tag: str, tmp_path: Path, server: KilnProcess
) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"S" * NBYTES * 2)
    secret.chmod(0o600)
    (SHM / f"kiln_sec_link_{tag}").symlink_to(secret)
    message = _refusal(http, f"/kiln_sec_link_{tag}", NBYTES * 2)
    assert "unable to open shared memory region 'r'" in message
    # Nothing registered, so an infer that names the region cannot write through the link.
    outputs = [httpclient.InferRequestedOutput("OUTPUT0")]
    outputs[0].set_shared_memory("r", NBYTES)
    a = np.zeros((1, 16), dtype=np.int32)
    inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for i in inputs:
        i.set_data_from_numpy(a)
    with pytest.raises(InferenceServerException, match="unable to find system shared memory"):
        http.infer("simple", inputs, outputs=outputs)
    assert secret.read_bytes() == b"S" * NBYTES * 2
    _still_serves(server)


def test_object_of_another_user_is_refused(
    http: httpclient.InferenceServerClient, grpc: grpcclient.InferenceServerClient, tag: str
) -> None:
    path = SHM / f"kiln_sec_other_{tag}"
    path.write_bytes(b"\x01" * NBYTES * 2)
    os.chown(path, NOBODY, NOBODY)
    _refusal(http, f"/kiln_sec_other_{tag}", NBYTES * 2)
    with pytest.raises(InferenceServerException, match="unable to open") as err:
        grpc.register_system_shared_memory("r", f"/kiln_sec_other_{tag}", NBYTES * 2)
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert http.get_system_shared_memory_status() == []


def test_other_owners_only_behind_the_flag(
    make_server: type[KilnProcess], example_repo: Path, tag: str
) -> None:
    path = SHM / f"kiln_sec_other_{tag}"
    handle = shm.create_shared_memory_region("in", f"/kiln_sec_other_{tag}", NBYTES * 2)
    try:
        a = np.arange(16, dtype=np.int32)
        shm.set_shared_memory_region(handle, [a, a])
        os.chown(path, NOBODY, NOBODY)
        server = make_server(example_repo, args=["--allow-shm-other-owners"]).start()
        client = httpclient.InferenceServerClient(server.http_url)
        client.register_system_shared_memory("in", f"/kiln_sec_other_{tag}", NBYTES * 2)
        result = client.infer("simple", _simple_inputs("in"))
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0")[0], a + a)
    finally:
        shm.destroy_shared_memory_region(handle)


def test_hard_link_is_refused(http: httpclient.InferenceServerClient, tag: str) -> None:
    original = SHM / f"kiln_sec_orig_{tag}"
    original.write_bytes(b"\x02" * NBYTES)
    os.link(original, SHM / f"kiln_sec_hard_{tag}")
    _refusal(http, f"/kiln_sec_hard_{tag}")
    _refusal(http, f"/kiln_sec_orig_{tag}")  # both names: the object has two links


def test_fifo_and_directory_are_refused(
    http: httpclient.InferenceServerClient, tag: str, server: KilnProcess
) -> None:
    os.mkfifo(SHM / f"kiln_sec_fifo_{tag}")
    (SHM / f"kiln_sec_dir_{tag}").mkdir()
    answers = {
        kind: _refusal(http, f"/kiln_sec_{kind}_{tag}").replace(f"kiln_sec_{kind}_{tag}", "KEY")
        for kind in ("fifo", "dir", "missing")
    }
    # Refused as a missing object is: no "Is a directory", no "0-byte object".
    assert len(set(answers.values())) == 1, answers
    _still_serves(server)  # opening the FIFO did not wait for a writer


def test_missing_and_forbidden_objects_get_the_same_answer(
    http: httpclient.InferenceServerClient, tag: str
) -> None:
    other = SHM / f"kiln_sec_other_{tag}"
    other.write_bytes(b"\x03" * 4096)
    os.chown(other, NOBODY, NOBODY)
    mine_dir = SHM / f"kiln_sec_dir_{tag}"
    mine_dir.mkdir()
    (SHM / f"kiln_sec_link_{tag}").symlink_to("/etc/hostname")
    answers = {
        kind: _refusal(http, f"/kiln_sec_{kind}_{tag}").replace(f"kiln_sec_{kind}_{tag}", "KEY")
        for kind in ("missing", "other", "dir", "link")
    }
    assert len(set(answers.values())) == 1, answers
    text = answers["missing"]
    assert "4096" not in text and "No such file" not in text and "ermission" not in text


def _http_infer_status(server: KilnProcess, region: str, output: bool) -> requests.Response:
    def tensor(name: str, offset: int) -> dict:
        return {
            "name": name, "shape": [1, 16], "datatype": "INT32",
            "parameters": {"shared_memory_region": region, "shared_memory_byte_size": NBYTES,
                           "shared_memory_offset": offset},
        }  # fmt: skip

    if output:
        a = list(range(16))
        body = {
            "inputs": [
                {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": a},
                {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": a},
            ],
            "outputs": [{"name": "OUTPUT0", "parameters": tensor("OUTPUT0", 0)["parameters"]}],
        }
    else:
        body = {"inputs": [tensor("INPUT0", 0), tensor("INPUT1", NBYTES)]}
    url = f"http://{server.http_url}/v2/models/simple/infer"
    return requests.post(url, json=body, timeout=30)


@pytest.mark.parametrize("output", [False, True], ids=["input", "output"])
def test_object_truncated_after_registration_is_a_400_not_a_crash(
    http: httpclient.InferenceServerClient,
    grpc: grpcclient.InferenceServerClient,
    server: KilnProcess,
    tag: str,
    output: bool,
) -> None:
    key = f"/kiln_sec_trunc_{tag}"
    handle = shm.create_shared_memory_region("t", key, NBYTES * 2)
    try:
        shm.set_shared_memory_region(handle, [np.ones(32, dtype=np.int32)])
        http.register_system_shared_memory("t", key, NBYTES * 2)
        os.truncate(SHM / key[1:], 0)  # the client shrinks its object under the server
        r = _http_infer_status(server, "t", output)
        assert r.status_code == 400, r.text
        assert "'t'" in r.json()["error"] and "truncated" in r.json()["error"]
        if not output:
            with pytest.raises(InferenceServerException, match="truncated") as err:
                grpc.infer("simple", _grpc_inputs("t"))
            assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert (SHM / key[1:]).stat().st_size == 0  # a write did not grow it back
        _still_serves(server)
        assert server.proc is not None and server.proc.poll() is None
    finally:
        shm.destroy_shared_memory_region(handle)


def _grpc_inputs(region: str) -> list[grpcclient.InferInput]:
    inputs = [
        grpcclient.InferInput("INPUT0", [1, 16], "INT32"),
        grpcclient.InferInput("INPUT1", [1, 16], "INT32"),
    ]
    inputs[0].set_shared_memory(region, NBYTES, offset=0)
    inputs[1].set_shared_memory(region, NBYTES, offset=NBYTES)
    return inputs


def test_registrations_are_bounded(
    make_server: type[KilnProcess], example_repo: Path, tag: str
) -> None:
    server = make_server(example_repo, args=["--max-shm-regions", "3"]).start()
    key = f"/kiln_sec_many_{tag}"
    handle = shm.create_shared_memory_region("m", key, NBYTES * 2)
    try:
        a = np.arange(16, dtype=np.int32)
        shm.set_shared_memory_region(handle, [a, a])
        http = httpclient.InferenceServerClient(server.http_url)
        grpc = grpcclient.InferenceServerClient(server.grpc_url)
        for i in range(3):
            http.register_system_shared_memory(f"m{i}", key, NBYTES * 2)
        with pytest.raises(InferenceServerException, match="--max-shm-regions") as err:
            http.register_system_shared_memory("m3", key, NBYTES * 2)
        assert err.value.status() == "400"
        with pytest.raises(InferenceServerException, match="--max-shm-regions") as gerr:
            grpc.register_system_shared_memory("m3", key, NBYTES * 2)
        assert gerr.value.status() in (
            "StatusCode.INVALID_ARGUMENT",
            "StatusCode.RESOURCE_EXHAUSTED",
        )
        assert len(http.get_system_shared_memory_status()) == 3
        # The registered regions still work, and one freed makes room again.
        result = http.infer("simple", _simple_inputs("m0"))
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0")[0], a + a)
        http.unregister_system_shared_memory("m1")
        grpc.register_system_shared_memory("m3", key, NBYTES * 2)
        result = grpc.infer("simple", _grpc_inputs("m3"))
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0")[0], a + a)
    finally:
        shm.destroy_shared_memory_region(handle)


# --- kiln's own Python-backend arenas --------------------------------------------------

PY_MODEL = """
import os, time
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if x[0] > 0:
                open({marker!r}, "w").close()
                time.sleep(60)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)]))
        return out
"""

PY_CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 1 ] }} ]
"""


def _python_repo(root: Path, name: str) -> Path:
    repo = root / "repo"
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(PY_CONFIG.format(name=name))
    marker = str(root / "busy")
    (repo / name / "1" / "model.py").write_text(textwrap.dedent(PY_MODEL.format(marker=marker)))
    return repo


def _workers(model: str) -> dict[int, list[str]]:
    """The Python-backend workers of ``model``: pid -> command line, as ``ps`` shows them."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "kiln.backends.python.worker" in argv and any(model in a for a in argv):
            found[int(entry.name)] = argv
    return found


def _py_infer(server: KilnProcess, model: str, value: float) -> float:
    client = httpclient.InferenceServerClient(server.http_url, network_timeout=120)
    x = httpclient.InferInput("X", [1], "FP32")
    x.set_data_from_numpy(np.array([value], dtype=np.float32))
    return float(client.infer(model, [x]).as_numpy("Y")[0])


def test_python_arenas_cannot_be_registered_by_a_client(
    make_server: type[KilnProcess], tmp_path: Path
) -> None:
    model = f"py_arena_{uuid.uuid4().hex[:8]}"
    server = make_server(_python_repo(tmp_path, model)).start()
    assert _py_infer(server, model, 0.0) == 0.0
    workers = _workers(model)
    assert workers, "no Python-backend worker found"
    paths = [
        arg
        for argv in workers.values()
        for flag, arg in itertools.pairwise(argv)
        if flag in ("--inbound", "--outbound", "--side-in", "--side-out", "--flags")
    ]
    assert paths
    client = httpclient.InferenceServerClient(server.http_url)
    keys = set()
    for p in map(Path, paths):
        keys |= {p.name, "/" + p.name, str(p.relative_to(SHM)), "/" + str(p.relative_to(SHM))}
        keys |= {part for part in p.relative_to(SHM).parts}
    for i, key in enumerate(sorted(keys)):
        with pytest.raises(InferenceServerException) as err:
            client.register_system_shared_memory(f"a{i}", key, 64)
        assert err.value.status() == "400", key
    assert client.get_system_shared_memory_status() == []
    # the arenas live in a folder only the server's user can enter
    for p in map(Path, paths):
        if p.parent != SHM:
            assert stat.S_IMODE(p.parent.stat().st_mode) == 0o700


def test_python_arenas_are_removed_when_the_exit_timeout_forces_exit(
    make_server: type[KilnProcess], tmp_path: Path
) -> None:
    model = f"py_exit_{uuid.uuid4().hex[:8]}"
    server = make_server(_python_repo(tmp_path, model), args=["--exit-timeout-secs", "1"]).start()
    assert _py_infer(server, model, 0.0) == 0.0
    assert [p for p in SHM.iterdir() if model in p.name], "the arenas are not where expected"
    workers = list(_workers(model))
    errors: list[str] = []

    def stuck() -> None:
        try:
            _py_infer(server, model, 1.0)
        except Exception as exc:
            errors.append(repr(exc))

    thread = threading.Thread(target=stuck, daemon=True)
    thread.start()
    try:
        for _ in range(300):
            if (tmp_path / "busy").exists():
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"the model never started its long execute:\n{server.log()}")
        assert server.proc is not None
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0
        assert "exiting anyway" in server.log()
        leftovers = [p.name for p in SHM.iterdir() if model in p.name]
        assert leftovers == []
    finally:
        for pid in workers:  # the orphaned worker would sleep on for a minute
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for p in SHM.iterdir():
            if model in p.name:
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink()
        thread.join(30)


def _peak_rss(server: KilnProcess) -> int:
    assert server.proc is not None
    status = Path(f"/proc/{server.proc.pid}/status").read_text()
    line = next(x for x in status.splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def test_a_window_the_shape_does_not_fill_is_refused_before_it_is_read(
    http: httpclient.InferenceServerClient,
    grpc: grpcclient.InferenceServerClient,
    server: KilnProcess,
    tag: str,
) -> None:
    """A sparse object costs its client nothing; the server used to read the whole
    ``shared_memory_byte_size`` (a GiB, on the event loop) before it compared it with the
    shape's 64 bytes."""
    gib = 1 << 30
    path = SHM / f"kiln_sec_sparse_{tag}"
    with path.open("wb") as f:
        f.truncate(gib)
    http.register_system_shared_memory("sparse", f"/{path.name}", gib)
    before = _peak_rss(server)
    body = {
        "inputs": [
            {"name": n, "datatype": "INT32", "shape": [1, 16], "parameters": {
                "shared_memory_region": "sparse", "shared_memory_byte_size": gib}}
            for n in ("INPUT0", "INPUT1")
        ]
    }  # fmt: skip
    r = requests.post(f"http://{server.http_url}/v2/models/simple/infer", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"] == (
        f"input 'INPUT0' for model 'simple': shared_memory_byte_size {gib} of region 'sparse' "
        "does not match shape [1,16] of INT32, which needs 64 bytes"
    )
    inputs = _grpc_inputs("sparse")
    inputs[1].set_shared_memory("sparse", NBYTES * 2, offset=NBYTES)
    with pytest.raises(InferenceServerException, match="region 'sparse' does not match") as err:
        grpc.infer("simple", inputs)
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert _peak_rss(server) - before < gib // 2
    np.testing.assert_array_equal(  # a window that matches is read as before
        http.infer("simple", _simple_inputs("sparse")).as_numpy("OUTPUT0"),
        np.zeros((1, 16), dtype=np.int32),
    )


def test_region_names_are_bounded(
    http: httpclient.InferenceServerClient, grpc: grpcclient.InferenceServerClient, tag: str
) -> None:
    """One object may be registered under many names, and each name is kept: over gRPC
    a name could be as long as a message (64 MiB), 1,024 times over."""
    key = f"/kiln_sec_names_{tag}"
    handle = shm.create_shared_memory_region("n", key, NBYTES * 2)
    try:
        for client in (http, grpc):
            with pytest.raises(InferenceServerException) as err:
                client.register_system_shared_memory("r" * 257, key, NBYTES * 2)
            assert err.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
            assert str(err.value.message()) == (
                "a shared memory region name is 1 to 256 characters, got 257"
            )
        grpc.register_system_shared_memory("r" * 256, key, NBYTES * 2)
        assert [r["name"] for r in http.get_system_shared_memory_status()] == ["r" * 256]
    finally:
        shm.destroy_shared_memory_region(handle)
