#!/usr/bin/env bash
# The whole compatibility matrix, observed by real peers, into docs/compatibility.md.
#   scripts/matrix.sh [OUT]     OUT (default matrix/) gets matrix.db and the reports
# Installs what it needs first (cached: engines and Python frontends 0.27.0 to 0.32.0,
# the Rust frontend of every release 0.22.0 to 0.34.0), then times the matrix alone.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
OUT=${1:-matrix}
FRONTENDS=vllm-rs:0.22.0..0.34.0,vllm:0.27.0..0.34.0
ENGINES=0.27.0..0.34.0

SECONDS=0
bash scripts/setup-vllm.sh 0.27.0 0.27.1 0.28.0 0.29.0 0.30.0
"$VENV/bin/python" -m replay_proxy peers fetch $(for v in 0.22.0 0.22.1 0.23.0 0.24.0 0.25.0 0.25.1 0.26.0 \
  0.27.0 0.27.1 0.28.0 0.29.0 0.30.0 0.31.0 0.32.0 0.33.0 0.34.0; do echo --vllm-rs "$v"; done) >/dev/null
echo "[matrix] peers ready in ${SECONDS} s" >&2

rm -f "$OUT/matrix.db"
SECONDS=0
STARTED=$(date -u +"%Y-%m-%d %H:%M UTC")
"$VENV/bin/python" -m replay_proxy matrix --frontends "$FRONTENDS" --engines "$ENGINES" \
  --db "$OUT/matrix.db" --report-dir "$OUT"
TOOK=$SECONDS
{
  echo "# Compatibility matrix: vLLM frontends x engines"
  echo
  echo "Observed on $STARTED on this project's 2-core CPU machine by"
  echo "\`scripts/matrix.sh\` (\`replay-proxy matrix --frontends $FRONTENDS --engines $ENGINES\`),"
  echo "in $((TOOK / 60)) min $((TOOK % 60)) s with the peers cached. Each cell is observed by two real replays"
  echo "(docs/matrix.md), two for each kind of request recorded on both sides; \`*\` marks a cell (or a kind)"
  echo "that could only be predicted, \`!\` one whose"
  echo "observation disagrees with its prediction. \`replay-proxy can-i-deploy --db docs/compatibility.db\`"
  echo "answers from the same cells (evidence whole in its \`matrix_cells\` table)."
  echo
  cat "$OUT/matrix.md"
} > docs/compatibility.md
cp "$OUT/matrix.db" docs/compatibility.db
echo "[matrix] $TOOK s; wrote docs/compatibility.md and docs/compatibility.db" >&2
