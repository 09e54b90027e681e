#!/usr/bin/env bash
# The main job on embedded defaults, from nothing: a venv with the project,
# then sim peers through `replay-proxy record` into demo/demo.db, and
# example queries over it. No vLLM needed.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
exec "$VENV/bin/python" scripts/demo.py "$@"
