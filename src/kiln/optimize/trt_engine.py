"""TensorRT engines for kiln optimize: strongly typed networks built from ONNX models.

Precision comes from the graph, not from builder flags: FP32 from the input model, FP16 from
the float16-converted model (float32 I/O kept), INT8 from the calibrated QDQ model. That is
TensorRT >= 10's strongly typed path, and the only one TensorRT 11 keeps (it removed the
INT8/FP16 builder flags and the calibrators). The optimization profile spans ``--batch-sizes``
(min, the middle one as opt, max); a timing cache file shared by all builds of one run saves
re-timing the same layers.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from kiln.optimize.data import Batch
from kiln.optimize.types import Candidate

PLAN = "model.plan"


def profile_shapes(
    batch_sizes: list[int], sample_shape: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(min, opt, max) shapes of one input whose per-sample shape is ``sample_shape``."""
    sizes = sorted(set(batch_sizes))
    low, opt, high = sizes[0], sizes[len(sizes) // 2], sizes[-1]
    return (low, *sample_shape), (opt, *sample_shape), (high, *sample_shape)


def _logger(trt: Any) -> Any:
    class Collect(trt.ILogger):  # type: ignore[misc]
        """Keeps TensorRT's errors so a failed build can quote them."""

        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity: Any, msg: str) -> None:
            if severity <= trt.ILogger.Severity.ERROR:
                self.errors.append(msg)

    return Collect()


def build_engine(
    onnx_path: Path, out_dir: Path, batch_sizes: list[int], sample: Batch, timing_cache: Path
) -> Path:
    """Serialize an engine for ``onnx_path`` into ``out_dir/1/model.plan``; returns its path."""
    import tensorrt as trt

    logger = _logger(trt)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(onnx_path.read_bytes()):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise RuntimeError(f"TensorRT's ONNX parser rejected {onnx_path.name}: {'; '.join(errors)}")
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        low, opt, high = profile_shapes(batch_sizes, tuple(sample[tensor.name].shape[1:]))
        profile.set_shape(tensor.name, low, opt, high)
    config.add_optimization_profile(profile)
    cache = config.create_timing_cache(timing_cache.read_bytes() if timing_cache.exists() else b"")
    config.set_timing_cache(cache, False)  # ignore_mismatch=False: a foreign cache is not used
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError(
            "TensorRT could not build the engine: " + ("; ".join(logger.errors) or "no reason")
        )
    timing_cache.write_bytes(bytes(config.get_timing_cache().serialize()))
    path = out_dir / "1" / PLAN
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(plan))
    return path


def build_candidate(
    base: Candidate,
    onnx_path: Path,
    workdir: Path,
    batch_sizes: list[int],
    sample: Batch,
) -> Candidate:
    """``base`` (a tensorrt-* GPU candidate) with its engine built from ``onnx_path``."""
    start = time.perf_counter()
    base.path = build_engine(
        onnx_path, workdir / base.name, batch_sizes, sample, workdir / "tensorrt.timing-cache"
    )
    base.built_from = onnx_path
    base.build_seconds = time.perf_counter() - start
    return base


class EngineRunner:
    """Runs an engine through kiln's own TensorRT backend, as ``kiln serve`` will.

    ``run`` has ``InferenceSession.run``'s shape so the accuracy guard and the profiler treat
    engines and ONNX Runtime sessions alike.
    """

    def __init__(self, plan: Path, max_batch_size: int) -> None:
        from kiln.backends.base import InstanceSpec
        from kiln.backends.tensorrt import TensorRTBackend
        from kiln.config.loader import parse_config_text

        version_dir = plan.parent
        config = parse_config_text(
            f'name: "{version_dir.parent.name}"\nplatform: "tensorrt_plan"\n'
            f"max_batch_size: {max_batch_size}\n"
        )
        TensorRTBackend.auto_complete_config(config, version_dir)
        self._backend = TensorRTBackend(
            config, version_dir, InstanceSpec("optimize", "gpu", 0, 0, 1)
        )
        self._outputs = [o.name for o in config.output]

    def run(self, names: list[str] | None, feed: Batch) -> list[Any]:
        wanted = names or self._outputs
        results = self._backend.execute(dict(feed), wanted)
        return [results[n] for n in wanted]

    def close(self) -> None:
        self._backend.close()
