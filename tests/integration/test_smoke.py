"""The shared server fixture starts kiln and serves the example models to tritonclient."""

from __future__ import annotations

import numpy as np
import tritonclient.http as httpclient

from tests.conftest import KilnProcess


def test_server_live_ready_and_infers_simple(kiln_server: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(kiln_server.http_url)
    assert client.is_server_live()
    assert client.is_server_ready()
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 3, dtype=np.int32)
    inputs = [
        httpclient.InferInput("INPUT0", [1, 16], "INT32"),
        httpclient.InferInput("INPUT1", [1, 16], "INT32"),
    ]
    inputs[0].set_data_from_numpy(a, binary_data=False)
    inputs[1].set_data_from_numpy(b, binary_data=False)
    result = client.infer("simple", inputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
