"""``--cache-config`` (Triton's flags): the ``local`` cache's byte budget or the ``redis``
cache's settings, every bad value refused with what was expected."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


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
