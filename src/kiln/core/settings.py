"""Run-time trace and log settings (Triton's ``trace`` and ``logging`` extensions).

Both frontends read and update the same objects here, so a setting changed over gRPC
shows over HTTP too. Keys and value spellings are Triton's.
"""

from __future__ import annotations

import importlib.util
import logging
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kiln.core.errors import KilnError, Status, invalid_arg

if TYPE_CHECKING:
    from kiln.core.trace_otel import OtelOptions

TRACE_LEVELS = ("OFF", "TIMESTAMPS", "TENSORS")
#: values one trace setting may hold (trace_level's are a few of TRACE_LEVELS)
MAX_TRACE_VALUES = 16
#: the integer settings and their ranges: Triton's types (a uint32 rate and log frequency;
#: an int32 count, -1 = no limit)
_TRACE_INTS = {
    "trace_rate": (0, 2**32 - 1),
    "trace_count": (-1, 2**31 - 1),
    "log_frequency": (0, 2**32 - 1),
}
_INTEGER = re.compile(r"-?[0-9]{1,10}")
_TRACE_DEFAULTS = {
    "trace_file": [""],
    "trace_level": ["OFF"],
    "trace_rate": ["1000"],
    "trace_count": ["-1"],
    "log_frequency": ["0"],
    "trace_mode": ["triton"],
}


@dataclass(slots=True)
class TraceSettings:
    """Global trace settings plus per-model overrides (a cleared override falls back)."""

    global_: dict[str, list[str]] = field(
        default_factory=lambda: {k: list(v) for k, v in _TRACE_DEFAULTS.items()}
    )
    models: dict[str, dict[str, list[str]]] = field(default_factory=dict)

    def get(self, model: str = "") -> dict[str, list[str]]:
        merged = {k: list(v) for k, v in self.global_.items()}
        merged.update({k: list(v) for k, v in self.models.get(model, {}).items()})
        return merged

    def update(self, model: str, updates: dict[str, list[str]]) -> dict[str, list[str]]:
        """Apply ``updates`` (an empty list clears the key) and return the settings now."""
        checked = {key: self._check(key, values) for key, values in updates.items()}
        target = self.models.setdefault(model, {}) if model else self.global_
        for key, values in checked.items():
            if values:
                target[key] = values
            elif model:
                target.pop(key, None)
            else:
                target[key] = list(_TRACE_DEFAULTS[key])
        if model and not target:
            self.models.pop(model, None)
        return self.get(model)

    @staticmethod
    def _check(key: str, values: list[str]) -> list[str]:
        if key not in _TRACE_DEFAULTS:
            raise invalid_arg(
                f"unknown trace setting '{key}'; known settings: {sorted(_TRACE_DEFAULTS)}"
            )
        # Before anything walks them: values are kept and sent back with every read.
        if len(values) > MAX_TRACE_VALUES:
            raise invalid_arg(
                f"trace setting '{key}' takes at most {MAX_TRACE_VALUES} values, got {len(values)}"
            )
        if not all(isinstance(v, str) for v in values):  # a JSON body's list
            raise invalid_arg(f"trace setting '{key}' must be a string or list of strings")
        if key == "trace_level":
            bad = [v for v in values if v not in TRACE_LEVELS]
            if bad:
                raise invalid_arg(f"trace_level must be one of {list(TRACE_LEVELS)}, got {bad}")
        elif values and len(values) != 1:
            raise invalid_arg(f"trace setting '{key}' takes one value, got {values}")
        elif values and key in _TRACE_INTS:
            low, high = _TRACE_INTS[key]
            # ASCII digits, in range: int() also read '1_0', '+5' and other scripts' digits,
            # and any size (a negative rate or count, 10**100)
            if not _INTEGER.fullmatch(values[0]) or not low <= int(values[0]) <= high:
                raise invalid_arg(
                    f"trace setting '{key}' must be an integer from {low} to {high}, "
                    f"got '{values[0][:40]}'"
                )
        elif values and key == "trace_mode" and values[0] not in ("triton", "opentelemetry"):
            raise invalid_arg(f"trace_mode must be 'triton' or 'opentelemetry', got {values}")
        return list(values)


# ``--trace-config [MODE,]SETTING=VALUE`` -> the trace setting it sets (Triton's names)
_TRACE_FLAGS = {
    ("", "rate"): "trace_rate",
    ("", "level"): "trace_level",
    ("", "count"): "trace_count",
    ("", "mode"): "trace_mode",
    ("triton", "file"): "trace_file",
    ("triton", "log-frequency"): "log_frequency",
}
# ``--trace-config opentelemetry,SETTING=VALUE``: the exporter's (not trace API settings)
_OTEL_FLAGS = ("url", "resource", "protocol", "bsp_max_queue_size", "bsp_schedule_delay",
               "bsp_max_export_batch_size")  # fmt: skip


def parse_trace_config(
    flags: tuple[str, ...] | list[str], legacy: dict[str, list[str]] | None = None
) -> tuple[TraceSettings, OtelOptions | None]:
    """The starting trace settings from ``--trace-config`` flags (``rate=100``,
    ``level=TIMESTAMPS`` (repeatable), ``count=N``, ``mode=triton|opentelemetry``,
    ``triton,file=PATH``, ``triton,log-frequency=N``, ``opentelemetry,url=URL``,
    ``opentelemetry,resource=KEY=VALUE`` (repeatable), ``opentelemetry,protocol=grpc``
    (OTLP's other transport), ``opentelemetry,bsp_*=N``) and
    Triton's older flags (``legacy``: setting -> values, e.g. ``--trace-file``), with the
    OpenTelemetry exporter's options in that mode; ``ValueError`` names what is wrong."""
    from kiln.core.trace_otel import OtelOptions

    updates: dict[str, list[str]] = {k: list(v) for k, v in (legacy or {}).items() if v}
    levels: list[str] = []
    otel = OtelOptions()
    otel_flags: list[str] = []
    for flag in flags:
        setting, eq, value = flag.partition("=")
        mode, _, name = setting.rpartition(",")
        if not eq or not name:
            raise ValueError(f"'{flag}': expected [MODE,]SETTING=VALUE, e.g. rate=100")
        if mode == "opentelemetry" and name in _OTEL_FLAGS:
            otel_flags.append(flag)
            _otel_setting(otel, flag, name, value)
            continue
        key = _TRACE_FLAGS.get((mode, name))
        if key is None:
            known = ", ".join(
                [f"{m},{n}" if m else n for m, n in _TRACE_FLAGS]
                + [f"opentelemetry,{n}" for n in _OTEL_FLAGS]
            )
            raise ValueError(f"'{flag}': unknown trace setting; known: {known}")
        if key == "trace_level":
            levels.append(value)
        else:
            updates[key] = [value]
    if levels:
        updates["trace_level"] = levels
    settings = TraceSettings()
    try:
        settings.update("", updates)
    except KilnError as exc:
        raise ValueError(exc.message) from None
    merged = settings.get()
    level = set(merged["trace_level"]) - {"OFF"}
    if merged["trace_mode"] == ["opentelemetry"]:
        if "TENSORS" in level:
            raise ValueError("level=TENSORS: the opentelemetry mode traces timestamps only")
        if importlib.util.find_spec("opentelemetry.sdk") is None:
            raise ValueError(
                "mode=opentelemetry needs the OpenTelemetry SDK: pip install 'kiln-serve[otel]'"
            )
        if otel.protocol == "grpc" and _missing("opentelemetry.exporter.otlp.proto.grpc"):
            raise ValueError(
                "opentelemetry,protocol=grpc needs OTLP's gRPC exporter: pip install "
                "'kiln-serve[otel]'"
            )
        return settings, otel
    if otel_flags:
        raise ValueError(f"'{otel_flags[0]}' applies to mode=opentelemetry only")
    if level and not merged["trace_file"][0]:
        raise ValueError(
            f"level={','.join(merged['trace_level'])} needs a file to write the traces to: "
            "--trace-config triton,file=PATH"
        )
    return settings, None


def _missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except ModuleNotFoundError:  # a parent package is missing
        return True


def _otel_setting(otel: OtelOptions, flag: str, name: str, value: str) -> None:
    if name == "url":
        otel.url = value
    elif name == "protocol":
        from kiln.core.trace_otel import PROTOCOLS

        if value not in PROTOCOLS:
            raise ValueError(f"'{flag}': protocol must be one of {', '.join(PROTOCOLS)}")
        otel.protocol = value
    elif name == "resource":
        key, eq, text = value.partition("=")
        if not eq or not key:
            raise ValueError(f"'{flag}': expected opentelemetry,resource=KEY=VALUE")
        otel.resource[key] = text
    else:
        if not value.isdigit() or int(value) == 0:
            raise ValueError(f"'{flag}': {name} must be a positive integer")
        setattr(otel, name, int(value))


_UINT32_MAX = 2**32 - 1
_LOG_TYPES: dict[str, type] = {
    "log_file": str,
    "log_info": bool,
    "log_warning": bool,
    "log_error": bool,
    "log_verbose_level": int,
    "log_format": str,
}


@dataclass(slots=True)
class LogSettings:
    """Triton's log switches, applied to the ``kiln`` logger's level."""

    values: dict[str, Any] = field(
        default_factory=lambda: {
            "log_file": "",
            "log_info": True,
            "log_warning": True,
            "log_error": True,
            "log_verbose_level": 0,
            "log_format": "default",
        }
    )

    def get(self) -> dict[str, Any]:
        return dict(self.values)

    def update(self, updates: dict[str, Any]) -> dict[str, Any]:
        for key, value in updates.items():
            kind = _LOG_TYPES.get(key)
            if kind is None:
                raise invalid_arg(
                    f"unknown log setting '{key}'; known settings: {sorted(_LOG_TYPES)}"
                )
            if type(value) is not kind:
                expected = "an integer" if kind is int else f"a {kind.__name__}"
                raise invalid_arg(f"log setting '{key}' must be {expected}, got {value!r}")
            if isinstance(value, int) and not 0 <= value <= _UINT32_MAX:
                # Triton's uint32: gRPC's answer carries it as one (a larger value made
                # every LogSettings call fail)
                raise invalid_arg(
                    f"log setting '{key}' must be an integer from 0 to {_UINT32_MAX}, got {value!r}"
                )
            if key == "log_format" and value not in ("default", "ISO8601"):
                raise invalid_arg(f"log_format must be 'default' or 'ISO8601', got '{value}'")
            if key == "log_file" and value != self.values["log_file"]:
                # Opening arbitrary files on a client's say-so is not something kiln does.
                raise KilnError(
                    "changing log_file at run time is not supported: redirect kiln's output "
                    "instead",
                    Status.UNSUPPORTED,
                )
        self.values.update(updates)
        self._apply()
        return self.get()

    def _apply(self) -> None:
        v = self.values
        if int(v["log_verbose_level"]) > 0:
            level = logging.DEBUG
        elif v["log_info"]:
            level = logging.INFO
        elif v["log_warning"]:
            level = logging.WARNING
        elif v["log_error"]:
            level = logging.ERROR
        else:
            level = logging.CRITICAL + 1
        logging.getLogger("kiln").setLevel(level)
