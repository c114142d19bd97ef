#!/bin/sh
# Installs kiln into a virtual environment: the one install step of both images
# (Dockerfile, Dockerfile.cuda), and what tests/integration/test_deploy_docker.py runs in
# CI, so the image's install is exercised on every run even without a Docker engine.
#
#   install.sh VENV PACKAGE [EXTRA_PACKAGE...]
#
# VENV     folder for the virtual environment (created; /opt/kiln in the images)
# PACKAGE  what pip installs: a wheel file, optionally with extras ('kiln.whl[gpu]')
# Extra packages (e.g. tensorrt) are installed in the same pip call so the resolver sees
# every constraint at once. KILN_PIP_ARGS adds pip flags (the test uses --no-deps).
set -eu

if [ "$#" -lt 2 ]; then
    echo "usage: install.sh VENV PACKAGE [EXTRA_PACKAGE...]" >&2
    exit 2
fi
venv="$1"
shift

python3 -m venv "$venv"
# shellcheck disable=SC2086  # KILN_PIP_ARGS is a list of flags, split on purpose
"$venv/bin/pip" install --no-cache-dir --disable-pip-version-check ${KILN_PIP_ARGS:-} "$@"
# Fail the build here, not at the first container start, if the entry point is broken.
"$venv/bin/kiln" --version
