"""Metric family names that more than one module spells, spelled once.

The exporters in this package define families with them; history, the live view, the fleet
and alert snapshots (``kiln.monitoring``) read the same series back by them. The values are
the field's names (Triton's ``nv_*``, dcgm-exporter's ``DCGM_FI_*``, vLLM's ``vllm:*``) and
never change: dashboards, alert rules and recording rules are written against them.
"""

from __future__ import annotations

# Triton's per-model families (collector.py)
CACHE_HIT_DURATION_PER_MODEL = "nv_cache_hit_duration_per_model"
CACHE_MISS_DURATION_PER_MODEL = "nv_cache_miss_duration_per_model"
CACHE_NUM_HITS_PER_MODEL = "nv_cache_num_hits_per_model"
CACHE_NUM_MISSES_PER_MODEL = "nv_cache_num_misses_per_model"
INFERENCE_COMPUTE_INFER_DURATION_US = "nv_inference_compute_infer_duration_us"
INFERENCE_COMPUTE_INPUT_DURATION_US = "nv_inference_compute_input_duration_us"
INFERENCE_COMPUTE_OUTPUT_DURATION_US = "nv_inference_compute_output_duration_us"
INFERENCE_COUNT = "nv_inference_count"
INFERENCE_EXEC_COUNT = "nv_inference_exec_count"
INFERENCE_FIRST_RESPONSE_HISTOGRAM_MS = "nv_inference_first_response_histogram_ms"
INFERENCE_PENDING_REQUEST_COUNT = "nv_inference_pending_request_count"
INFERENCE_QUEUE_DURATION_US = "nv_inference_queue_duration_us"
INFERENCE_REQUEST_DURATION_US = "nv_inference_request_duration_us"
INFERENCE_REQUEST_FAILURE = "nv_inference_request_failure"
INFERENCE_REQUEST_SUCCESS = "nv_inference_request_success"
MODEL_LOAD_DURATION_SECS = "nv_model_load_duration_secs"

# Triton's GPU families (gpu.py)
ENERGY_CONSUMPTION = "nv_energy_consumption"
GPU_MEMORY_TOTAL_BYTES = "nv_gpu_memory_total_bytes"
GPU_MEMORY_USED_BYTES = "nv_gpu_memory_used_bytes"
GPU_POWER_LIMIT = "nv_gpu_power_limit"
GPU_POWER_USAGE = "nv_gpu_power_usage"
GPU_UTILIZATION = "nv_gpu_utilization"

# Triton's host families (host.py) and the process families every Prometheus client exports
CPU_MEMORY_TOTAL_BYTES = "nv_cpu_memory_total_bytes"
CPU_MEMORY_USED_BYTES = "nv_cpu_memory_used_bytes"
CPU_UTILIZATION = "nv_cpu_utilization"
PROCESS_CPU_SECONDS_TOTAL = "process_cpu_seconds_total"
PROCESS_RESIDENT_MEMORY_BYTES = "process_resident_memory_bytes"

# kiln's own families (collector.py, gpu.py, readiness.py)
KILN_BATCH_SIZE = "kiln_batch_size"
KILN_GPU_CLOCK_EVENT_ACTIVE = "kiln_gpu_clock_event_active"
KILN_GPU_PROCESS_MEMORY_USED_BYTES = "kiln_gpu_process_memory_used_bytes"
KILN_GPU_SM_CLOCK_MHZ = "kiln_gpu_sm_clock_mhz"
KILN_GPU_TEMPERATURE_CELSIUS = "kiln_gpu_temperature_celsius"
KILN_MODEL_READY = "kiln_model_ready"
KILN_REQUEST_DURATION_SECONDS = "kiln_request_duration_seconds"

# dcgm-exporter's families (dcgm.py; also what the fleet reads from GPU agents)
DCGM_FI_DEV_CLOCKS_EVENT_REASONS = "DCGM_FI_DEV_CLOCKS_EVENT_REASONS"
DCGM_FI_DEV_CLOCK_THROTTLE_REASONS = "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"
DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS = "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS"
DCGM_FI_DEV_DEC_UTIL = "DCGM_FI_DEV_DEC_UTIL"
DCGM_FI_DEV_ECC_DBE_AGG_TOTAL = "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL"
DCGM_FI_DEV_ECC_DBE_VOL_TOTAL = "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"
DCGM_FI_DEV_ECC_SBE_AGG_TOTAL = "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL"
DCGM_FI_DEV_ECC_SBE_VOL_TOTAL = "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"
DCGM_FI_DEV_ENC_UTIL = "DCGM_FI_DEV_ENC_UTIL"
DCGM_FI_DEV_FB_FREE = "DCGM_FI_DEV_FB_FREE"
DCGM_FI_DEV_FB_TOTAL = "DCGM_FI_DEV_FB_TOTAL"
DCGM_FI_DEV_FB_USED = "DCGM_FI_DEV_FB_USED"
DCGM_FI_DEV_GPU_TEMP = "DCGM_FI_DEV_GPU_TEMP"
DCGM_FI_DEV_GPU_UTIL = "DCGM_FI_DEV_GPU_UTIL"
DCGM_FI_DEV_MEMORY_TEMP = "DCGM_FI_DEV_MEMORY_TEMP"
DCGM_FI_DEV_MEM_CLOCK = "DCGM_FI_DEV_MEM_CLOCK"
DCGM_FI_DEV_MEM_COPY_UTIL = "DCGM_FI_DEV_MEM_COPY_UTIL"
DCGM_FI_DEV_PCIE_REPLAY_COUNTER = "DCGM_FI_DEV_PCIE_REPLAY_COUNTER"
DCGM_FI_DEV_POWER_USAGE = "DCGM_FI_DEV_POWER_USAGE"
DCGM_FI_DEV_RETIRED_DBE = "DCGM_FI_DEV_RETIRED_DBE"
DCGM_FI_DEV_RETIRED_PENDING = "DCGM_FI_DEV_RETIRED_PENDING"
DCGM_FI_DEV_RETIRED_SBE = "DCGM_FI_DEV_RETIRED_SBE"
DCGM_FI_DEV_ROW_REMAP_FAILURE = "DCGM_FI_DEV_ROW_REMAP_FAILURE"
DCGM_FI_DEV_SM_CLOCK = "DCGM_FI_DEV_SM_CLOCK"
DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION = "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"
DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS = "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"
DCGM_FI_DEV_XID_ERRORS = "DCGM_FI_DEV_XID_ERRORS"
DCGM_FI_PROF_NVLINK_RX_BYTES = "DCGM_FI_PROF_NVLINK_RX_BYTES"
DCGM_FI_PROF_NVLINK_TX_BYTES = "DCGM_FI_PROF_NVLINK_TX_BYTES"
DCGM_FI_PROF_PCIE_RX_BYTES = "DCGM_FI_PROF_PCIE_RX_BYTES"
DCGM_FI_PROF_PCIE_TX_BYTES = "DCGM_FI_PROF_PCIE_TX_BYTES"

# vLLM's families: defined by kiln.llm.metrics (below metrics/ in the layers, so spelled
# there as PREFIX + name), read back here by history, alerts and the live view
VLLM_GENERATION_TOKENS_TOTAL = "vllm:generation_tokens_total"
VLLM_INTER_TOKEN_LATENCY_SECONDS = "vllm:inter_token_latency_seconds"
VLLM_KV_CACHE_USAGE_PERC = "vllm:kv_cache_usage_perc"
VLLM_NUM_PREEMPTIONS_TOTAL = "vllm:num_preemptions_total"
VLLM_NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
VLLM_NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"
VLLM_PREFIX_CACHE_HITS_TOTAL = "vllm:prefix_cache_hits_total"
VLLM_PREFIX_CACHE_QUERIES_TOTAL = "vllm:prefix_cache_queries_total"
VLLM_PROMPT_TOKENS_TOTAL = "vllm:prompt_tokens_total"
VLLM_TIME_TO_FIRST_TOKEN_SECONDS = "vllm:time_to_first_token_seconds"
