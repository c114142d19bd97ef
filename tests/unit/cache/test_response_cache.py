"""The response cache's LRU, byte budget, keys and --cache-config parsing."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kiln.cache.config import CacheConfig, CacheConfigError
from kiln.cache.keys import request_key
from kiln.cache.local import ResponseCache
from kiln.core.types import DataType, InferenceRequest, InferInput, InferOutput, RequestedOutput


def out(n_floats: int, value: float = 1.0, name: str = "OUT") -> InferOutput:
    data = np.full((n_floats,), value, np.float32)
    return InferOutput(name, DataType.FP32, data.shape, data)


def req(data: np.ndarray, name: str = "IN", datatype: DataType = DataType.FP32) -> InferenceRequest:
    return InferenceRequest("m", inputs=[InferInput(name, datatype, data.shape, data)])


def test_lru_evicts_least_recently_used_by_bytes() -> None:
    cache = ResponseCache(capacity=3 * 400)  # three 100-float entries fit
    for key in (b"a", b"b", b"c"):
        assert cache.insert(key, [out(100)])
    assert cache.nbytes == 1200 and len(cache) == 3
    assert cache.lookup(b"a") is not None  # "a" is now the most recently used
    assert cache.insert(b"d", [out(100)])
    assert b"b" not in cache and all(k in cache for k in (b"a", b"c", b"d"))
    # One big entry pushes out as many old ones as it needs, oldest first.
    assert cache.insert(b"e", [out(200)])
    assert [k in cache for k in (b"a", b"c", b"d", b"e")] == [False, False, True, True]
    assert cache.nbytes == 1200


def test_entry_larger_than_the_budget_is_not_cached_and_evicts_nothing() -> None:
    cache = ResponseCache(capacity=1000)
    assert cache.insert(b"small", [out(10)])
    assert not cache.insert(b"huge", [out(100), out(200, name="OUT2")])
    assert b"huge" not in cache and b"small" in cache and cache.nbytes == 40
    assert not ResponseCache(capacity=0).insert(b"x", [out(1)])


def test_bytes_outputs_count_their_payload() -> None:
    cache = ResponseCache(capacity=10_000)
    data = np.array([b"x" * 1000, b"y" * 500], dtype=object)
    cache.insert(b"k", [InferOutput("S", DataType.BYTES, (2,), data)])
    assert cache.nbytes >= 1500


def test_cached_outputs_are_private_read_only_copies() -> None:
    cache = ResponseCache(capacity=10_000)
    batch = np.arange(8, dtype=np.float32)
    view = batch[2:4]  # like a batched output split back to one request
    cache.insert(b"k", [InferOutput("OUT", DataType.FP32, (2,), view)])
    assert cache.nbytes == 8  # only the request's part, not the whole batch
    batch[:] = -1
    hit = cache.lookup(b"k")
    assert hit is not None
    np.testing.assert_array_equal(hit[0].data, [2, 3])
    with pytest.raises(ValueError):
        hit[0].data[0] = 7
    hit[0].parameters["x"] = 1  # a caller's changes stay out of the entry
    again = cache.lookup(b"k")
    assert again is not None and again[0].parameters == {}


def test_an_entry_keeps_the_response_parameters_as_private_copies() -> None:
    cache = ResponseCache(capacity=1000)
    given = {"calls": 1, "label": "first"}
    assert cache.insert(b"k", [out(4)], owner=1, parameters=given)
    given["calls"] = 99  # the caller's dict changing later does not reach the entry
    found = cache.lookup_response(b"k")
    assert found is not None
    outputs, parameters = found
    assert parameters == {"calls": 1, "label": "first"}
    parameters["calls"] = 7  # nor does a reader's change reach the next reader
    again = cache.lookup_response(b"k")
    assert again is not None and again[1] == {"calls": 1, "label": "first"}
    assert outputs[0].data.tolist() == [1.0] * 4
    assert cache.insert(b"plain", [out(4)])  # a response without parameters
    plain = cache.lookup_response(b"plain")
    assert plain is not None and plain[1] == {}


def test_drop_owner_forgets_one_loaded_version() -> None:
    cache = ResponseCache(capacity=10_000)
    cache.insert(b"a", [out(10)], owner=1)
    cache.insert(b"b", [out(10)], owner=2)
    assert cache.drop_owner(1) == 1
    assert b"a" not in cache and b"b" in cache and cache.nbytes == 40


def test_concurrent_inserts_and_lookups_keep_the_budget() -> None:
    cache = ResponseCache(capacity=50 * 40)

    def work(t: int) -> None:
        for i in range(300):
            key = f"{t}-{i % 70}".encode()
            if cache.lookup(key) is None:
                cache.insert(key, [out(10, float(i))])

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert cache.nbytes == 40 * len(cache) <= cache.capacity


def test_key_depends_on_every_part_of_the_question() -> None:
    data = np.arange(4, dtype=np.float32).reshape(1, 4)
    base = request_key("m", "1", req(data), ["OUT"])
    assert base == request_key("m", "1", req(data.copy()), ["OUT"])
    changed_bytes = data.copy()
    changed_bytes[0, 3] = 9
    variants = [
        request_key("other", "1", req(data), ["OUT"]),
        request_key("m", "2", req(data), ["OUT"]),
        request_key("m", "1", req(data), ["OUT"], owner=7),
        request_key("m", "1", req(data, name="IN2"), ["OUT"]),
        request_key("m", "1", req(data.view(np.int32), datatype=DataType.INT32), ["OUT"]),
        request_key("m", "1", req(data.reshape(2, 2)), ["OUT"]),
        request_key("m", "1", req(changed_bytes), ["OUT"]),
        request_key("m", "1", req(data), ["OUT", "OUT2"]),
        request_key("m", "1", req(data), ["OUT2"]),
    ]
    with_param = req(data)
    with_param.outputs = [RequestedOutput("OUT", {"classification": 2})]
    variants.append(request_key("m", "1", with_param, ["OUT"]))
    assert len({base, *variants}) == len(variants) + 1


def test_key_ignores_input_order_and_transport_parameters() -> None:
    a = InferInput("A", DataType.INT32, (2,), np.array([1, 2], np.int32))
    b = InferInput("B", DataType.BYTES, (1,), np.array([b"hi"], dtype=object))
    one = InferenceRequest("m", inputs=[a, b], outputs=[RequestedOutput("O", {})])
    two = InferenceRequest(
        "m", inputs=[b, a], outputs=[RequestedOutput("O", {"binary_data": True})]
    )
    assert request_key("m", "1", one, ["O"]) == request_key("m", "1", two, ["O"])
    three = InferenceRequest(
        "m", inputs=[a, InferInput("B", DataType.BYTES, (1,), np.array([b"ho"], dtype=object))]
    )
    assert request_key("m", "1", one, ["O"]) != request_key("m", "1", three, ["O"])


def test_bytes_elements_are_length_delimited() -> None:
    def key(*items: bytes) -> bytes:
        data = np.array(list(items), dtype=object)
        return request_key("m", "1", req(data, datatype=DataType.BYTES), ["O"])

    assert key(b"ab", b"c") != key(b"a", b"bc")


@pytest.mark.parametrize(
    ("flags", "size"),
    [([], None), (["local,size=1048576"], 1048576), (["local,size=0"], 0)],
)
def test_cache_config_parses_tritons_spelling(flags: list[str], size: int | None) -> None:
    parsed = CacheConfig.parse(flags)
    assert (parsed.size if parsed else None) == size


@pytest.mark.parametrize(
    ("flag", "words"),
    [
        ("memcached,host=localhost", "cache 'memcached' is not supported"),
        ("local", "expected <cache>,<key>=<value>"),
        ("local,size=lots", "must be an integer number of bytes, got 'lots'"),
        ("local,size=-5", "must be >= 0 bytes"),
        ("local,sise=10", "unknown local cache setting(s) sise"),
    ],
)
def test_cache_config_errors_name_the_problem(flag: str, words: str) -> None:
    with pytest.raises(CacheConfigError) as err:
        CacheConfig.parse([flag])
    assert words in str(err.value)
