#!/usr/bin/env bash
# The GPU checks of issue 27 in one command, for one device call of at most 10 minutes
# (about 7-8 expected on an H100; each part has its own timeout so the rest still runs):
#   1. the environment: GPU, driver, torch, triton;
#   2. pytest -m gpu: the Triton kernels and the engine on CUDA (tests/gpu/test_llm_triton_gpu.py,
#      tests/gpu/test_llm_gpu.py): greedy tokens equal to transformers, kernels on vs off;
#   3. benchmarks/llm_gpu.py: batch-1 decode of the 1.1B bf16 Llama as a % of the
#      memory-bandwidth bound, c=64 output tok/s in-process and over the OpenAI API, kernels
#      on (triton) vs off (flex), and a torch.profiler summary of batch-1 decode steps.
# Everything benchmarks/README.md needs is printed and written under $OUT (env.txt,
# pytest_gpu.log, llm_gpu.log, llm_gpu.json, decode_trace.json).
#
# Here, first: scripts/gpu_wheels.sh (kiln's wheels the GPU image lacks, into .whl/). Then the
# device call, from the repository root, carrying .whl:
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=600)
set -uo pipefail
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SITE=""
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  SITE=/tmp/site:
fi
export PYTHONPATH="${SITE}$PWD/src:$PWD" PYTHONUNBUFFERED=1
stamp() { echo "[$(date +%H:%M:%S)] $*"; }

stamp "1. environment" | tee "$OUT/env.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 \
  | tee -a "$OUT/env.txt"
"$PY" - <<'PYEOF' 2>&1 | tee -a "$OUT/env.txt"
import importlib, platform
import torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name() if torch.cuda.is_available() else None)
missing = []
for name in ("triton", "transformers", "tokenizers", "safetensors", "starlette", "uvicorn",
             "httptools", "orjson", "httpx", "kiln.cli.serve", "kiln.llm.engine",
             "kiln.bench.openai_console", "tests.conftest"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "ok"))
    except Exception as e:  # a missing wheel: name it for scripts/gpu_wheels.sh
        missing.append(f"{name} ({type(e).__name__}: {e})")
print("MISSING:", "; ".join(missing) if missing else "none")
PYEOF

stamp "2. pytest -m gpu" | tee "$OUT/pytest_gpu.log"
timeout 240 "$PY" -m pytest -m gpu tests/gpu/test_llm_triton_gpu.py tests/gpu/test_llm_gpu.py \
  -v -s -p no:cacheprovider 2>&1 | tee -a "$OUT/pytest_gpu.log"
stamp "pytest exit ${PIPESTATUS[0]}" | tee -a "$OUT/pytest_gpu.log"

stamp "3. benchmarks/llm_gpu.py" | tee "$OUT/llm_gpu.log"
timeout 300 "$PY" benchmarks/llm_gpu.py --skip-transformers --json "$OUT/llm_gpu.json" \
  --trace "$OUT/decode_trace.json" 2>&1 | tee -a "$OUT/llm_gpu.log"
stamp "benchmark exit ${PIPESTATUS[0]}" | tee -a "$OUT/llm_gpu.log"
