#!/usr/bin/env bash
# Refresh the console's one third-party asset, uPlot (the charts), from the npm registry: `bash cloud/console/vendor.sh`.
# The files are committed (the hub serves them; nothing is fetched at run time); their SHA-256 are in VENDOR.sha256.
set -euo pipefail
cd "$(dirname "$0")"
VERSION=1.6.32
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "uplot@$VERSION" >/dev/null && tar xzf "uplot-$VERSION.tgz")
cp "$work/package/dist/uPlot.iife.min.js" "$work/package/dist/uPlot.min.css" static/vendor/
cp "$work/package/LICENSE" static/vendor/uPlot.LICENSE
(cd static/vendor && sha256sum uPlot.iife.min.js uPlot.min.css uPlot.LICENSE) > VENDOR.sha256
echo "uPlot $VERSION vendored into static/vendor"
