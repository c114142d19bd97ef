#!/usr/bin/env bash
# Debian packages the test suite needs. Installs only what is missing; needs root (or sudo).
set -euo pipefail

packages=()
need() { dpkg -s "$1" >/dev/null 2>&1 || packages+=("$1"); }

# (grows with the features that need real peers: prometheus, chromium, ...)
need prometheus  # tests/integration/test_prometheus.py scrapes kiln with a real server
need chromium    # tests/e2e/test_dashboard.py drives the dashboard in headless Chromium
need curl        # tests/integration/test_grpc_interop.py: an HTTP/2 client (nghttp2) that is not grpcio
need redis-server  # tests/integration/test_redis_cache.py: the shared response cache
need libtcmalloc-minimal4  # vLLM's CPU build wants it in LD_PRELOAD (benchmarks/llm_vllm.py)
# tests/integration/test_grpc_js_interop.py: grpc-js, a gRPC client on Node's HTTP/2
command -v node >/dev/null 2>&1 || need nodejs
command -v npm >/dev/null 2>&1 || need npm

if [[ ${#packages[@]} -eq 0 ]]; then
    exit 0
fi
SUDO=""
[[ $(id -u) -eq 0 ]] || SUDO="sudo"
echo "installing Debian packages: ${packages[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${packages[@]}"
