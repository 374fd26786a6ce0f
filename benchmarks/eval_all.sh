#!/usr/bin/env bash
# The issue-C evaluation runs recorded in docs/benchmarks.md (about 1.5 h on 2 CPU cores, one after another).
set -euo pipefail
K=.venv/bin/kvfuse
D=data/musique_dev.json
X=benchmarks/data/crosschunk_n60_s0.json
O=${OUT:-docs/eval}
if [ "${SKIP_MAIN:-0}" != 1 ]; then
  $K eval --data $D --methods full,prefix,reuse,blend@0.05,blend@0.15,blend@0.3,blend@0.5,blend@0.9,legolink@16,blend@auto,mapreduce,maprerank --out $O/musique --quiet
fi
$K eval --data $X --cases 40 --methods full,reuse,blend@0.15,blend@0.5,legolink@16 --out $O/crosschunk --quiet
$K eval deviation --data $D --cases 8 --ratios 0.05,0.15,0.3,0.5 --out $O/deviation --quiet
for k in 3 9 12; do
  $K eval --data $D --cases 6 --top-k $k --methods full,reuse,blend@0.15 --out $O/sens-topk$k --quiet
done
for c in 300 900; do
  $K eval --data $D --cases 6 --chunk-tokens $c --methods full,reuse,blend@0.15 --out $O/sens-chunk$c --quiet
done
