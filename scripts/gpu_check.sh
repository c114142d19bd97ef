#!/usr/bin/env bash
# The GPU checks in one command, for one device call of at most 10 minutes; each part has its
# own time limit inside a 570 s budget, so a hang in one still leaves the rest their turn:
#   1. the environment: GPU, driver, torch, triton, and every module kiln's GPU paths import;
#   2. the LLM tests of pytest -m gpu (tests/gpu/test_llm_triton_gpu.py, test_llm_gpu.py):
#      greedy tokens equal to transformers, kiln's Triton kernels on vs off;
#   3. benchmarks/llm_gpu.py (issue 27): batch-1 decode of the 1.1B bf16 Llama as a % of the
#      memory-bandwidth bound, c=64 output tok/s in-process and over the OpenAI API, kernels
#      on (triton) vs off (flex), a torch.profiler summary of batch-1 decode steps;
#   4. the rest of pytest -m gpu (NVML's real path, the Python/PyTorch backends on CUDA,
#      optimize, LoRA, quantization, tensor parallel, ONNX Runtime's and TensorRT's GPU paths).
# Everything benchmarks/README.md needs is written under $OUT (env.txt, pytest_gpu.log,
# llm_gpu.log, llm_gpu.json, decode_trace.json, pytest_gpu_rest.log).
#
# Here, first: scripts/gpu_wheels.sh (kiln's wheels the GPU image lacks, into .whl/). Then the
# device call, from the repository root, carrying .whl:
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=600)
set -uo pipefail
OUT=${OUT:-gpu-check-out}
BUDGET=${BUDGET:-570}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SITE=""
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  SITE=/tmp/site:
fi
export PYTHONPATH="${SITE}$PWD/src:$PWD" PYTHONUNBUFFERED=1
stamp() { echo "[$(date +%H:%M:%S) +${SECONDS}s] $*"; }
left() {  # seconds for the next part: at most $1, never past the budget
  local rest=$((BUDGET - SECONDS))
  ((rest < $1)) && echo $((rest > 5 ? rest : 5)) || echo "$1"
}

stamp "1. environment" | tee "$OUT/env.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 \
  | tee -a "$OUT/env.txt"
"$PY" - <<'PYEOF' 2>&1 | tee -a "$OUT/env.txt"
import importlib, platform
import torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name() if torch.cuda.is_available() else None)
missing = []
for name in ("triton", "transformers", "tokenizers", "safetensors", "numba", "google.protobuf",
             "grpc", "onnx", "starlette", "uvicorn", "httptools", "orjson", "httpx", "msgspec",
             "llguidance", "jsonschema", "gguf", "pynvml", "kiln.cli.serve", "kiln.llm.engine",
             "kiln.llm.engine_proc", "kiln.llm.structured", "kiln.frontends.openai.routes",
             "kiln.bench.openai_console", "tests.conftest"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "ok"))
    except Exception as e:  # a missing wheel: name it for scripts/gpu_wheels.sh
        missing.append(f"{name} ({type(e).__name__}: {e})")
print("MISSING:", "; ".join(missing) if missing else "none")
PYEOF

stamp "2. pytest -m gpu, the LLM tests" | tee "$OUT/pytest_gpu.log"
timeout "$(left 170)" "$PY" -m pytest -m gpu tests/gpu/test_llm_triton_gpu.py \
  tests/gpu/test_llm_gpu.py -v -s -p no:cacheprovider 2>&1 | tee -a "$OUT/pytest_gpu.log"
stamp "pytest exit ${PIPESTATUS[0]}" | tee -a "$OUT/pytest_gpu.log"

stamp "3. benchmarks/llm_gpu.py" | tee "$OUT/llm_gpu.log"
timeout "$(left 280)" "$PY" benchmarks/llm_gpu.py --skip-transformers --json "$OUT/llm_gpu.json" \
  --trace "$OUT/decode_trace.json" 2>&1 | tee -a "$OUT/llm_gpu.log"
stamp "benchmark exit ${PIPESTATUS[0]}" | tee -a "$OUT/llm_gpu.log"

stamp "4. pytest -m gpu, the rest" | tee "$OUT/pytest_gpu_rest.log"
timeout "$(left 600)" "$PY" -m pytest -m gpu tests/gpu -v -p no:cacheprovider --timeout 120 \
  --ignore tests/gpu/test_llm_triton_gpu.py --ignore tests/gpu/test_llm_gpu.py \
  2>&1 | tee -a "$OUT/pytest_gpu_rest.log"
stamp "pytest exit ${PIPESTATUS[0]}" | tee -a "$OUT/pytest_gpu_rest.log"
