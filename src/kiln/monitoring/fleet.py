"""The fleet: every host's GPUs, scraped from GPU agents, kiln servers or a Prometheus.

A ``FleetScraper`` thread reads each source every ``interval_s`` and keeps the last good
reading per source. ``kiln serve --monitor-agent/--monitor-prometheus`` merges it into the
snapshots history and alert rules read (so ``DCGM_FI_DEV_GPU_TEMP > 85`` in a rules file
evaluates against every host, and history stores the fleet's series); ``kiln monitor
--agent`` uses the same scraper for its terminal view.

- An agent (``kiln monitor agent`` or dcgm-exporter itself): its ``DCGM_FI_*`` and
  ``kiln_gpu_process_memory_used_bytes`` series, plus ``instance="host:port"`` as a
  Prometheus scrape adds it (two agents on one host stay two series).
- A kiln server's metrics port: its Triton GPU families (``nv_gpu_*``,
  ``kiln_gpu_temperature_celsius``) translated to the DCGM names and units.
- Prometheus (``/api/v1/query``): every ``DCGM_FI_*`` series it holds, labels as stored.

A source that fails keeps no stale values: its series disappear until it answers again,
and its error is shown (``targets``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kiln.metrics import names
from kiln.metrics.dcgm import NAMES as DCGM_NAMES
from kiln.metrics.dcgm import PROCESS_MEMORY
from kiln.monitoring.snapshot import Labels, Snapshot, labels_of

log = logging.getLogger(__name__)
Series = dict[str, dict[Labels, float]]
MIB = 1024 * 1024
MAX_BODY = 16 * 1024 * 1024  # a scrape larger than this is not a GPU exporter's
READ_CHUNK = 64 * 1024
# A source's scrape limits (Prometheus's sample_limit, label_limit, label_name_length_limit
# and label_value_length_limit): every alert evaluation keeps the snapshots of its longest
# window, each with its own copy of every series, so one source's excess is multiplied.
MAX_SERIES = 10_000
MAX_LABELS = 32
MAX_LABEL_NAME = 128
MAX_LABEL_VALUE = 1024
FLEET_METRICS = DCGM_NAMES | {PROCESS_MEMORY}
UP_JOB = "kiln-fleet"
# kiln serve's Triton families -> (DCGM name, scale)
_FROM_KILN = {
    names.GPU_UTILIZATION: (names.DCGM_FI_DEV_GPU_UTIL, 100.0),
    names.GPU_MEMORY_USED_BYTES: (names.DCGM_FI_DEV_FB_USED, 1 / MIB),
    names.GPU_POWER_USAGE: (names.DCGM_FI_DEV_POWER_USAGE, 1.0),
    names.KILN_GPU_TEMPERATURE_CELSIUS: (names.DCGM_FI_DEV_GPU_TEMP, 1.0),
    names.KILN_GPU_SM_CLOCK_MHZ: (names.DCGM_FI_DEV_SM_CLOCK, 1.0),
}


class FleetError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class FleetOptions:
    agents: tuple[str, ...] = ()  # host:port or URL of /metrics (agents or kiln servers)
    prometheus: str = ""  # base URL of a Prometheus server
    interval_s: float = 5.0
    timeout_s: float = 5.0

    @property
    def enabled(self) -> bool:
        return bool(self.agents or self.prometheus)


def target_url(address: str) -> str:
    url = address if "://" in address else f"http://{address}"
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise FleetError(f"'{address}' is not host:port or an http(s) URL")
    return url if parsed.path not in ("", "/") else url.rstrip("/") + "/metrics"


def _get(url: str, timeout: float) -> bytes:
    """The whole answer within ``timeout``: a socket timeout bounds each read, not the
    answer, and a peer sending a byte at a time would keep the read going for hours."""
    deadline = time.monotonic() + timeout
    chunks: list[bytes] = []
    size = 0
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        while chunk := resp.read1(READ_CHUNK):
            size += len(chunk)
            if size > MAX_BODY:
                raise FleetError(f"{url}: answer larger than {MAX_BODY} bytes")
            if time.monotonic() > deadline:
                raise FleetError(f"{url}: no complete answer within {timeout:g} s")
            chunks.append(chunk)
    return b"".join(chunks)


def parse_exposition(text: str, instance: str) -> Series:
    """The fleet's series in one exporter's text, each labelled with ``instance``."""
    out: Series = {}
    kiln_gpus: dict[str, dict[str, float]] = {}  # kiln server: gpu_uuid -> family -> value
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in FLEET_METRICS and "UUID" in s.labels:
                labels = labels_of({**s.labels, "instance": instance})
                out.setdefault(s.name, {})[labels] = float(s.value)
            elif "gpu_uuid" in s.labels and (
                s.name in _FROM_KILN or s.name == names.GPU_MEMORY_TOTAL_BYTES
            ):
                kiln_gpus.setdefault(s.labels["gpu_uuid"], {})[s.name] = float(s.value)
    host = instance.rsplit(":", 1)[0]
    for index, (uuid, values) in enumerate(sorted(kiln_gpus.items())):
        labels = labels_of({"gpu": str(index), "UUID": uuid, "Hostname": host,
                            "instance": instance})  # fmt: skip
        for name, v in values.items():
            if name in _FROM_KILN:
                dcgm, scale = _FROM_KILN[name]
                out.setdefault(dcgm, {})[labels] = v * scale
        if names.GPU_MEMORY_TOTAL_BYTES in values and names.GPU_MEMORY_USED_BYTES in values:
            free = values[names.GPU_MEMORY_TOTAL_BYTES] - values[names.GPU_MEMORY_USED_BYTES]
            out.setdefault(names.DCGM_FI_DEV_FB_FREE, {})[labels] = free / MIB
    return out


def query_prometheus(base: str, timeout: float) -> Series:
    query = urllib.parse.urlencode({"query": '{__name__=~"DCGM_FI_.*"}'})
    body = _get(f"{base.rstrip('/')}/api/v1/query?{query}", timeout)
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting too deep
        raise FleetError(f"Prometheus: the answer is not JSON ({type(exc).__name__})") from None
    if not isinstance(doc, dict):
        raise FleetError("Prometheus: the answer is not a JSON object")
    if doc.get("status") != "success":
        raise FleetError(f"Prometheus: {str(doc.get('error', 'query failed'))[:200]}")
    data = doc.get("data")
    result = data.get("result") if isinstance(data, dict) else None
    if not isinstance(result, list):
        raise FleetError("Prometheus: 'data.result' is not a list")
    out: Series = {}
    for i, item in enumerate(result):
        metric = item.get("metric") if isinstance(item, dict) else None
        value = item.get("value") if isinstance(item, dict) else None
        if not (isinstance(metric, dict) and isinstance(value, list) and len(value) == 2):
            raise FleetError(f"Prometheus: result {i} is not {{metric: {{...}}, value: [t, v]}}")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metric.items()):
            raise FleetError(f"Prometheus: result {i} has labels that are not strings")
        name = metric.pop("__name__", "")
        if name in DCGM_NAMES:
            try:
                out.setdefault(name, {})[labels_of(metric)] = float(value[1])
            except (TypeError, ValueError):
                raise FleetError(f"Prometheus: result {i} ({name}) has no number") from None
    return out


def within_limits(series: Series) -> Series:
    """``series`` if it keeps to a source's scrape limits; ``FleetError`` naming the first
    it breaks (the whole scrape fails, as in Prometheus)."""
    count = sum(len(values) for values in series.values())
    if count > MAX_SERIES:
        raise FleetError(f"{count} series, more than the {MAX_SERIES} a source may answer")
    for name, values in series.items():
        for labels in values:
            if len(labels) > MAX_LABELS:
                raise FleetError(
                    f"a {name} series has {len(labels)} labels, more than {MAX_LABELS}"
                )
            for key, value in labels:
                if len(key) > MAX_LABEL_NAME:
                    raise FleetError(
                        f"a {name} series has a label name longer than {MAX_LABEL_NAME} characters"
                    )
                if len(value) > MAX_LABEL_VALUE:
                    raise FleetError(
                        f"a {name} series has label '{key}' longer than {MAX_LABEL_VALUE} "
                        "characters"
                    )
    return series


@dataclass(slots=True)
class TargetStatus:
    source: str
    up: bool = False
    error: str = ""
    last_scrape: float | None = None
    gpus: int = 0


@dataclass(slots=True)
class FleetScraper:
    options: FleetOptions
    status: dict[str, TargetStatus] = field(default_factory=dict)
    _values: dict[str, Series] = field(default_factory=dict)  # source -> series
    _reads: dict[str, Future[Series]] = field(default_factory=dict)  # source -> last read
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        for a in self.options.agents:
            target_url(a)  # refuse a bad address before anything starts
        for source in self.sources():
            self.status[source] = TargetStatus(source)

    def sources(self) -> list[str]:
        out = list(self.options.agents)
        if self.options.prometheus:
            out.append(f"prometheus {self.options.prometheus}")
        return out

    def _read(self, source: str) -> Series:
        timeout = self.options.timeout_s
        if source.startswith("prometheus "):
            return within_limits(query_prometheus(self.options.prometheus, timeout))
        url = target_url(source)
        instance = urllib.parse.urlparse(url).netloc
        text = _get(url, timeout).decode("utf-8", "replace")
        return within_limits(parse_exposition(text, instance))

    def _start_read(self, source: str) -> Future[Series]:
        future: Future[Series] = Future()

        def read() -> None:
            try:
                future.set_result(self._read(source))
            except BaseException as exc:  # whatever a peer's answer raises is its failure
                future.set_exception(exc)

        threading.Thread(target=read, name="kiln-fleet-read", daemon=True).start()
        return future

    def scrape_once(self) -> None:
        """Every source at once, on its own thread, for at most ``timeout_s``: a slow or
        broken source is down, and the others are read as if it were not there. A source
        whose last read is still going gets no second one."""
        for source in self.sources():
            if source not in self._reads or self._reads[source].done():
                self._reads[source] = self._start_read(source)
        wait(self._reads.values(), timeout=self.options.timeout_s)
        for source in self.sources():
            st = self.status[source]
            read = self._reads[source]
            try:
                if not read.done():
                    raise FleetError(f"no complete answer within {self.options.timeout_s:g} s")
                series = read.result()
            except Exception as exc:
                if st.error != str(exc):
                    log.warning("fleet: %s: %s", source, exc)
                st.up, st.error = False, str(exc)
                with self._lock:
                    self._values.pop(source, None)  # no stale values
                continue
            st.up, st.error, st.last_scrape = True, "", time.time()
            st.gpus = len({dict(k).get("UUID") for v in series.values() for k in v})
            with self._lock:
                self._values[source] = series

    def values(self) -> Series:
        with self._lock:
            merged: Series = {}
            for series in self._values.values():
                for name, vals in series.items():
                    merged.setdefault(name, {}).update(vals)
        # Prometheus's per-target ``up``, so a rule can page on an agent that stopped answering.
        for source in self.options.agents:
            instance = urllib.parse.urlparse(target_url(source)).netloc
            labels = labels_of({"instance": instance, "job": UP_JOB})
            merged.setdefault("up", {})[labels] = 1.0 if self.status[source].up else 0.0
        return merged

    def snapshot(self) -> Snapshot:
        return Snapshot(time.time(), self.values())

    def targets(self) -> list[dict[str, Any]]:
        keys = ("source", "up", "error", "last_scrape", "gpus")
        return [{k: getattr(s, k) for k in keys} for s in self.status.values()]

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kiln-fleet", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                self.scrape_once()
            except Exception:  # the fleet view must never take the server down
                log.exception("fleet scrape failed")
            if self._stop.wait(self.options.interval_s):
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


_ROW = {
    "utilization_percent": names.DCGM_FI_DEV_GPU_UTIL,
    "memory_used_mib": names.DCGM_FI_DEV_FB_USED,
    "memory_free_mib": names.DCGM_FI_DEV_FB_FREE,
    "temperature_celsius": names.DCGM_FI_DEV_GPU_TEMP,
    "power_watts": names.DCGM_FI_DEV_POWER_USAGE,
    "xid": names.DCGM_FI_DEV_XID_ERRORS,
}


def fleet_figures(snap: Snapshot) -> list[dict[str, Any]]:
    """One row per (host, GPU) for the live view: the ``fleet`` list of ``/api/live``."""
    rows: dict[tuple[str, str, str], dict[str, Any]] = {}
    for key, metric in _ROW.items():
        for labels, v in snap.series(metric).items():
            d = dict(labels)
            host = d.get("Hostname") or d.get("instance", "")
            ident = (host, d.get("instance", ""), d.get("UUID", ""))
            row = rows.setdefault(
                ident,
                {"host": host, "instance": d.get("instance", ""), "gpu": d.get("gpu", ""),
                 "uuid": d.get("UUID", ""), "model_name": d.get("modelName", "")},
            )  # fmt: skip
            row[key] = v
    return [rows[k] for k in sorted(rows, key=lambda k: (k[0], k[1], _index(rows[k]["gpu"])))]


def _index(gpu: str) -> int:
    return int(gpu) if gpu.isdigit() else 1 << 30
