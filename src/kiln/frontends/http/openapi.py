"""The OpenAPI 3.0 document of kiln's KServe v2 REST API (``GET /v2/openapi.json``).

Written by hand from the protocol (the routes parse bytes themselves, so there are no
models to derive it from). It is for users' tooling and for fuzzers (schemathesis); the
binary tensor extension is described by its JSON header only.
"""

from __future__ import annotations

from typing import Any

from kiln import __version__

_ERROR = {
    "type": "object",
    "properties": {"error": {"type": "string"}},
    "required": ["error"],
}
_PARAMETERS = {"type": "object", "additionalProperties": True}
_DATATYPES = [
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "FP32",
    "FP64",
    "BF16",
    "BYTES",
]
_TENSOR_IN = {
    "type": "object",
    "required": ["name", "shape", "datatype"],
    "properties": {
        "name": {"type": "string"},
        "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "datatype": {"type": "string", "enum": _DATATYPES},
        "parameters": _PARAMETERS,
        "data": {"type": "array", "items": {}},
    },
}
_TENSOR_OUT = {
    "type": "object",
    "required": ["name", "shape", "datatype"],
    "properties": {
        "name": {"type": "string"},
        "shape": {"type": "array", "items": {"type": "integer"}},
        "datatype": {"type": "string"},
        "parameters": _PARAMETERS,
        "data": {"type": "array", "items": {}},
    },
}
_SCHEMAS: dict[str, Any] = {
    "Error": _ERROR,
    "ServerMetadata": {
        "type": "object",
        "required": ["name", "version", "extensions"],
        "properties": {
            "name": {"type": "string"},
            "version": {"type": "string"},
            "extensions": {"type": "array", "items": {"type": "string"}},
        },
    },
    "TensorMetadata": {
        "type": "object",
        "required": ["name", "datatype", "shape"],
        "properties": {
            "name": {"type": "string"},
            "datatype": {"type": "string"},
            "shape": {"type": "array", "items": {"type": "integer"}},
        },
    },
    "ModelMetadata": {
        "type": "object",
        "required": ["name", "platform", "inputs", "outputs"],
        "properties": {
            "name": {"type": "string"},
            "versions": {"type": "array", "items": {"type": "string"}},
            "platform": {"type": "string"},
            "inputs": {"type": "array", "items": {"$ref": "#/components/schemas/TensorMetadata"}},
            "outputs": {"type": "array", "items": {"$ref": "#/components/schemas/TensorMetadata"}},
        },
    },
    "InferenceRequest": {
        "type": "object",
        "required": ["inputs"],
        "properties": {
            "id": {"type": "string"},
            "parameters": _PARAMETERS,
            "inputs": {"type": "array", "items": _TENSOR_IN},
            "outputs": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {"name": {"type": "string"}, "parameters": _PARAMETERS},
                },
            },
        },
    },
    "InferenceResponse": {
        "type": "object",
        "required": ["model_name", "outputs"],
        "properties": {
            "model_name": {"type": "string"},
            "model_version": {"type": "string"},
            "id": {"type": "string"},
            "parameters": _PARAMETERS,
            "outputs": {"type": "array", "items": _TENSOR_OUT},
        },
    },
    "RepositoryIndexRequest": {"type": "object", "properties": {"ready": {"type": "boolean"}}},
    "RepositoryIndex": {
        "type": "array",
        "items": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string"},
                "version": {"type": "string"},
                "state": {"type": "string"},
                "reason": {"type": "string"},
            },
        },
    },
    "ModelControlRequest": {"type": "object", "properties": {"parameters": _PARAMETERS}},
    # docs/rollouts.md: the config's rollout_* parameters without the prefix
    "RolloutPolicy": {
        "type": "object",
        "properties": {
            k: {"anyOf": [{"type": "string"}, {"type": "number"}]}
            for k in (
                "traffic_split",
                "sticky_key",
                "shadow",
                "shadow_queue_size",
                "canary",
                "primary",
                "steps",
                "interval_secs",
                "max_error_rate_delta",
                "max_p99_ratio",
                "min_requests",
            )
        },
    },
    "Statistics": {
        "type": "object",
        "required": ["model_stats"],
        "properties": {"model_stats": {"type": "array", "items": {"type": "object"}}},
    },
    "ShmRegister": {
        "type": "object",
        "required": ["key", "byte_size"],
        "properties": {
            "key": {"type": "string"},
            "offset": {"type": "integer", "minimum": 0},
            "byte_size": {"type": "integer", "minimum": 0},
        },
    },
}


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str = "OK") -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*codes: int) -> dict[str, Any]:
    return {str(c): _json(_ref("Error"), "error") for c in codes}


def _status_only(description: str) -> dict[str, Any]:
    return {"description": description}


def _path_param(name: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}


def _op(
    summary: str,
    responses: dict[str, Any],
    params: tuple[str, ...] = (),
    body: str | None = None,
) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "responses": responses}
    if params:
        op["parameters"] = [_path_param(p) for p in params]
    if body:
        op["requestBody"] = {
            "required": False,
            "content": {"application/json": {"schema": _ref(body)}},
        }
    return op


def openapi_document() -> dict[str, Any]:
    m = ("model",)
    mv = ("model", "version")
    paths: dict[str, Any] = {
        "/v2": {"get": _op("Server metadata", {"200": _json(_ref("ServerMetadata"))})},
        "/v2/health/live": {
            "get": _op("Liveness", {"200": _status_only("live"), "400": _status_only("not")})
        },
        "/v2/health/ready": {
            "get": _op("Readiness", {"200": _status_only("ready"), "400": _status_only("not")})
        },
        "/v2/models/stats": {
            "get": _op("Statistics of every model", {"200": _json(_ref("Statistics"))})
        },
        "/v2/repository/index": {
            "post": _op(
                "Repository index",
                {"200": _json(_ref("RepositoryIndex")), **_errors(400)},
                body="RepositoryIndexRequest",
            )
        },
        "/v2/systemsharedmemory/status": {
            "get": _op("System shared memory regions", {"200": _json({"type": "array"})})
        },
        "/v2/systemsharedmemory/region/{region}/register": {
            "post": _op(
                "Register a system shared memory region",
                {"200": _status_only("registered"), **_errors(400)},
                ("region",),
                "ShmRegister",
            )
        },
        "/v2/trace/setting": {
            "get": _op("Global trace settings", {"200": _json({"type": "object"})})
        },
        "/v2/logging": {"get": _op("Log settings", {"200": _json({"type": "object"})})},
    }
    model_prefixes = (("/v2/models/{model}", m), ("/v2/models/{model}/versions/{version}", mv))
    for prefix, params in model_prefixes:
        paths[prefix] = {
            "get": _op(
                "Model metadata", {"200": _json(_ref("ModelMetadata")), **_errors(400, 404)}, params
            )
        }
        paths[prefix + "/ready"] = {
            "get": _op(
                "Model readiness",
                {"200": _status_only("ready"), "400": _status_only("not ready")},
                params,
            )
        }
        paths[prefix + "/config"] = {
            "get": _op(
                "Model configuration",
                {"200": _json({"type": "object"}), **_errors(400, 404)},
                params,
            )
        }
        paths[prefix + "/stats"] = {
            "get": _op(
                "Model statistics", {"200": _json(_ref("Statistics")), **_errors(400, 404)}, params
            )
        }
        paths[prefix + "/infer"] = {
            "post": {
                **_op(
                    "Inference",
                    {"200": _json(_ref("InferenceResponse")), **_errors(400, 404, 413)},
                    params,
                ),
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": _ref("InferenceRequest")}},
                },
            }
        }
    for action in ("load", "unload"):
        paths[f"/v2/repository/models/{{model}}/{action}"] = {
            "post": _op(
                f"Model control: {action}",
                {"200": _status_only(f"{action}ed"), **_errors(400, 404)},
                m,
                "ModelControlRequest",
            )
        }
    paths["/v2/repository/models/{model}/rollout"] = {
        "get": _op("Model rollout", {"200": _json({"type": "object"}), **_errors(404)}, m),
        "post": _op(
            "Replace the model's rollout policy",
            {"200": _json({"type": "object"}), **_errors(400, 404)},
            m,
            "RolloutPolicy",
        ),
    }
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "kiln: KServe v2 inference protocol (Triton-compatible)",
            "version": __version__,
        },
        "paths": paths,
        "components": {
            "schemas": _SCHEMAS,
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            },
        },
    }
