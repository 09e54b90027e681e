#!/usr/bin/env bash
# Everything the tests need, from nothing, then the whole suite.
#   scripts/test.sh           the full suite, real vLLM included (what CI runs)
#   scripts/test.sh --fast    skip the real-vLLM tests (and their set-up) and the soak
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
# The HTML report is checked in headless Chromium (Debian's package).
if ! command -v chromium >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    timeout 300 apt-get update -qq && DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq chromium >/dev/null
  else
    echo "[test] chromium missing (apt-get install chromium): the browser test will be skipped" >&2
  fi
fi
# Every run shows where its time went and why anything was skipped.
REPORT=(--durations=15 -rs)
if [ "${1:-}" = "--fast" ]; then
  shift
  exec "$VENV/bin/python" -m pytest -m "not real_vllm and not soak" "${REPORT[@]}" "$@"
fi
bash scripts/setup-vllm.sh
# With the peers installed, a real-vLLM test that cannot find them fails instead of skipping.
export REPLAY_PROXY_REQUIRE_VLLM=1
exec "$VENV/bin/python" -m pytest "${REPORT[@]}" "$@"
