"""instance_group expansion: counts, KIND_AUTO's CPU fallback, KIND_GPU without a GPU."""

from __future__ import annotations

import pytest
from google.protobuf import text_format

from kiln.backends.base import instance_specs
from kiln.config.model_config_pb2 import ModelConfig
from kiln.core.errors import KilnError, Status


def config(groups: str) -> ModelConfig:
    return text_format.Parse(f'name: "m" backend: "onnxruntime" {groups}', ModelConfig())


def test_counts_expand_to_one_spec_per_instance() -> None:
    specs = instance_specs(
        config('instance_group [{count: 2 kind: KIND_CPU}, {name: "b" count: 1}]'), 0
    )
    assert [(s.name, s.kind, s.index, s.total_instances) for s in specs] == [
        ("m_0", "cpu", 0, 3),
        ("m_0", "cpu", 1, 3),
        ("b", "cpu", 2, 3),
    ]


def test_kind_auto_falls_back_to_cpu_without_a_gpu() -> None:
    specs = instance_specs(config("instance_group [{count: 2 kind: KIND_AUTO}]"), 0)
    assert [s.kind for s in specs] == ["cpu", "cpu"]
    on_gpu = instance_specs(config("instance_group [{count: 2 kind: KIND_AUTO}]"), 1)
    assert [(s.kind, s.device_id) for s in on_gpu] == [("gpu", 0), ("gpu", 0)]


def test_kind_gpu_without_a_gpu_refuses_with_the_reason() -> None:
    with pytest.raises(KilnError) as err:
        instance_specs(config("instance_group [{count: 1 kind: KIND_GPU}]"), 0)
    assert err.value.status is Status.INVALID_ARG
    message = err.value.message
    assert "instance group m_0 of model m has kind KIND_GPU" in message
    assert "server does not support GPUs" in message and "onnxruntime" in message


def test_kind_gpu_lists_one_instance_per_gpu_and_count() -> None:
    specs = instance_specs(config("instance_group [{count: 2 kind: KIND_GPU gpus: [0, 1]}]"), 2)
    assert [(s.kind, s.device_id) for s in specs] == [
        ("gpu", 0),
        ("gpu", 0),
        ("gpu", 1),
        ("gpu", 1),
    ]


def test_kind_gpu_without_gpus_spreads_over_every_gpu() -> None:
    """Triton's default: ``count`` instances on each visible GPU."""
    specs = instance_specs(config("instance_group [{count: 2 kind: KIND_GPU}]"), 3)
    assert [s.device_id for s in specs] == [0, 0, 1, 1, 2, 2]
    # A backend that runs one engine (the llm backend) stays on GPU 0 by default ...
    single = instance_specs(config("instance_group [{kind: KIND_GPU}]"), 3, False)
    assert [(s.kind, s.device_id) for s in single] == [("gpu", 0)]
    # ... and goes where ``gpus`` says.
    chosen = instance_specs(config("instance_group [{kind: KIND_GPU gpus: [2]}]"), 3, False)
    assert [s.device_id for s in chosen] == [2]


def test_a_gpu_id_the_machine_lacks_is_refused() -> None:
    with pytest.raises(KilnError) as err:
        instance_specs(config("instance_group [{count: 1 kind: KIND_GPU gpus: [0, 3]}]"), 2)
    assert err.value.status is Status.INVALID_ARG
    message = err.value.message
    assert "instance group m_0 of model m specifies invalid or unsupported gpu id 3" in message
    assert "GPUs 0, 1" in message
