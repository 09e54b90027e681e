#!/usr/bin/env bash
# A wheel that installs without a compiler: the compiled loops built here (PyPA's build, in an isolated
# environment), then repaired by auditwheel into a manylinux wheel (tagged with the oldest glibc whose
# symbols they use). The wheel goes to dist/ (or the folder given); install it with pip, pipx or uv.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-dist}")
[ -n "${VENV:-}" ] || source scripts/venv.sh  # (a venv already set up, as in the tests: used as it is)
raw=$(mktemp -d)
trap 'rm -rf "$raw"' EXIT
"$VENV/bin/python" -m build --wheel --outdir "$raw" . >"$raw/build.log" 2>&1 || { cat "$raw/build.log" >&2; exit 1; }
PATH="$VENV/bin:$PATH" "$VENV/bin/auditwheel" repair --wheel-dir "$out" "$raw"/replay_proxy-*.whl 2>&1 | tail -1
