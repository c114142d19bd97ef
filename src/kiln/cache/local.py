"""Response cache: outputs of earlier identical requests, LRU within a byte budget.

One cache serves the whole server (Triton's ``--cache-config local,size=BYTES``, or
``--cache-config redis,host=...`` for one that several servers share: ``redis_cache.py``);
a model opts in with ``response_cache { enable: true }``. A key digests the model name and version,
every input (name, datatype, shape, bytes) and the requested outputs with their
parameters, so two requests share an entry only when the model would see the same call.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np

from kiln.config.model_config_pb2 import ModelConfig
from kiln.core.types import DataType, InferenceRequest, InferOutput

# Output parameters that only say how the response travels back, not what it holds:
# a JSON client and a binary client asking the same question share one entry.
_TRANSPORT_PARAMETERS = frozenset(
    {"binary_data", "shared_memory_region", "shared_memory_byte_size", "shared_memory_offset"}
)


class CacheConfigError(ValueError):
    """A ``--cache-config`` value kiln cannot use (or a cache it cannot reach)."""


@dataclass(frozen=True, slots=True)
class RedisSettings:
    """Triton's redis cache settings (``--cache-config redis,<key>=<value>``)."""

    host: str
    port: int
    user: str = ""  # "" with a password: Redis's "default" user
    password: str = ""
    db: int = 0
    connect_timeout_ms: int = 0  # 0: wait as long as it takes
    socket_timeout_ms: int = 0
    pool_size: int = 1
    wait_timeout_ms: int = 100  # for a free connection of the pool
    # TLS (``tls_enabled=true``): the CA file or folder to verify Redis's certificate with
    # (the system's when neither), a client certificate and key for Redis's
    # ``tls-auth-clients``, and the name to verify (and send as SNI) instead of ``host``
    tls: bool = False
    cacert: str = ""
    cacert_dir: str = ""
    cert: str = ""
    key: str = ""
    sni: str = ""

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


_REDIS_INTS = {
    "port": (1, 65535),
    "db": (0, None),
    "connect_timeout": (0, None),
    "socket_timeout": (0, None),
    "pool_size": (1, None),
    "wait_timeout": (0, None),
}
_REDIS_TLS_FILES = ("cacert", "cacert_dir", "cert", "key")
_REDIS_KEYS = ("host", "user", "password", *_REDIS_INTS, "tls_enabled", *_REDIS_TLS_FILES, "sni")
#: Triton's environment variables for the Redis credentials (a setting overrides them).
REDIS_USER_ENV = "TRITONCACHE_REDIS_USERNAME"
REDIS_PASSWORD_ENV = "TRITONCACHE_REDIS_PASSWORD"


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The parsed ``--cache-config`` flags: Triton's ``local`` cache (a byte budget in
    this process) or its ``redis`` cache (shared by every server that uses the Redis)."""

    size: int = 0
    redis: RedisSettings | None = None

    @classmethod
    def parse(cls, specs: Sequence[str]) -> CacheConfig | None:
        """``["local,size=1048576"]`` -> ``CacheConfig(1048576)``; no flags -> None.

        Triton's form is ``<cache>,<key>=<value>``; the flag may repeat, one key each time.
        """
        settings: dict[str, str] = {}
        caches: set[str] = set()
        for spec in specs:
            cache, sep, setting = spec.partition(",")
            key, eq, value = setting.partition("=")
            if not sep or not eq or not key.strip():
                raise CacheConfigError(
                    f"invalid cache config '{spec}': expected <cache>,<key>=<value>, "
                    "e.g. local,size=1048576 or redis,host=localhost"
                )
            if cache.strip() not in ("local", "redis"):
                raise CacheConfigError(
                    f"cache '{cache.strip()}' is not supported: kiln has the 'local' "
                    "in-memory cache and the 'redis' cache"
                )
            caches.add(cache.strip())
            settings[key.strip()] = value.strip()
        if not settings:
            return None
        if len(caches) > 1:
            raise CacheConfigError(
                "--cache-config names both the local and the redis cache: a server has one"
            )
        if caches == {"redis"}:
            return cls(redis=_redis_settings(settings))
        unknown = sorted(set(settings) - {"size"})
        if unknown:
            raise CacheConfigError(
                f"unknown local cache setting(s) {', '.join(unknown)} (known: size)"
            )
        if "size" not in settings:
            raise CacheConfigError("the local cache needs a size in bytes: local,size=BYTES")
        try:
            size = int(settings["size"])
        except ValueError:
            raise CacheConfigError(
                f"local cache size must be an integer number of bytes, got '{settings['size']}'"
            ) from None
        if size < 0:
            raise CacheConfigError(f"local cache size must be >= 0 bytes, got {size}")
        return cls(size)


def _redis_tls(settings: dict[str, str]) -> bool:
    """Whether TLS is on (``tls_enabled``), checking what goes with it."""
    raw = settings.get("tls_enabled", "false")
    flag = raw.lower()
    if flag not in ("true", "false"):
        raise CacheConfigError(
            f"redis cache setting tls_enabled must be true or false, got '{raw}'"
        )
    given = [k for k in (*_REDIS_TLS_FILES, "sni") if settings.get(k)]
    if flag == "false":
        if given:
            raise CacheConfigError(
                f"redis cache setting(s) {', '.join(given)} need tls_enabled=true "
                "(without it the connection to Redis is not encrypted)"
            )
        return False
    for name in _REDIS_TLS_FILES:
        path = settings.get(name)
        if not path:
            continue
        folder = name == "cacert_dir"
        if not (os.path.isdir(path) if folder else os.path.isfile(path)):
            kind = "folder" if folder else "file"
            raise CacheConfigError(f"redis cache setting {name}: no {kind} '{path}'")
    if settings.get("key") and not settings.get("cert"):
        raise CacheConfigError("redis cache setting key needs cert (the client certificate)")
    return True


def _redis_settings(
    settings: dict[str, str], environ: Mapping[str, str] | None = None
) -> RedisSettings:
    unknown = sorted(set(settings) - set(_REDIS_KEYS))
    if unknown:
        raise CacheConfigError(
            f"unknown redis cache setting(s) {', '.join(unknown)} (known: {', '.join(_REDIS_KEYS)})"
        )
    for required in ("host", "port"):
        if not settings.get(required):
            raise CacheConfigError(
                f"the redis cache needs a {required}: --cache-config redis,host=HOST "
                "--cache-config redis,port=PORT"
            )
    ints: dict[str, int] = {}
    for key, (low, high) in _REDIS_INTS.items():
        if key not in settings:
            continue
        raw = settings[key]
        try:
            value = int(raw)
        except ValueError:
            raise CacheConfigError(
                f"redis cache setting {key} must be an integer, got '{raw}'"
            ) from None
        if value < low or (high is not None and value > high):
            bound = f"{low}..{high}" if high is not None else f">= {low}"
            raise CacheConfigError(f"redis cache setting {key} must be {bound}, got {value}")
        ints[key] = value
    tls = _redis_tls(settings)
    env = os.environ if environ is None else environ
    return RedisSettings(
        host=settings["host"],
        port=ints["port"],
        user=settings.get("user", env.get(REDIS_USER_ENV, "")),
        password=settings.get("password", env.get(REDIS_PASSWORD_ENV, "")),
        db=ints.get("db", 0),
        connect_timeout_ms=ints.get("connect_timeout", 0),
        socket_timeout_ms=ints.get("socket_timeout", 0),
        pool_size=ints.get("pool_size", 1),
        wait_timeout_ms=ints.get("wait_timeout", 100),
        tls=tls,
        cacert=settings.get("cacert", ""),
        cacert_dir=settings.get("cacert_dir", ""),
        cert=settings.get("cert", ""),
        key=settings.get("key", ""),
        sni=settings.get("sni", ""),
    )


Cached = tuple[list[InferOutput], dict[str, Any]]  # the outputs and the response's parameters


class Cache(Protocol):
    """What a model's runtime needs of the server's response cache, local or shared."""

    #: True when other servers read and write the same entries (Redis): a model's part of
    #: the key is then a fingerprint of its files, the same on every server.
    shared: ClassVar[bool]

    async def open(self) -> None:
        """Before the first model loads: a shared cache that cannot be reached fails here."""

    async def close(self) -> None: ...

    async def get(self, key: bytes) -> Cached | None: ...

    async def put(
        self,
        key: bytes,
        outputs: Sequence[InferOutput],
        owner: int,
        parameters: dict[str, Any] | None,
    ) -> bool: ...

    def drop_owner(self, owner: int) -> int: ...


@dataclass(frozen=True, slots=True)
class _Entry:
    outputs: tuple[InferOutput, ...]
    nbytes: int
    owner: int  # the loaded model version that produced it (see ``drop_owner``)
    parameters: dict[str, Any] | None = None  # the response's own (a Python model's)


class ResponseCache:
    """Thread-safe LRU of output lists; ``capacity`` bounds the bytes of cached outputs.
    The ``local`` cache: one per server, in its memory."""

    shared: ClassVar[bool] = False

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._nbytes = 0

    async def open(self) -> None:
        return None

    async def close(self) -> None:
        self.clear()

    async def get(self, key: bytes) -> Cached | None:
        return self.lookup_response(key)

    async def put(
        self,
        key: bytes,
        outputs: Sequence[InferOutput],
        owner: int,
        parameters: dict[str, Any] | None,
    ) -> bool:
        return self.insert(key, outputs, owner, parameters)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._nbytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._entries

    def lookup(self, key: bytes) -> list[InferOutput] | None:
        """The cached outputs (fresh wrappers around read-only arrays), or None."""
        found = self.lookup_response(key)
        return None if found is None else found[0]

    def lookup_response(self, key: bytes) -> Cached | None:
        """The cached outputs and the response's parameters (copies), or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
        # New InferOutput objects: a caller may replace fields without touching the entry.
        outputs = [replace(o, parameters=dict(o.parameters)) for o in entry.outputs]
        return outputs, dict(entry.parameters or {})

    def insert(
        self,
        key: bytes,
        outputs: Iterable[InferOutput],
        owner: int = 0,
        parameters: dict[str, Any] | None = None,
    ) -> bool:
        """Cache ``outputs`` under ``key``, evicting the least recently used entries to fit.

        Returns False (and caches nothing) when the outputs alone exceed the whole budget.
        """
        # Own copies: the scheduler's outputs may be views into a larger batch array that
        # would otherwise stay alive (and uncounted) behind a small entry.
        frozen = tuple(_frozen(o) for o in outputs)
        nbytes = sum(_nbytes(o.data) for o in frozen)
        if nbytes > self.capacity:
            return False
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._nbytes -= old.nbytes
            while self._entries and self._nbytes + nbytes > self.capacity:
                _, evicted = self._entries.popitem(last=False)
                self._nbytes -= evicted.nbytes
            self._entries[key] = _Entry(frozen, nbytes, owner, dict(parameters or {}) or None)
            self._nbytes += nbytes
        return True

    def drop_owner(self, owner: int) -> int:
        """Forget what one loaded model version cached (it is unloading); returns how many.

        A reload of the same version may serve a different model file, so its answers
        must not outlive it.
        """
        with self._lock:
            gone = [k for k, e in self._entries.items() if e.owner == owner]
            for key in gone:
                self._nbytes -= self._entries.pop(key).nbytes
            return len(gone)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._nbytes = 0


def request_key(
    model: str,
    version: str,
    request: InferenceRequest,
    output_names: Sequence[str],
    owner: int = 0,
) -> bytes:
    """Digest of everything that decides a response: model, version, inputs, outputs.

    ``owner`` tells loads of the same version apart, so a reloaded model never answers
    with what its predecessor computed.
    """
    digest = hashlib.blake2b(digest_size=32)
    digest.update(owner.to_bytes(8, "little"))

    def field(value: str | bytes) -> None:
        # Length-prefixed, so ("ab", "c") and ("a", "bc") never digest alike.
        raw = value.encode("utf-8", "surrogateescape") if isinstance(value, str) else value
        digest.update(len(raw).to_bytes(8, "little"))
        digest.update(raw)

    field(model)
    field(version)
    # Input order on the wire does not change what the model computes.
    for tensor in sorted(request.inputs, key=lambda t: t.name):
        field(tensor.name)
        field(tensor.datatype.value)
        field(",".join(str(d) for d in tensor.shape))
        _digest_data(digest, tensor.datatype, tensor.data)
    requested = {o.name: o.parameters for o in request.outputs}
    for name in output_names:
        field(name)
        params = requested.get(name, {})
        for key in sorted(params):
            if key not in _TRANSPORT_PARAMETERS:
                field(key)
                field(repr(params[key]))
    return digest.digest()


# Config fields that say how a model is run, not what it answers: servers that run the
# same model differently (instances, batching, warm-up) still share its cache entries.
_RUNNING_FIELDS = (
    "instance_group",
    "dynamic_batching",
    "model_warmup",
    "response_cache",
    "version_policy",
    "rate_limiter",
)


def model_fingerprint(config: ModelConfig, version_dir: Path) -> int:
    """What a shared cache's keys say of a model: its config (less how it is run) and the
    bytes of every file in its version folder, so that every server with the same model
    computes the same value, and a changed model file a different one."""
    digest = hashlib.blake2b(digest_size=8)
    trimmed = ModelConfig()
    trimmed.CopyFrom(config)
    for name in _RUNNING_FIELDS:
        if trimmed.DESCRIPTOR.fields_by_name.get(name) is not None:
            trimmed.ClearField(name)  # type: ignore[arg-type]
    digest.update(trimmed.SerializeToString(deterministic=True))
    if version_dir.is_dir():
        files = sorted(
            p for p in version_dir.rglob("*") if p.is_file() and "__pycache__" not in p.parts
        )
        for path in files:
            name_bytes = path.relative_to(version_dir).as_posix().encode()
            digest.update(len(name_bytes).to_bytes(8, "little") + name_bytes)
            digest.update(path.stat().st_size.to_bytes(8, "little"))
            with path.open("rb") as handle:
                while chunk := handle.read(1 << 20):
                    digest.update(chunk)
    return int.from_bytes(digest.digest(), "little")


def _digest_data(digest: hashlib.blake2b, datatype: DataType, data: np.ndarray) -> None:
    if datatype is DataType.BYTES:
        for item in data.ravel():
            raw = item if isinstance(item, bytes) else str(item).encode("utf-8")
            digest.update(len(raw).to_bytes(8, "little"))
            digest.update(raw)
        return
    digest.update(len(data.shape).to_bytes(8, "little"))
    digest.update(np.ascontiguousarray(data).data)


def _frozen(output: InferOutput) -> InferOutput:
    data = np.array(output.data, copy=True)
    data.flags.writeable = False  # shared by every later hit: nobody may write into it
    return replace(output, data=data, parameters=dict(output.parameters))


def _nbytes(data: np.ndarray) -> int:
    if data.dtype.kind == "O":
        # Object arrays hold pointers; the payload is the bytes objects themselves.
        return data.nbytes + sum(len(v) if isinstance(v, bytes) else 0 for v in data.ravel())
    return int(data.nbytes)


def open_cache(config: CacheConfig) -> Cache:
    """The server's cache for its ``--cache-config`` (``open()`` it on the loop)."""
    if config.redis is not None:
        from kiln.scheduling.redis_cache import RedisResponseCache

        return RedisResponseCache(config.redis)
    return ResponseCache(config.size)
