#!/usr/bin/env bash
# Create the peer servers' virtualenvs for benchmarks/serving_peers.py (idempotent).
#
#   .bench/pytriton  nvidia-pytriton 0.7.0 (ships a real `tritonserver` 2.51 with the python
#                    backend), numpy<2 (pytriton needs it), onnxruntime for the model.py files.
#   .bench/mlserver  Seldon MLServer 1.7.1 + onnxruntime; uvloop<0.22 because with >=0.22 its
#                    workers die with "no current event loop".
#
# Each peer has its own venv: their pins (numpy<2 vs numpy 2 / pandas 3) conflict with each
# other and with kiln's. Set PYTRITON_WHEEL to a local nvidia-pytriton wheel to skip the
# ~55 MB download. Usage: bash benchmarks/setup_peers.sh [pytriton|mlserver ...]
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BENCH="$ROOT/.bench"
PYTHON="${PYTHON:-python3}"
mkdir -p "$BENCH"

make_venv() {  # name, then pip requirements
    local name="$1"
    shift
    local venv="$BENCH/$name"
    if [[ -f "$venv/.complete" ]]; then
        echo "$name: $venv already set up"
        return
    fi
    echo "$name: creating $venv"
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv"
    "$venv/bin/pip" install --quiet --upgrade pip
    "$venv/bin/pip" install --quiet "$@"
    touch "$venv/.complete"  # only a fully installed venv counts as set up
}

setup_pytriton() {
    local wheel="nvidia-pytriton==0.7.0"
    if [[ -n "${PYTRITON_WHEEL:-}" && -f "${PYTRITON_WHEEL}" ]]; then
        wheel="$PYTRITON_WHEEL"
    fi
    make_venv pytriton "$wheel" "numpy<2" onnxruntime
}

setup_mlserver() {
    make_venv mlserver "mlserver==1.7.1" "uvloop<0.22" onnxruntime
}

peers=("$@")
if [[ ${#peers[@]} -eq 0 ]]; then
    peers=(pytriton mlserver)
fi
for peer in "${peers[@]}"; do
    case "$peer" in
        pytriton) setup_pytriton ;;
        mlserver) setup_mlserver ;;
        *) echo "unknown peer: $peer (expected pytriton or mlserver)" >&2; exit 2 ;;
    esac
done
