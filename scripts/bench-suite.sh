#!/usr/bin/env bash
# The benchmark suite on one checkpoint, every part into one results database, then the report page:
#   scripts/bench-suite.sh MODEL DB OUT
# 1. the paper's layer-level sweep (FFN dimension, experts, top-k, hidden size around Mixtral-8x7B; fused and naive)
# 2. the runtime sweep of MODEL (batch x input length)
# 3. expert activation of MODEL on random tokens (heatmap, imbalance, distinct experts per batch)
# 4. the pruning sweep of MODEL (inter and intra, 25% and 50%)
# 5. cpumoe serve of MODEL driven by cpumoe bench serve at three request rates
# 6. cpumoe report of the database into OUT/index.html
# A step already in the database is skipped by the sweeps (run it again to resume); the others append new rows.
set -euo pipefail
MODEL=${1:?usage: bench-suite.sh MODEL DB OUT}
DB=${2:?usage: bench-suite.sh MODEL DB OUT}
OUT=${3:?usage: bench-suite.sh MODEL DB OUT}
CPUMOE=${CPUMOE:-.venv/bin/cpumoe}
PORT=${PORT:-8391}
mkdir -p "$OUT"

"$CPUMOE" bench sweep layer --grid paper --experts fused,naive --db "$DB"
"$CPUMOE" bench sweep model "$MODEL" --batch 1,16,32,64 --input-len 128,512 --output-len 128 --db "$DB"
"$CPUMOE" bench experts "$MODEL" --random-tokens 4096 --out "$OUT/experts-heatmap.png" --db "$DB"
"$CPUMOE" bench prune "$MODEL" --methods inter,intra --ratios 0.25,0.5 --quick --db "$DB"

"$CPUMOE" serve "$MODEL" --port "$PORT" --served-model-name suite --log-level warning &
server=$!
trap 'kill $server 2>/dev/null || true; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 600); do   # loading a checkpoint of several GB takes minutes on a small machine
  .venv/bin/python -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/v1/models', timeout=2)" \
    2>/dev/null && break
  kill -0 $server 2>/dev/null || { echo "bench-suite: cpumoe serve exited" >&2; exit 1; }
  sleep 1
done
"$CPUMOE" bench serve --base-url "http://127.0.0.1:$PORT" --tokenizer "$MODEL" --input-len 512 --output-len 128 \
  --num-prompts 32 --request-rate 1,2,inf --max-concurrency 16 --label cpumoe --goodput ttft:2000 tpot:250 \
  --json "$OUT/serve.json" --db "$DB"
kill $server; wait $server 2>/dev/null || true
trap - EXIT

"$CPUMOE" report --db "$DB" --out "$OUT"
