"""One ``kiln bench`` run: discover the model, build requests, measure every load level."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kiln.bench.bodies import Placement, grpc_request, http_body
from kiln.bench.control import Control
from kiln.bench.inputs import ModelSpec, generate, load_file, request_shapes
from kiln.bench.measure import Plan, Recorder, Slot, arrival_gaps, closed_loop, open_loop
from kiln.bench.options import BenchError, BenchOptions
from kiln.bench.options import Protocol as Wire
from kiln.bench.shm import ClientRegion
from kiln.bench.stats import LevelResult, Window, summarize
from kiln.bench.transport import (
    GrpcSlot,
    GrpcStreamSlot,
    HttpConnection,
    HttpSlot,
    http_request,
)


class Progress(Protocol):
    """Told about each level and each window as they happen (the CLI's progress bar)."""

    def level(self, label: str, trials: int) -> None: ...

    def window(self, trial: int, window: Window) -> None: ...


@dataclass(slots=True)
class BenchResult:
    """Everything a run measured; ``to_json`` is the ``--json`` report."""

    options: BenchOptions
    spec: ModelSpec
    levels: list[LevelResult] = field(default_factory=list)
    total_requests: int = 0  # successful requests over the whole run, unmeasured ones too
    total_errors: int = 0
    total_dropped: int = 0
    first_error: str | None = None
    started: str = ""

    @property
    def encoding(self) -> str:
        if self.options.protocol is Wire.GRPC:
            return "grpc"
        return "http-binary" if self.options.binary else "http-json"

    @property
    def streaming(self) -> bool:
        """Requests went over a gRPC ModelStreamInfer stream (a decoupled model always)."""
        o = self.options
        return o.protocol is Wire.GRPC and (o.streaming or self.spec.decoupled)

    def to_json(self) -> dict[str, Any]:
        o = self.options
        return {
            "model": o.model,
            "model_version": o.model_version,
            "url": o.url,
            "protocol": o.protocol.value,
            "encoding": self.encoding,
            "shared_memory": o.shared_memory,
            "batch_size": o.batch_size,
            "input_data": o.input_data,
            "mode": "request_rate" if o.open_loop else "concurrency",
            # a model with sequence_batching: requests per sequence, else None
            "sequence_length": o.sequence_length if self.spec.sequence else None,
            "streaming": self.streaming,
            "distribution": o.distribution.value if o.open_loop else None,
            "started": self.started,
            "levels": [level_json(level) for level in self.levels],
            "total": {
                "requests": self.total_requests,
                "errors": self.total_errors,
                "dropped": self.total_dropped,
                "first_error": self.first_error,
            },
        }


def level_json(level: LevelResult) -> dict[str, Any]:
    return {
        "concurrency": level.concurrency,
        "request_rate": level.request_rate,
        "throughput_infer_per_sec": level.throughput,
        "requests_per_sec": level.requests_per_sec,
        # streamed requests: their responses that carried outputs, per second
        "responses_per_sec": level.responses_per_sec if level.responses else None,
        "requests": level.requests,
        "errors": level.errors,
        "dropped": level.dropped,
        "late": level.late,
        "seconds": level.seconds,
        "stable": level.stable,
        "windows": level.windows,
        "latency_us": level.latency_us,
        "server_us": level.server_us,
        "server_requests": level.server_requests,
        "client_cpu_us_per_request": level.client_cpu_us_per_request,
    }


# One request's bytes from a data entry, its shared-memory placement and its parameters.
Encode = Callable[[dict[str, Any], Placement, dict[str, Any] | None], bytes]
# The requests client N sends, in a loop.
ClientRequests = Callable[[int], list[bytes]]


def streams(options: BenchOptions, spec: ModelSpec) -> bool:
    """Whether requests go over a gRPC ``ModelStreamInfer`` stream: with ``--streaming``,
    and always for a decoupled model, whose 0..N responses nothing else carries."""
    if not spec.decoupled:
        return options.streaming
    if options.protocol is not Wire.GRPC:
        raise BenchError(
            f"model '{spec.name}' is decoupled (0..N responses per request): kiln bench "
            "sends its requests over a gRPC stream, add -i grpc"
        )
    return True


def _encoder(options: BenchOptions, control: Control, spec: ModelSpec) -> Encode:
    if options.protocol is Wire.GRPC:
        if streams(options, spec):  # the end of a request's responses is always marked
            mark = {"triton_enable_empty_final_response": True}
            return lambda entry, placement, params: grpc_request(
                spec, entry, placement, {**mark, **(params or {})}
            )
        return lambda entry, placement, params: grpc_request(spec, entry, placement, params)
    path = control.model_path + "/infer"

    def encode(entry: dict[str, Any], placement: Placement, params: dict[str, Any] | None) -> bytes:
        body = http_body(spec, entry, options.binary, placement, params)
        headers = {**body.headers, **options.auth_headers()}
        return http_request("POST", control.host, path, body.body, headers)

    return encode


def sequence_requests(
    encode: Encode, entries: list[Any], placements: list[Placement], length: int,
    sequence_id: int,
) -> list[bytes]:  # fmt: skip
    """One client's requests for a model with ``sequence_batching``, as perf_analyzer sends
    them: a sequence of ``length`` under ``sequence_id``, START on the first and END on the
    last, cycling through the data entries. The client sends them in a loop, so each round
    is a new sequence under the same id (a START after END starts it afresh)."""
    encoded: dict[tuple[int, bool, bool], bytes] = {}
    out = []
    for k in range(length):
        index = k % len(entries)
        start, end = k == 0, k == length - 1
        key = (index, start, end)
        if key not in encoded:
            params: dict[str, Any] = {"sequence_id": sequence_id}
            if start:
                params["sequence_start"] = True
            if end:
                params["sequence_end"] = True
            encoded[key] = encode(entries[index], placements[index], params)
        out.append(encoded[key])
    return out


def _client_requests(
    options: BenchOptions, encode: Encode, spec: ModelSpec, entries: list[Any],
    placements: list[Placement],
) -> ClientRequests:  # fmt: skip
    if not spec.sequence:
        shared = [encode(e, p, None) for e, p in zip(entries, placements, strict=True)]
        return lambda client: shared
    if options.open_loop:
        raise BenchError(
            f"model '{spec.name}' has sequence_batching: its requests belong to sequences, "
            "which kiln bench sends from closed-loop clients; use --concurrency-range, not "
            "--request-rate-range"
        )
    return lambda client: sequence_requests(
        encode, entries, placements, options.sequence_length, options.sequence_id_start + client
    )


async def run_async(options: BenchOptions, progress: Progress | None = None) -> BenchResult:
    control = Control(options)
    region: ClientRegion | None = None
    try:
        spec = await control.model_spec()
        shapes = request_shapes(spec, options.batch_size, options.shapes)
        path = options.input_path
        entries = (
            load_file(path, spec, shapes)
            if path is not None
            else generate(spec, shapes, options.input_data, options.seed)
        )
        placements = [Placement() for _ in entries]
        if options.shared_memory == "system":
            region = ClientRegion(spec, entries, options.batch_size)
            await control.shm_register(region.name, region.key, region.byte_size)
            placements = region.placements
        requests = _client_requests(
            options, _encoder(options, control, spec), spec, entries, placements
        )
        streaming = streams(options, spec)
        result = BenchResult(
            options, spec, started=datetime.datetime.now().isoformat("T", "seconds")
        )
        recorder = Recorder()
        for level in options.request_rates or options.concurrency:
            result.levels.append(
                await _level(options, control, requests, recorder, level, progress, streaming)
            )
        result.total_requests = recorder.total_ok
        result.total_errors = recorder.total_errors
        result.total_dropped = recorder.total_dropped
        result.first_error = recorder.first_error
        return result
    finally:
        if region is not None:
            # If the server went away, the object is still ours to remove.
            with contextlib.suppress(BenchError):
                await control.shm_unregister(region.name)
            region.close()
        await control.close()


async def _level(options: BenchOptions, control: Control, requests: ClientRequests,
                 recorder: Recorder, level: float, progress: Progress | None,
                 streaming: bool = False) -> LevelResult:  # fmt: skip
    plan = Plan(
        options.measurement_interval_ms / 1000.0,
        options.max_trials,
        options.stability_percentage,
        options.percentile,
        options.duration_s,
    )

    def make_slot(client: int = 0) -> Slot:
        mine = requests(client)
        if streaming:
            return GrpcStreamSlot(control.target, mine, options.timeout_s, options.grpc_metadata())
        if options.protocol is Wire.GRPC:
            return GrpcSlot(control.target, mine, options.timeout_s, options.grpc_metadata())
        return HttpSlot(HttpConnection(control.host, control.port, options.timeout_s), mine)

    on_window: Callable[[int, Window], None] = progress.window if progress else lambda t, w: None
    trials = 1 if options.duration_s is not None else options.max_trials
    if options.open_loop:
        if progress:
            progress.level(f"{level:g} req/s", trials)
        gaps = arrival_gaps(level, options.distribution, options.seed)
        windows, stable = await open_loop(
            make_slot, options.max_outstanding, gaps, recorder, control.stats, plan, on_window
        )
        return summarize(windows, stable, options.batch_size, request_rate=level)
    concurrency = int(level)
    if progress:
        progress.level(f"concurrency {concurrency}", trials)
    slots = [make_slot(client) for client in range(concurrency)]
    try:
        for slot in slots:
            if isinstance(slot, HttpSlot):
                try:
                    await slot.connection.connect()
                except OSError as exc:
                    raise BenchError(
                        f"cannot reach the server at {control.target}: {exc}"
                    ) from None
        windows, stable = await closed_loop(slots, recorder, control.stats, plan, on_window)
    finally:
        await asyncio.gather(*(s.close() for s in slots), return_exceptions=True)
    return summarize(windows, stable, options.batch_size, concurrency=concurrency)


def run(options: BenchOptions | None = None, /, *, progress: Progress | None = None,
        **kwargs: Any) -> BenchResult:  # fmt: skip
    """Run a benchmark from Python: ``run(model="simple", concurrency=[1, 2])``.

    Raises ``BenchError`` when the server is unreachable, the model unknown or the options
    do not fit the model; failed requests are counted in the result instead.
    """
    opts = options if options is not None else BenchOptions(**kwargs)
    try:
        import uvloop  # the loop kiln serves with; it costs the generator less CPU too
    except ImportError:
        return asyncio.run(run_async(opts, progress))
    return uvloop.run(run_async(opts, progress))
