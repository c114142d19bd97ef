#!/usr/bin/env bash
# Vendor the dashboard's charting library (uPlot, MIT) from the npm registry into
# static/vendor/. The result is committed: a checkout serves the page without npm or
# network. Re-run only to change UPLOT_VERSION.
set -euo pipefail

UPLOT_VERSION=1.6.32
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
vendor="$here/static/vendor"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

cd "$work"
npm init -y >/dev/null
npm install --no-audit --no-fund --ignore-scripts --save-exact "uplot@$UPLOT_VERSION" >/dev/null
pkg="$work/node_modules/uplot"
mkdir -p "$vendor"
cp "$pkg/dist/uPlot.iife.min.js" "$vendor/uPlot.iife.min.js"
cp "$pkg/dist/uPlot.min.css" "$vendor/uPlot.min.css"
cp "$pkg/LICENSE" "$vendor/uPlot.LICENSE"
echo "uplot@$UPLOT_VERSION" >"$vendor/VERSION"
echo "vendored uplot@$UPLOT_VERSION into $vendor"
