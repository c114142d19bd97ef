"""How much per-element Python work the event loop does itself: thresholds shared by the
frontends (request and response encodings) and the backends (the Python backend's
shared-memory hand-off), which may not import each other.

A tensor whose elements each cost Python work (JSON values, BYTES elements) is encoded on
a worker thread above ``OFF_LOOP_ENCODE_ELEMENTS`` elements, and there ``ENCODE_SLICE``
elements at a time: a single C call (``orjson``, ``bytes.join``, ``np.array`` over a
list) holds the GIL for its whole length, so between slices the interpreter can hand it
back to the loop (every ``sys.getswitchinterval()``).
"""

from __future__ import annotations

#: a tensor (or a batch's tensors) with more elements than this that cost Python work each
#: is encoded or decoded on a worker thread. Measured: FP32 encodes to JSON at ~16 ns an
#: element and a thread hop costs 50-100 us, so at 16 Ki elements (~170 KB of JSON) the
#: hop adds ~20% to a 0.26 ms encode; below it the hop would dominate. BYTES elements cost
#: ~0.25-0.6 us each (16 M empty ones held the loop 3.9 s in a gRPC response, ~6 s each
#: way through a Python-backend model's shared memory).
OFF_LOOP_ENCODE_ELEMENTS = 1 << 14
#: elements one C call handles on such a thread (~3 ms of FP32 to JSON, ~10 ms of BYTES
#: elements in a Python loop, which itself lets the loop in every switch interval)
ENCODE_SLICE = 1 << 15
