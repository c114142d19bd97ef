"""Who may call what: API keys and Triton's restricted API groups, decided once here.

The frontends only tell this module which API group a call belongs to and hand it a way to
read the call's headers (HTTP headers or gRPC metadata); the decision and the wording are
shared, so HTTP and gRPC refuse the same callers for the same reasons.
"""

from __future__ import annotations

import enum
import hmac
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field


class ApiGroup(enum.Enum):
    """Triton's API groups (``--http-restricted-api`` / ``--grpc-restricted-protocol``)."""

    HEALTH = "health"
    METADATA = "metadata"
    INFERENCE = "inference"
    SHARED_MEMORY = "shared-memory"
    MODEL_CONFIG = "model-config"
    MODEL_REPOSITORY = "model-repository"
    STATISTICS = "statistics"
    TRACE = "trace"
    LOGGING = "logging"
    # kiln's own routes outside the KServe protocol (/api/*): never restrictable by group,
    # but they need the API key like everything else.
    MONITORING = "monitoring"


RESTRICTABLE = [g for g in ApiGroup if g is not ApiGroup.MONITORING]


class AccessConfigError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Restriction:
    """Calls in ``groups`` need the header ``key: value``."""

    groups: frozenset[ApiGroup]
    key: str
    value: str

    @classmethod
    def parse(cls, text: str, flag: str) -> Restriction:
        """``API[,API...]:KEY=VALUE``, Triton's syntax."""
        apis, sep, kv = text.rpartition(":")
        key, eq, value = kv.partition("=")
        if not sep or not eq or not apis or not key.strip():
            raise AccessConfigError(f"{flag} '{text}': expected <API>[,<API>...]:<key>=<value>")
        groups = set()
        names = {g.value: g for g in RESTRICTABLE}
        for name in apis.split(","):
            group = names.get(name.strip())
            if group is None:
                raise AccessConfigError(
                    f"{flag} '{text}': unknown API '{name.strip()}', expected one of "
                    + ", ".join(names)
                )
            groups.add(group)
        return cls(frozenset(groups), key.strip().lower(), value)


@dataclass(frozen=True, slots=True)
class Denial:
    """Why a call is refused; ``kind`` picks the wire status in each frontend."""

    kind: str  # "unauthenticated" | "restricted"
    message: str


HeaderGetter = Callable[[str], str | None]


@dataclass(frozen=True, slots=True)
class AccessPolicy:
    """API keys (empty: no authentication) and restricted groups, for one frontend."""

    api_keys: tuple[str, ...] = ()
    restrictions: tuple[Restriction, ...] = ()
    # gRPC metadata keys are prefixed, as in Triton, so an HTTP header of the same name
    # forwarded by a proxy cannot satisfy a gRPC restriction by accident.
    header_prefix: str = ""
    _by_group: dict[ApiGroup, Restriction] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_group: dict[ApiGroup, Restriction] = {}
        for r in self.restrictions:
            for g in r.groups:
                if g in by_group:
                    raise AccessConfigError(
                        f"API '{g.value}' is restricted more than once; give each API one header"
                    )
                by_group[g] = r
        object.__setattr__(self, "_by_group", by_group)

    @property
    def enabled(self) -> bool:
        return bool(self.api_keys or self.restrictions)

    def check(
        self, group: ApiGroup, header: HeaderGetter, extra_keys: Iterable[str] = ()
    ) -> Denial | None:
        """``None`` when the call may proceed. ``extra_keys``: credentials found elsewhere
        (the dashboard's cookie), tried after the headers."""
        if self.api_keys and group is not ApiGroup.HEALTH:
            offered = [k for k in (presented_key(header), *extra_keys) if k]
            if not offered:
                return Denial(
                    "unauthenticated",
                    "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                )
            if not any(self.key_matches(k) for k in offered):
                return Denial("unauthenticated", "invalid API key")
        r = self._by_group.get(group)
        if r is not None:
            name = self.header_prefix + r.key
            got = header(name)
            if got is None or not hmac.compare_digest(got.encode(), r.value.encode()):
                return Denial("restricted", restricted_message(name, self.header_prefix != ""))
        return None

    def key_matches(self, offered: str) -> bool:
        # Every configured key is compared, in constant time each, so the time taken says
        # nothing about which key (or how much of one) matched.
        ok = False
        for key in self.api_keys:
            ok |= hmac.compare_digest(offered.encode(), key.encode())
        return ok


def restricted_message(header: str, grpc: bool) -> str:
    """Triton's wording, which scripts written for Triton match on."""
    what = "protocol" if grpc else "API"
    return f"This {what} is restricted, expecting header '{header}'"


def presented_key(header: HeaderGetter) -> str | None:
    auth = header("authorization")
    if auth:
        scheme, _, token = auth.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    key = header("x-api-key")
    return key.strip() if key and key.strip() else None


def read_key_file(path: str) -> list[str]:
    """One key a line; blank lines and ``#`` comments ignored."""
    with open(path, encoding="utf-8") as f:
        keys = [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
    if not keys:
        raise AccessConfigError(f"--api-key-file '{path}' holds no key")
    return keys
