"""``kiln bench``: a perf_analyzer-style load generator for any KServe v2 server.

From Python::

    from kiln.bench import run
    result = run(model="mlp", url="localhost:8000", concurrency=[1, 2, 4])
    for level in result.levels:
        print(level.concurrency, level.throughput, level.latency_us["p99"])
"""

from kiln.bench.options import BenchError, BenchOptions, Distribution, Protocol, parse_range
from kiln.bench.runner import BenchResult, run, run_async
from kiln.bench.stats import LevelResult

__all__ = [
    "BenchError",
    "BenchOptions",
    "BenchResult",
    "Distribution",
    "LevelResult",
    "Protocol",
    "parse_range",
    "run",
    "run_async",
]
