"""The shared-memory region manager: registration and bounds are checked on every access."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.core.errors import KilnError, Status
from kiln.core.shm import SharedMemoryManager


@pytest.fixture
def manager(tmp_path: Path) -> SharedMemoryManager:
    (tmp_path / "obj").write_bytes(bytes(range(64)))
    return SharedMemoryManager(root=tmp_path)


def test_window_is_relative_to_the_registered_offset(manager: SharedMemoryManager) -> None:
    manager.register("r", "/obj", offset=16, byte_size=32)
    assert manager.read("r", 0, 4, "T") == bytes([16, 17, 18, 19])
    manager.write("r", 4, b"\xff\xff", capacity=2, tensor="T")
    assert manager.read("r", 4, 2, "T") == b"\xff\xff"
    assert manager.status() == [{"name": "r", "key": "/obj", "offset": 16, "byte_size": 32}]


@pytest.mark.parametrize(("offset", "size"), [(0, 33), (32, 1), (31, 2), (-1, 1)])
def test_access_outside_the_window_is_refused(
    manager: SharedMemoryManager, offset: int, size: int
) -> None:
    manager.register("r", "obj", offset=16, byte_size=32)
    with pytest.raises(KilnError, match="outside region 'r'") as err:
        manager.read("r", offset, size, "INPUT0")
    assert err.value.status is Status.INVALID_ARG
    assert "INPUT0" in err.value.message


def test_write_larger_than_capacity_is_refused(manager: SharedMemoryManager) -> None:
    manager.register("r", "obj", offset=0, byte_size=8)
    with pytest.raises(KilnError, match="do not fit"):
        manager.write("r", 0, b"123456789", capacity=8, tensor="OUT")


def test_unregister_while_in_use_is_refused(manager: SharedMemoryManager) -> None:
    manager.register("r", "obj", offset=0, byte_size=8)
    manager.acquire(["r"])
    with pytest.raises(KilnError, match="in use by 1 in-flight"):
        manager.unregister("r")
    with pytest.raises(KilnError, match="in use"):
        manager.unregister()  # all
    manager.release(["r"])
    manager.unregister("r")
    assert manager.status() == []


@pytest.mark.parametrize("key", ["", "/", "a/b", "/../x", "..", "x\x00y"])
def test_keys_cannot_leave_the_shm_folder(manager: SharedMemoryManager, key: str) -> None:
    with pytest.raises(KilnError, match="invalid key"):
        manager.register("r", key, 0, 8)


def test_bad_sizes(manager: SharedMemoryManager) -> None:
    with pytest.raises(KilnError, match="'offset' must be an integer"):
        manager.register("r", "obj", -1, 8)
    with pytest.raises(KilnError, match="does not fit"):
        manager.register("r", "obj", 0, 0)
    with pytest.raises(KilnError, match="does not fit"):
        manager.register("r", "obj", 60, 8)
