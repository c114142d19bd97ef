"""The llm backend serves a model from one engine: more instances are refused at load."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import text_format

from kiln.backends.base import instance_specs
from kiln.config.model_config_pb2 import ModelConfig
from kiln.core.errors import KilnError, Status
from kiln.llm.backend import LLMBackend


def test_a_second_instance_is_refused_before_anything_loads(tmp_path: Path) -> None:
    config = text_format.Parse(
        'name: "chat" backend: "llm" instance_group [ { count: 2 kind: KIND_CPU } ]',
        ModelConfig(),
    )
    (spec, _) = instance_specs(config, 0)
    with pytest.raises(KilnError) as info:
        LLMBackend(config, tmp_path, spec)  # no weights there: refused before reading any
    assert info.value.status is Status.INVALID_ARG
    message = info.value.message
    assert "model 'chat': the llm backend runs one engine per model" in message
    assert "asks for 2 instances" in message and "count: 1" in message
