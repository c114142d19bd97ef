"""The config as JSON: what GET .../config serves and what the load API's override reads."""

from __future__ import annotations

import json

import pytest

from kiln.config.loader import ConfigError, config_from_json, config_to_json, parse_config_text

TEXT = """\
name: "m"
max_batch_size: 8
input [ { name: "a" data_type: TYPE_FP32 dims: [ -1, 3 ] } ]
output [ { name: "b" data_type: TYPE_STRING dims: [ 1 ] } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
dynamic_batching {
  preferred_batch_size: [ 2, 4 ]
  max_queue_delay_microseconds: 500
  priority_levels: 3
  default_priority_level: 1
  priority_queue_policy { key: 2 value: { max_queue_size: 7 } }
}
version_policy { specific { versions: [ 1, 3 ] } }
parameters { key: "k" value: { string_value: "v" } }
"""


def test_int64_fields_are_json_numbers_and_enums_strings() -> None:
    data = config_to_json(parse_config_text(TEXT))
    assert data["max_batch_size"] == 8
    assert data["input"][0]["dims"] == [-1, 3]  # int64 repeated
    assert data["input"][0]["data_type"] == "TYPE_FP32"
    assert data["output"][0]["data_type"] == "TYPE_STRING"
    assert data["instance_group"][0]["kind"] == "KIND_CPU"
    db = data["dynamic_batching"]
    assert db["preferred_batch_size"] == [2, 4]
    assert db["max_queue_delay_microseconds"] == 500  # uint64
    assert db["priority_levels"] == 3
    # map<uint64, ModelQueuePolicy>: the key stays a JSON key, the nested int64 a number
    assert list(db["priority_queue_policy"]) == ["2"]
    assert db["priority_queue_policy"]["2"]["max_queue_size"] == 7
    assert data["version_policy"]["specific"]["versions"] == [1, 3]
    assert data["parameters"] == {"k": {"string_value": "v"}}
    # field names as written in config.pbtxt, defaults printed
    assert data["input"][0]["allow_ragged_batch"] is False
    assert data["platform"] == ""


def test_json_round_trip() -> None:
    cfg = parse_config_text(TEXT)
    text = json.dumps(config_to_json(cfg))
    assert config_from_json(text) == cfg
    assert config_from_json(text.encode()) == cfg
    assert config_from_json(json.loads(text)) == cfg


@pytest.mark.parametrize(
    ("data", "field", "words"),
    [
        ('{"max_batch_sise": 1}', "max_batch_sise", 'did you mean "max_batch_size"'),
        ('{"input": [{"name": "a", "data_type": "TYPE_X"}]}', "data_type", "TYPE_X"),
        ('{"max_batch_size": "abc"}', "max_batch_size", "abc"),
        ("[1]", None, "JSON object"),
        ("{bad", None, "invalid JSON"),
    ],
)
def test_bad_json_config(data: str, field: str | None, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_json(data)
    assert info.value.field == field
    assert words in str(info.value)
    assert str(info.value).startswith("<config override>")
