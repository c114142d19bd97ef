"""The redis cache's parts that need no Redis: its ``--cache-config`` settings, the record
it stores (and refuses when it is not its own) and the model fingerprint its keys use."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kiln.cache.config import CacheConfig, CacheConfigError, RedisSettings
from kiln.cache.keys import model_fingerprint
from kiln.cache.redis import MAGIC, decode, encode
from kiln.config.loader import parse_config_text
from kiln.core.types import DataType, InferOutput


def test_tritons_redis_flags_parse_into_settings() -> None:
    parsed = CacheConfig.parse(
        [
            "redis,host=cache.internal",
            "redis,port=6380",
            "redis,user=kiln",
            "redis,password=s3",
            "redis,db=2",
            "redis,connect_timeout=500",
            "redis,socket_timeout=250",
            "redis,pool_size=8",
            "redis,wait_timeout=50",
        ]
    )
    assert parsed == CacheConfig(
        redis=RedisSettings("cache.internal", 6380, "kiln", "s3", 2, 500, 250, 8, 50)
    )
    minimal = CacheConfig.parse(["redis,host=localhost", "redis,port=6379"])
    assert minimal is not None and minimal.redis == RedisSettings("localhost", 6379)
    assert minimal.redis.address == "localhost:6379"


def test_tls_settings_and_credentials_from_triton_s_environment_variables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("a CA (read when the connection is made)")
    monkeypatch.setenv("TRITONCACHE_REDIS_USERNAME", "from-env")
    monkeypatch.setenv("TRITONCACHE_REDIS_PASSWORD", "env-secret")
    parsed = CacheConfig.parse(
        ["redis,host=h", "redis,port=6379", "redis,tls_enabled=true", f"redis,cacert={ca}",
         "redis,sni=redis.internal"]
    )  # fmt: skip
    assert parsed is not None and parsed.redis is not None
    redis = parsed.redis
    assert (redis.tls, redis.cacert, redis.sni) == (True, str(ca), "redis.internal")
    assert (redis.user, redis.password) == ("from-env", "env-secret")
    # a setting overrides the environment, as in Triton
    overridden = CacheConfig.parse(["redis,host=h", "redis,port=1", "redis,password=flag"])
    assert overridden is not None and overridden.redis is not None
    assert (overridden.redis.user, overridden.redis.password) == ("from-env", "flag")
    assert not overridden.redis.tls


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["redis,host=h"], "the redis cache needs a port"),
        (["redis,port=1"], "the redis cache needs a host"),
        (["redis,host=h", "redis,port=0"], "port must be 1..65535, got 0"),
        (["redis,host=h", "redis,port=1", "redis,pool_size=0"], "pool_size must be >= 1"),
        (["redis,host=h", "redis,port=1", "redis,db=x"], "db must be an integer, got 'x'"),
        (["redis,host=h", "redis,port=1", "redis,tls=1"], "unknown redis cache setting(s) tls"),
        (["redis,host=h", "redis,port=1", "redis,tls_enabled=1"], "tls_enabled must be true or"),
        (["redis,host=h", "redis,port=1", "redis,sni=x"], "sni need tls_enabled=true"),
        (
            ["redis,host=h", "redis,port=1", "redis,tls_enabled=true", "redis,cacert_dir=/no/dir"],
            "cacert_dir: no folder '/no/dir'",
        ),
        (["redis,host=h", "local,size=10"], "names both the local and the redis cache"),
    ],
)
def test_bad_redis_flags_name_the_setting(flags: list[str], words: str) -> None:
    with pytest.raises(CacheConfigError) as err:
        CacheConfig.parse(flags)
    assert words in str(err.value)


def _outputs() -> list[InferOutput]:
    floats = np.arange(6, dtype=np.float32).reshape(2, 3)
    words = np.array([[b"a", b""], [b"\x00\xff", "caf\u00e9".encode()]], dtype=object)
    flags = np.array([True, False])
    return [
        InferOutput("F", DataType.FP32, floats.shape, floats),
        InferOutput("S", DataType.BYTES, words.shape, words),
        InferOutput("B", DataType.BOOL, flags.shape, flags),
        InferOutput("E", DataType.INT64, (0, 4), np.zeros((0, 4), np.int64)),
    ]


def test_a_record_round_trips_every_output_and_the_parameters() -> None:
    outputs, parameters = decode(encode(_outputs(), {"calls": 3, "tag": "x"}))
    assert parameters == {"calls": 3, "tag": "x"}
    for got, want in zip(outputs, _outputs(), strict=True):
        assert (got.name, got.datatype, got.shape) == (want.name, want.datatype, want.shape)
        assert got.data.dtype == want.data.dtype
        np.testing.assert_array_equal(got.data, want.data)
        assert not got.data.flags.writeable  # shared by nobody, still read-only like local


@pytest.mark.parametrize(
    "mangle",
    [
        lambda raw: b"\x80\x04pickle",  # someone else's value
        lambda raw: raw[:-1],  # truncated
        lambda raw: raw + b"x",  # trailing bytes
        lambda raw: MAGIC + b"\xff\xff\x00\x00{",  # header length past the end
        lambda raw: raw.replace(b'"FP32"', b'"FP99"'),  # unknown datatype
        lambda raw: raw.replace(b"[2, 3]", b"[2, 4]"),  # shape does not match the bytes
    ],
)
def test_a_record_that_is_not_kiln_s_is_refused(mangle: object) -> None:
    raw = encode(_outputs(), None)
    with pytest.raises(ValueError):
        decode(mangle(raw))  # type: ignore[operator]


CONFIG = """
name: "m"
backend: "python"
max_batch_size: 4
input [ { name: "X" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 2 ] } ]
"""


def test_the_fingerprint_follows_what_the_model_answers_not_how_it_runs(tmp_path: Path) -> None:
    version = tmp_path / "m" / "1"
    version.mkdir(parents=True)
    (version / "model.py").write_text("Y = X + 1\n")
    base = model_fingerprint(parse_config_text(CONFIG), version)
    # the same on another server: same files, same config, run differently
    elsewhere = tmp_path / "other" / "m" / "1"
    elsewhere.mkdir(parents=True)
    (elsewhere / "model.py").write_text("Y = X + 1\n")
    (elsewhere / "__pycache__").mkdir()
    (elsewhere / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"compiled here")
    run_differently = parse_config_text(
        CONFIG + "instance_group [ { count: 3 } ]\ndynamic_batching { }\n"
        "response_cache { enable: true }\n"
    )
    assert model_fingerprint(run_differently, elsewhere) == base
    # a changed file, a new file or a changed signature is another model
    (version / "model.py").write_text("Y = X + 2\n")
    assert model_fingerprint(parse_config_text(CONFIG), version) != base
    (version / "model.py").write_text("Y = X + 1\n")
    (version / "weights.bin").write_bytes(b"\x00")
    assert model_fingerprint(parse_config_text(CONFIG), version) != base
    (version / "weights.bin").unlink()
    assert model_fingerprint(parse_config_text(CONFIG.replace("[ 2 ]", "[ 3 ]")), version) != base
    assert model_fingerprint(parse_config_text(CONFIG), version) == base
