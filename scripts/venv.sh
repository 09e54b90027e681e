# Sourced by demo.sh and test.sh: make or reuse the project venv (.venv) with
# the project installed, and export VENV. pip's "is ignored" lines are noise
# from this machine's local index folders.
VENV=${REPLAY_PROXY_VENV:-$PWD/.venv}
PYTHON=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
timeout 600 "$VENV/bin/pip" install --quiet --disable-pip-version-check -e ".[test]" \
  2> >(grep -v "is ignored: it is neither" >&2)
export VENV
