"""Control calls around the measurement: model metadata/config, statistics, shared memory.

Over HTTP these are KServe v2 REST calls; over gRPC the matching RPCs of
``GRPCInferenceService``. Either way the answers become the same typed values, and the two
failures that end a run early (server unreachable, model unknown) become ``BenchError``.
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass, fields
from typing import Any

import grpc
import orjson
from google.protobuf import json_format

from kiln.bench.inputs import ModelSpec, TensorSpec
from kiln.bench.options import BenchError, BenchOptions, Protocol
from kiln.bench.transport import HttpConnection, RequestError, error_text, host_port, http_request
from kiln.frontends.grpc import grpc_service_pb2 as pb

_SERVICE = "/inference.GRPCInferenceService/"


@dataclass(slots=True)
class StatsSnapshot:
    """Cumulative counters of one model (all versions summed) from the statistics endpoint."""

    success_count: int = 0
    fail_count: int = 0
    inference_count: int = 0
    execution_count: int = 0
    queue_ns: int = 0
    compute_input_ns: int = 0
    compute_infer_ns: int = 0
    compute_output_ns: int = 0
    cache_hit_count: int = 0

    def __sub__(self, other: StatsSnapshot) -> StatsSnapshot:
        return StatsSnapshot(
            *(getattr(self, f.name) - getattr(other, f.name) for f in fields(self))
        )

    def __add__(self, other: StatsSnapshot) -> StatsSnapshot:
        return StatsSnapshot(
            *(getattr(self, f.name) + getattr(other, f.name) for f in fields(self))
        )

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> StatsSnapshot:
        """Triton's statistics JSON (the gRPC message converted with its field names)."""
        snap = cls()
        for model in doc.get("model_stats", []):
            s = model.get("inference_stats", {})

            def get(key: str, what: str = "ns", s: dict[str, Any] = s) -> int:
                return int(s.get(key, {}).get(what, 0))

            snap.success_count += get("success", "count")
            snap.fail_count += get("fail", "count")
            snap.inference_count += int(model.get("inference_count", 0))
            snap.execution_count += int(model.get("execution_count", 0))
            snap.queue_ns += get("queue")
            snap.compute_input_ns += get("compute_input")
            snap.compute_infer_ns += get("compute_infer")
            snap.compute_output_ns += get("compute_output")
            snap.cache_hit_count += get("cache_hit", "count")
        return snap


def _spec(
    meta: dict[str, Any], max_batch_size: int, version: str, sequence: bool = False,
    decoupled: bool = False,
) -> ModelSpec:  # fmt: skip
    def tensors(key: str) -> list[TensorSpec]:
        return [
            TensorSpec(t["name"], t["datatype"], [int(d) for d in t.get("shape", [])])
            for t in meta.get(key, [])
        ]

    return ModelSpec(
        meta["name"], version, tensors("inputs"), tensors("outputs"), max_batch_size, sequence,
        decoupled,
    )  # fmt: skip


class Control:
    """The control client for one model on one server, over the run's protocol."""

    def __init__(self, options: BenchOptions) -> None:
        self.options = options
        self.model = options.model
        self.grpc = options.protocol is Protocol.GRPC
        self.host, self.port = host_port(options.url, 8001 if self.grpc else 8000)
        self.target = f"{self.host}:{self.port}"
        self._http = HttpConnection(self.host, self.port, timeout_s=30.0)
        self._channel = grpc.aio.insecure_channel(self.target) if self.grpc else None
        quoted = urllib.parse.quote(options.model, safe="")
        version = options.model_version
        self.model_path = f"/v2/models/{quoted}" + (
            f"/versions/{urllib.parse.quote(version, safe='')}" if version else ""
        )

    def _unreachable(self, exc: BaseException) -> BenchError:
        kind = "gRPC" if self.grpc else "HTTP"
        return BenchError(f"cannot reach the server at {self.target} over {kind}: {exc}")

    async def _get(self, path: str, body: bytes = b"", method: str = "GET") -> tuple[int, bytes]:
        try:
            request = http_request(method, self.host, path, body, self.options.auth_headers())
            return await self._http.send(request)
        except (OSError, RequestError) as exc:
            raise self._unreachable(exc) from None

    async def _rpc(self, method: str, request: Any, response_type: Any) -> Any:
        assert self._channel is not None
        call = self._channel.unary_unary(
            _SERVICE + method,
            request_serializer=type(request).SerializeToString,
            response_deserializer=response_type.FromString,
        )
        try:
            return await call(request, timeout=30.0, metadata=self.options.grpc_metadata())
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.UNAVAILABLE:
                raise self._unreachable(exc.details() or exc.code().name) from None
            if exc.code() is grpc.StatusCode.NOT_FOUND:
                raise self._unknown_model(f"gRPC NOT_FOUND: {exc.details()}") from None
            raise BenchError(f"{method} failed: gRPC {exc.code().name}: {exc.details()}") from None

    def _unknown_model(self, detail: str) -> BenchError:
        version = f" version '{self.options.model_version}'" if self.options.model_version else ""
        return BenchError(
            f"model '{self.model}'{version} is not available on {self.target} ({detail})"
        )

    async def model_spec(self) -> ModelSpec:
        """Metadata plus ``max_batch_size`` (from the model config) of the benchmarked model."""
        version = self.options.model_version
        if self.grpc:
            meta = await self._rpc(
                "ModelMetadata",
                pb.ModelMetadataRequest(name=self.model, version=version),
                pb.ModelMetadataResponse,
            )
            config = await self._rpc(
                "ModelConfig",
                pb.ModelConfigRequest(name=self.model, version=version),
                pb.ModelConfigResponse,
            )
            meta_doc = json_format.MessageToDict(meta, preserving_proto_field_name=True)
            sequence = config.config.HasField("sequence_batching")
            decoupled = config.config.model_transaction_policy.decoupled
            return _spec(meta_doc, int(config.config.max_batch_size), version, sequence, decoupled)
        status, body = await self._get(self.model_path)
        if status != 200:
            raise self._unknown_model(error_text(status, body))
        meta_doc = orjson.loads(body)
        status, body = await self._get(self.model_path + "/config")
        # A server without the config extension: guess batching from a leading -1 dim.
        sequence = decoupled = False
        if status == 200:
            config_doc = orjson.loads(body)
            max_batch = int(config_doc.get("max_batch_size", 0))
            sequence = "sequence_batching" in config_doc
            policy = config_doc.get("model_transaction_policy") or {}
            decoupled = bool(policy.get("decoupled", False))
        else:
            first = [t.get("shape", [0])[:1] for t in meta_doc.get("inputs", [])]
            max_batch = 1 if first and all(f == [-1] for f in first) else 0
        return _spec(meta_doc, max_batch, version, sequence, decoupled)

    async def stats(self) -> StatsSnapshot:
        if self.grpc:
            response = await self._rpc(
                "ModelStatistics",
                pb.ModelStatisticsRequest(name=self.model, version=self.options.model_version),
                pb.ModelStatisticsResponse,
            )
            doc = json_format.MessageToDict(response, preserving_proto_field_name=True)
            return StatsSnapshot.from_json(doc)
        status, body = await self._get(self.model_path + "/stats")
        if status != 200:
            raise BenchError(f"statistics of model '{self.model}': {error_text(status, body)}")
        return StatsSnapshot.from_json(orjson.loads(body))

    async def shm_register(self, name: str, key: str, byte_size: int) -> None:
        if self.grpc:
            await self._rpc(
                "SystemSharedMemoryRegister",
                pb.SystemSharedMemoryRegisterRequest(
                    name=name, key=key, offset=0, byte_size=byte_size
                ),
                pb.SystemSharedMemoryRegisterResponse,
            )
            return
        doc = orjson.dumps({"key": key, "offset": 0, "byte_size": byte_size})
        path = f"/v2/systemsharedmemory/region/{urllib.parse.quote(name, safe='')}/register"
        status, body = await self._get(path, doc, "POST")
        if status != 200:
            raise BenchError(
                f"registering shared memory region '{name}': {error_text(status, body)}"
            )

    async def shm_unregister(self, name: str) -> None:
        if self.grpc:
            await self._rpc(
                "SystemSharedMemoryUnregister",
                pb.SystemSharedMemoryUnregisterRequest(name=name),
                pb.SystemSharedMemoryUnregisterResponse,
            )
            return
        path = f"/v2/systemsharedmemory/region/{urllib.parse.quote(name, safe='')}/unregister"
        await self._get(path, b"", "POST")

    async def close(self) -> None:
        self._http.close()
        if self._channel is not None:
            await self._channel.close()
