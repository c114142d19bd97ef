"""The ``redis`` response cache: entries in a Redis server that several kiln servers share.

Triton's spelling: ``--cache-config redis,host=HOST --cache-config redis,port=PORT`` (plus
``user``, ``password``, ``db``, ``connect_timeout``, ``socket_timeout`` (ms) and
``pool_size``; ``wait_timeout`` is accepted and has nothing to wait for: commands are
pipelined, none waits for a free connection; TLS with ``tls_enabled``, ``cacert`` /
``cacert_dir``, ``cert``, ``key`` and ``sni``; the credentials may also come from
``TRITONCACHE_REDIS_USERNAME`` / ``_PASSWORD``). kiln speaks RESP itself (``resp.py``): no
client library to install, and a hit costs the server little. Replicas behind one load
balancer then answer a request that any of them has answered before, and a restarted
server starts warm.

- **Key**: ``kiln:rc:`` + the same digest as the local cache (``keys.request_key``), but a
  model's part of it is a fingerprint of its config and the bytes of its version's files
  (``model_fingerprint``), not a per-process load counter: two servers with the same model
  share entries, and a changed model file never answers with the old one's outputs.
- **Value**: a self-describing record (no pickle: a shared Redis may hold anything, and a
  record that does not parse is a miss): ``KILNRC1``, a 4-byte header length, a JSON
  header (each output's name, datatype, shape and byte count, and the response's
  parameters), then each output's bytes (BYTES tensors in Triton's length-prefixed form).
- **Budget and eviction** are Redis's own: set ``maxmemory`` and ``maxmemory-policy
  allkeys-lru`` on the Redis server. Unloading a model forgets nothing there (other
  servers may still serve the same model).
- **Faults**: a Redis that cannot be reached at start fails the start, naming its address.
  While serving, an error (Redis down, a timeout) makes that lookup a miss and that
  insert a no-op, logged (at most every 10 s), and the request is answered by the model:
  the cache never fails a request.
"""

from __future__ import annotations

import json
import logging
import ssl
import struct
import time
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from kiln.cache import Cached
from kiln.cache.config import CacheConfigError, RedisSettings
from kiln.cache.resp import RespClient
from kiln.core.types import DataType, InferOutput

log = logging.getLogger(__name__)

PREFIX = b"kiln:rc:"
MAGIC = b"KILNRC1"
_LENGTH = struct.Struct("<I")
_WARN_EVERY_S = 10.0


class RedisResponseCache:
    shared: ClassVar[bool] = True

    def __init__(self, settings: RedisSettings) -> None:
        self.settings = settings
        self._client = RespClient(
            settings.host,
            settings.port,
            username=settings.user,
            password=settings.password,
            db=settings.db,
            connect_timeout=_seconds(settings.connect_timeout_ms),
            socket_timeout=_seconds(settings.socket_timeout_ms),
            connections=settings.pool_size,
            ssl_context=tls_context(settings) if settings.tls else None,
            server_hostname=settings.sni,
        )
        self.errors = 0  # lookups and inserts that failed (each a miss / no-op)
        self._warned_at = 0.0

    async def open(self) -> None:
        try:
            await self._client.call(b"PING")
        except Exception as exc:
            await self._client.close()
            raise CacheConfigError(
                f"cannot reach the redis cache at {self.settings.address}: {_reason(exc)}"
            ) from None

    async def close(self) -> None:
        await self._client.close()

    async def get(self, key: bytes) -> Cached | None:
        try:
            raw = await self._client.call(b"GET", PREFIX + key)
        except Exception as exc:
            self._failed("lookup", exc)
            return None
        if raw is None:
            return None
        try:
            if not isinstance(raw, bytes):
                raise ValueError(f"GET answered {type(raw).__name__}")
            return decode(raw)
        except Exception as exc:  # whatever a shared Redis holds, it is a miss, never a failure
            self._failed("lookup (an entry that is not kiln's)", exc)
            return None

    async def put(
        self,
        key: bytes,
        outputs: Sequence[InferOutput],
        owner: int,
        parameters: dict[str, Any] | None,
    ) -> bool:
        try:
            await self._client.call(b"SET", PREFIX + key, encode(outputs, parameters))
        except Exception as exc:
            self._failed("insert", exc)
            return False
        return True

    def drop_owner(self, owner: int) -> int:
        return 0  # shared: another server may serve the same model files

    def _failed(self, what: str, exc: BaseException) -> None:
        self.errors += 1
        now = time.monotonic()
        if now - self._warned_at >= _WARN_EVERY_S:
            self._warned_at = now
            log.warning(
                "redis cache at %s: %s failed (%s); answering from the model",
                self.settings.address,
                what,
                _reason(exc),
            )


def tls_context(settings: RedisSettings) -> ssl.SSLContext:
    """The client side of TLS to Redis: its certificate verified against ``cacert`` /
    ``cacert_dir`` (the system's CAs when neither is given) and the host name (or
    ``sni``); ``cert`` and ``key`` for a Redis that asks clients for one."""
    try:
        context = ssl.create_default_context(
            cafile=settings.cacert or None, capath=settings.cacert_dir or None
        )
        if settings.cert:
            context.load_cert_chain(settings.cert, settings.key or None)
    except (ssl.SSLError, OSError) as exc:
        raise CacheConfigError(f"redis cache TLS settings: {_reason(exc)}") from None
    return context


def _seconds(ms: int) -> float | None:
    return ms / 1000 if ms > 0 else None


def _reason(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def encode(outputs: Sequence[InferOutput], parameters: dict[str, Any] | None) -> bytes:
    payloads: list[bytes] = []
    described = []
    for output in outputs:
        if output.datatype is DataType.BYTES:
            payload = b"".join(
                _LENGTH.pack(len(raw)) + raw
                for raw in (
                    item if isinstance(item, bytes) else str(item).encode()
                    for item in output.data.ravel()
                )
            )
        else:
            dtype = output.datatype.numpy_dtype
            payload = np.ascontiguousarray(output.data, dtype=dtype).tobytes()
        payloads.append(payload)
        described.append(
            {
                "name": output.name,
                "datatype": output.datatype.value,
                "shape": list(output.shape),
                "nbytes": len(payload),
            }
        )
    header = json.dumps({"outputs": described, "parameters": parameters or {}}).encode()
    return b"".join([MAGIC, _LENGTH.pack(len(header)), header, *payloads])


def decode(raw: bytes) -> Cached:
    """The outputs and parameters of a record; ``ValueError`` for anything else."""
    view = memoryview(raw)
    if bytes(view[: len(MAGIC)]) != MAGIC:
        raise ValueError("no kiln record header")
    at = len(MAGIC)
    if len(view) < at + _LENGTH.size:
        raise ValueError("record is shorter than its header")
    (length,) = _LENGTH.unpack_from(view, at)
    at += _LENGTH.size
    try:
        header = json.loads(bytes(view[at : at + length]))
        described = header["outputs"]
        parameters = header["parameters"]
        if not isinstance(described, list) or not isinstance(parameters, dict):
            raise TypeError("malformed header")
    except RecursionError:
        raise ValueError("malformed record header: nested too deep") from None
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"malformed record header: {exc}") from None
    at += length
    outputs = []
    for spec in described:
        try:
            name, nbytes = str(spec["name"]), int(spec["nbytes"])
            datatype = DataType(spec["datatype"])
            shape = tuple(int(d) for d in spec["shape"])
        except (KeyError, TypeError, ValueError, OverflowError) as exc:  # Overflow: Infinity
            raise ValueError(f"malformed output in record: {exc}") from None
        payload = view[at : at + nbytes]
        if len(payload) != nbytes or any(d < 0 for d in shape):
            raise ValueError(f"record output '{name}' is truncated")
        at += nbytes
        data = _array(datatype, shape, payload)
        data.flags.writeable = False
        outputs.append(InferOutput(name, datatype, shape, data))
    if at != len(view):
        raise ValueError("record has trailing bytes")
    return outputs, parameters


def _array(datatype: DataType, shape: tuple[int, ...], payload: memoryview) -> np.ndarray:
    count = int(np.prod(shape)) if shape else 1
    if datatype is DataType.BYTES:
        items = []
        pos = 0
        for _ in range(count):
            if pos + _LENGTH.size > len(payload):
                raise ValueError("record BYTES output is truncated")
            (size,) = _LENGTH.unpack_from(payload, pos)
            pos += _LENGTH.size
            items.append(bytes(payload[pos : pos + size]))
            pos += size
        if pos != len(payload):
            raise ValueError("record BYTES output has trailing bytes")
        out = np.empty(count, dtype=object)
        out[:] = items
        return out.reshape(shape)
    dtype = datatype.numpy_dtype
    if count * dtype.itemsize != len(payload):
        raise ValueError(f"record output of shape {list(shape)} does not match its bytes")
    return np.frombuffer(payload, dtype=dtype).reshape(shape).copy()
