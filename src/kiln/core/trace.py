"""Request tracing in Triton's format: ``trace_level`` TIMESTAMPS and TENSORS, to a file.

A sampled request's trace is one id, its model, version, request id and (for a composing
model of an ensemble) its parent's id, then one entry per timestamp and, at TENSORS level,
one per input and output tensor. The file is a JSON array of those entries, as Triton
writes it, so Triton's ``trace_summary.py`` reads it. Timestamps are ``time.monotonic_ns``,
as Triton's are its steady clock.

**Who stamps what.** ``ModelRuntime`` samples when a request reaches it and stamps
REQUEST_START, QUEUE_START, the four COMPUTE_* stamps (from the request's ``RequestTimes``,
which the schedulers fill for the statistics anyway), INFER_RESPONSE_COMPLETE and
REQUEST_END. A frontend that wants its own stamps (HTTP_RECV_START ... HTTP_SEND_END, the
gRPC ones) puts a ``FrontendSlot`` in the request's context before it calls the server;
the runtime files the trace there, and the frontend stamps the send and ends the trace.
Without a slot (an ensemble's step, a BLS call, a streamed request) the runtime ends it.

**Sampling** is Triton's: of the requests a setting covers, every ``trace_rate``-th one is
traced while ``trace_count`` (-1: no limit) lasts; the count left is what the settings
report. A composing model of a traced ensemble is always traced, under the ensemble's id.

**Files.** With ``log_frequency`` 0 the traces are written to ``trace_file`` when the
setting ends: the server stops, or the setting is changed through the trace API. With
``log_frequency`` N, every N traces go to ``trace_file.0``, ``trace_file.1``, ... and what
is left when the setting ends goes to the next index. Each file is a whole JSON array.
"""

from __future__ import annotations

import contextvars
import itertools
import logging
import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from kiln.core.errors import KilnError, Status
from kiln.core.settings import TraceSettings
from kiln.core.trace_otel import OtelOptions, OtelSink

log = logging.getLogger(__name__)

#: Tensor values written per TENSORS entry at most; the rest is elided (``...``), so one
#: large tensor cannot make a trace file balloon.
MAX_TENSOR_VALUES = 1024

_IDS = itertools.count(1)  # trace ids, unique in the process as Triton's are in the server
#: Traces not ended yet, by id: a BLS call names its parent by id (``trace_parent``).
_LIVE: dict[int, Trace] = {}


@dataclass(slots=True)
class FrontendSlot:
    """A frontend's request as the tracer sees it: its receive stamps, and the trace once
    the runtime sampled it (the frontend then stamps the send and calls ``end``)."""

    protocol: str  # "HTTP" or "GRPC": the stamps' prefix
    recv_start: int
    recv_end: int = 0
    trace: Trace | None = None
    # the client's W3C trace context (traceparent, tracestate), for opentelemetry mode
    carrier: dict[str, str] | None = None


#: The frontend request being served in this task, if its frontend traces.
FRONTEND: contextvars.ContextVar[FrontendSlot | None] = contextvars.ContextVar(
    "kiln_trace_frontend", default=None
)
#: The trace of the request whose scheduling runs in this task (an ensemble's), so that
#: its steps are traced as its children.
CURRENT: contextvars.ContextVar[Trace | None] = contextvars.ContextVar(
    "kiln_trace_current", default=None
)


@dataclass(slots=True)
class Trace:
    id: int
    model_name: str
    model_version: str
    request_id: str
    parent_id: int
    channel: Channel
    stamps: list[tuple[str, int]] = field(default_factory=list)
    tensors: list[dict[str, Any]] | None = None  # at TENSORS level
    ended: bool = False
    otel: Any = None  # its open spans, in opentelemetry mode (``trace_otel.Spans``)
    context: str | None = None  # its model span's W3C context as JSON (opentelemetry mode)
    attributes: dict[str, Any] | None = None  # more span attributes (an LLM request's)

    def stamp(self, name: str, ns: int | None = None) -> None:
        self.stamps.append((name, time.monotonic_ns() if ns is None else ns))

    def tensor(self, activity: str, name: str, datatype: str, value: np.ndarray) -> None:
        if self.tensors is None:
            return
        flat = value.reshape(-1)
        shown = flat[:MAX_TENSOR_VALUES]
        if flat.dtype.kind in ("O", "S", "U"):
            items = [
                v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in shown
            ]
        else:
            items = [repr(v) if isinstance(v, float) else str(v) for v in shown.tolist()]
        if flat.size > MAX_TENSOR_VALUES:
            items.append("...")
        self.tensors.append(
            {
                "id": self.id,
                "activity": activity,
                "tensor": {
                    "name": name,
                    "data": ",".join(items),
                    "shape": ",".join(str(d) for d in value.shape),
                    "dtype": datatype,
                },
            }
        )

    def end(self) -> None:
        """The trace is complete: it goes to its file (once)."""
        if not self.ended:
            self.ended = True
            _LIVE.pop(self.id, None)
            self.channel.collect(self)

    def entries(self) -> list[dict[str, Any]]:
        head: dict[str, Any] = {
            "id": self.id,
            "model_name": self.model_name,
            "model_version": int(self.model_version) if self.model_version.isdigit() else -1,
        }
        if self.request_id:
            head["request_id"] = self.request_id
        if self.parent_id:
            head["parent_id"] = self.parent_id
        out = [head]
        # in time order, as Triton writes them when they happen
        for name, ns in sorted(self.stamps, key=lambda s: s[1]):
            out.append({"id": self.id, "timestamps": [{"name": name, "ns": ns}]})
        out.extend(self.tensors or ())
        return out


class TraceFile:
    """One ``trace_file``: what its channels collected, written as JSON arrays.

    Requests end on the event loop, and with ``log_frequency`` every N-th one would write a
    file there (serialising N traces and a disk write: milliseconds the loop would not
    serve anyone). The writes go to one writer thread instead, in order; ``flush`` waits
    for them (a setting that ends, the server stopping).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.pending: list[dict[str, Any]] = []
        self.traces = 0  # traces in ``pending``
        self.index = 0  # the next ``path.N`` (log_frequency > 0)
        self.indexed = False  # some traces went to ``path.N`` files already
        self.lock = threading.Lock()
        self._writer: ThreadPoolExecutor | None = None  # one thread: writes stay in order
        self._last: Future[None] | None = None  # the latest write handed to it

    def add(self, trace: Trace, log_frequency: int) -> None:
        with self.lock:
            self.pending.extend(trace.entries())
            self.traces += 1
            if log_frequency > 0 and self.traces >= log_frequency:
                self._write(indexed=True)

    def flush(self) -> None:
        """Write what is pending: to the next index if some went to indexed files, else
        to the file itself (its earlier traces kept); return once every write is done."""
        with self.lock:
            if self.pending:
                self._write(indexed=self.indexed)
        self.sync()

    def sync(self) -> None:
        """Wait for the writes handed to the writer so far (what is pending stays)."""
        with self.lock:
            last = self._last
        if last is not None:
            last.result()

    def _write(self, indexed: bool) -> None:
        """Hand what is pending to the writer (under ``lock``)."""
        entries, self.pending, self.traces = self.pending, [], 0
        if indexed:
            target = f"{self.path}.{self.index}"
            self.index += 1
            self.indexed = True
        else:
            target = self.path
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="kiln-trace-writer")
        self._last = self._writer.submit(_dump, target, entries, not indexed)


def _dump(target: str, entries: list[dict[str, Any]], append: bool) -> None:
    """On the writer thread: ``entries`` as the JSON array at ``target`` (after what an
    earlier setting wrote there, with ``append``), replaced at once (no half file)."""
    if append:
        entries = _previous(target) + entries
    try:
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        tmp = f"{target}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(orjson.dumps(entries, option=orjson.OPT_INDENT_2))
        os.replace(tmp, target)
    except OSError as exc:
        log.error("cannot write trace file %s: %s; %d entries lost", target, exc, len(entries))


def _previous(path: str) -> list[dict[str, Any]]:
    """What an earlier setting wrote to ``path`` in this run (kept, as Triton appends)."""
    try:
        with open(path, "rb") as f:
            old = orjson.loads(f.read())
    except (OSError, orjson.JSONDecodeError):
        return []
    return old if isinstance(old, list) else []


class Channel:
    """One effective setting (the global one, or a model's with overrides): its sampling
    counters and its file."""

    def __init__(
        self,
        settings: dict[str, list[str]],
        file: TraceFile | None,
        otel: OtelSink | None = None,
    ) -> None:
        levels = set(settings["trace_level"])
        self.timestamps = "TIMESTAMPS" in levels
        self.tensors = "TENSORS" in levels and otel is None  # spans carry no tensors
        self.rate = int(settings["trace_rate"][0])
        self.count = int(settings["trace_count"][0])
        self.log_frequency = int(settings["log_frequency"][0])
        self.file = file
        self.otel = otel
        # Something may be traced: sampled requests, or (opentelemetry) those carrying a
        # client's trace context, whatever the rate.
        self.on = (self.timestamps or self.tensors) and (file is not None or otel is not None)
        self.seen = 0
        self.lock = threading.Lock()

    def sample(self) -> bool:
        if not self.on or self.count == 0 or self.rate <= 0:
            return False
        with self.lock:
            self.seen += 1
            if self.seen % self.rate:
                return False
            if self.count == 0:
                return False
            if self.count > 0:
                self.count -= 1
            return True

    def collect(self, trace: Trace) -> None:
        if self.otel is not None:
            self.otel.add(trace)
            return
        assert self.file is not None
        if not self.timestamps:
            trace.stamps.clear()  # TENSORS alone: no timestamps, as in Triton
        self.file.add(trace, self.log_frequency)


class Tracer:
    """The server's trace settings (``TraceSettings``) and what they collect."""

    def __init__(
        self, settings: TraceSettings | None = None, otel: OtelOptions | None = None
    ) -> None:
        """``otel``: the exporter's options when ``trace_mode`` is opentelemetry
        (``OtelUnavailable`` without the OpenTelemetry SDK)."""
        self.settings = settings if settings is not None else TraceSettings()
        self.otel: OtelSink | None = None
        if self.settings.get()["trace_mode"] == ["opentelemetry"]:
            self.otel = OtelSink(otel or OtelOptions())
        self.enabled = False  # any setting may trace: the hot path's one check
        self._global: Channel | None = None
        self._models: dict[str, Channel] = {}
        self._files: dict[str, TraceFile] = {}
        self._rebuild()

    # ---- settings ----------------------------------------------------------------------
    def get(self, model: str = "") -> dict[str, list[str]]:
        """The settings as Triton reports them: ``trace_count`` is the count left."""
        merged = self.settings.get(model)
        channel = self._channel(model)
        if channel is not None and channel.on:
            merged["trace_count"] = [str(channel.count)]
        return merged

    def update(self, model: str, updates: dict[str, list[str]]) -> dict[str, list[str]]:
        """Change settings: the settings they replace end (their traces are written)."""
        if self.otel is not None:
            raise KilnError(
                "trace settings cannot be changed at run time in opentelemetry trace mode "
                "(as in Triton): restart kiln with other --trace-config flags",
                Status.UNSUPPORTED,
            )
        if updates.get("trace_mode", ["triton"])[:1] not in (["triton"], []):
            raise KilnError(
                "trace_mode cannot be changed at run time: start kiln with --trace-config "
                "mode=opentelemetry for OpenTelemetry spans",
                Status.UNSUPPORTED,
            )
        if "trace_file" in updates:
            current = self.settings.get(model)["trace_file"]
            if (updates["trace_file"] or [""]) != current and updates["trace_file"] != []:
                # Writing where a client says is how CVE-2024-0087 (Triton's log_file)
                # wrote arbitrary files; kiln's log_file refuses changes the same way.
                raise KilnError(
                    "changing trace_file at run time is not supported: start kiln with "
                    "--trace-config triton,file=PATH",
                    Status.UNSUPPORTED,
                )
        # the count left carries over unless this update sets it
        for name, channel in [("", self._global), *self._models.items()]:
            if channel is not None and channel.on and "trace_count" not in updates:
                scope = self.settings.models.get(name) if name else self.settings.global_
                if scope is not None and "trace_count" in scope:
                    scope["trace_count"] = [str(channel.count)]
        self.settings.update(model, updates)
        self._rebuild()
        return self.get(model)

    def _rebuild(self) -> None:
        old = [self._global, *self._models.values()]
        files: dict[str, TraceFile] = {}

        def channel(settings: dict[str, list[str]]) -> Channel:
            if self.otel is not None:
                return Channel(settings, None, self.otel)
            path = settings["trace_file"][0] if settings["trace_file"] else ""
            file = None
            if path:
                file = files.get(path) or self._files.get(path) or TraceFile(path)
                files[path] = file
            return Channel(settings, file)

        self._global = channel(self.settings.get())
        self._models = {m: channel(self.settings.get(m)) for m in self.settings.models}
        for ch in old:
            if ch is not None and ch.file is not None:
                ch.file.flush()
        self._files = files
        self.enabled = any(ch.on for ch in [self._global, *self._models.values()])
        if (self._global.timestamps or self._global.tensors) and not self._global.on:
            log.warning("trace_level is %s but trace_file is empty: nothing is traced",
                        self.settings.get()["trace_level"])  # fmt: skip

    def _channel(self, model: str) -> Channel | None:
        return self._models.get(model, self._global)

    def sync(self) -> None:
        """Wait for the trace files handed to the writer thread so far."""
        for file in list(self._files.values()):
            file.sync()

    def close(self) -> None:
        """The server stops: every pending trace is written."""
        for file in self._files.values():
            file.flush()
        if self.otel is not None:
            self.otel.close()

    # ---- requests ----------------------------------------------------------------------
    def begin(
        self, model: str, version: str, request_id: str, received_ns: int, parent_id: int = 0
    ) -> Trace | None:
        """The trace of a request reaching ``model``, or None when it is not sampled.
        ``parent_id``: the trace a BLS call was made under (``trace=request.trace()``)."""
        parent = CURRENT.get() or (_LIVE.get(parent_id) if parent_id else None)
        slot = FRONTEND.get() if parent is None else None
        if slot is not None and slot.trace is not None:
            slot = None  # taken by the request the frontend made (this one is inside it)
        remote = None
        if parent is not None:
            channel = parent.channel  # a traced ensemble's steps are traced with it
            parent_id = parent.id
        else:
            found = self._channel(model)
            if found is None or not found.on:
                return None
            if self.otel is not None and slot is not None and slot.carrier:
                remote = self.otel.remote(slot.carrier)  # traced whatever the rate
            if remote is None and not found.sample():
                return None
            channel, parent_id = found, 0
        trace = Trace(next(_IDS), model, version, request_id, parent_id, channel)
        _LIVE[trace.id] = trace
        if channel.tensors:
            trace.tensors = []
        trace.stamp("REQUEST_START", received_ns)
        if self.otel is not None:
            self.otel.start(trace, parent, slot.recv_start if slot is not None else 0, remote)
        if slot is not None:
            slot.trace = trace  # the frontend stamps the send and ends it
            read = "RECV" if slot.protocol == "HTTP" else "WAITREAD"
            trace.stamp(f"{slot.protocol}_{read}_START", slot.recv_start)
            if slot.recv_end:
                trace.stamp(f"{slot.protocol}_{read}_END", slot.recv_end)
        return trace


#: The W3C trace context a client may send (HTTP headers, gRPC metadata)
TRACE_CONTEXT = ("traceparent", "tracestate")


def trace_context(fields: Mapping[str, str]) -> dict[str, str] | None:
    """A request's W3C trace context (``traceparent``, ``tracestate``) from its headers
    or metadata, None without a ``traceparent``."""
    if "traceparent" not in fields:
        return None
    return {k: fields[k] for k in TRACE_CONTEXT if k in fields}


def http_slot(tracer: Tracer | None, headers: Mapping[str, str]) -> FrontendSlot | None:
    """A slot for an HTTP request a route serves itself (the LLM routes), in this task's
    context, while the server traces; its ``recv_end`` is the caller's to stamp."""
    if tracer is None or not tracer.enabled:
        return None
    slot = FrontendSlot("HTTP", time.monotonic_ns(), carrier=trace_context(headers))
    FRONTEND.set(slot)
    return slot


def owned_by_frontend(trace: Trace) -> bool:
    """Whether a frontend will stamp the send and end ``trace``."""
    slot = FRONTEND.get()
    return slot is not None and slot.trace is trace


def frontend_done(slot: FrontendSlot | None, send_start: int) -> None:
    """A frontend has sent its response: the send stamps, and the trace ends."""
    if slot is None or slot.trace is None:
        return
    trace = slot.trace
    prefix = slot.protocol
    trace.stamp(f"{prefix}_SEND_START", send_start)
    trace.stamp(f"{prefix}_SEND_END")
    trace.end()
