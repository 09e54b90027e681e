#!/usr/bin/env bash
# Everything the tests need, from nothing, then the whole suite.
#   scripts/test.sh           the full suite, real vLLM included (what CI runs)
#   scripts/test.sh --fast    skip the real-vLLM tests (and their set-up) and the soak
# Extra arguments go to pytest.
#
# The full suite runs in two parts, each on both cores (pytest-xdist). While scripts/setup-vllm.sh installs
# the peers, the tests that need no vLLM run beside it, a test at a time to each worker. Then the
# real-vLLM tests run, one test file to a worker, so that the peers a file's tests share stay in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
# Debian's packages the tests use beside the project: the HTML report is checked in headless Chromium, and a
# real Prometheus server scrapes record --metrics (tests/record/test_metrics.py).
debian_package() {  # COMMAND PACKAGE [apt-get install's options]
  command -v "$1" >/dev/null && return
  if [ "$(id -u)" = 0 ]; then
    { [ -n "${apt_updated:-}" ] || timeout 300 apt-get update -qq; } && apt_updated=1 &&
      DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq "${@:3}" "$2" >/dev/null
  else
    echo "[test] $1 missing (apt-get install $2): its tests will be skipped" >&2
  fi
}
debian_packages_installed() {
  debian_package chromium chromium
  debian_package prometheus prometheus --no-install-recommends
}
# Every run shows where its time went and why anything was skipped.
REPORT=(--durations=15 -rs)
# One part of the suite; a part that the extra arguments leave empty (pytest's exit 5) has not failed.
part() { "$VENV/bin/python" -m pytest "${REPORT[@]}" "$@" || { code=$?; [ "$code" = 5 ] || return "$code"; }; }
if [ "${1:-}" = "--fast" ]; then
  shift
  debian_packages_installed
  part -m "not real_vllm and not soak" -n 2 "$@"
  exit
fi
setup_log=$(mktemp)
# The set-up in a process group of its own, stopped by its ID if this script ends first (interrupted).
setsid bash scripts/setup-vllm.sh >"$setup_log" 2>&1 &
setup=$!
trap 'kill -- -"$setup" 2>/dev/null || true; rm -f "$setup_log"' EXIT  # (set -e holds in a trap too)
debian_packages_installed
status=0
part -m "not real_vllm" -n 2 "$@" || status=$?
if ! wait "$setup"; then
  cat "$setup_log" >&2
  echo "[test] scripts/setup-vllm.sh failed: the real-vLLM tests cannot run" >&2
  exit 1
fi
cat "$setup_log" >&2
# With the peers installed, a real-vLLM test that cannot find them fails instead of skipping.
export REPLAY_PROXY_REQUIRE_VLLM=1
real=0
# In the order collected (tests/conftest.py puts the longest files first), not xdist's by test count.
part -m real_vllm -n 2 --dist loadfile --no-loadscope-reorder "$@" || real=$?
exit $((status ? status : real))
