#!/usr/bin/env bash
# offload.toml against resident.toml in one run, alternating which runs
# first each round; prints each round's tokens/s and the median ratio.
#   benches/train-offload-vs-resident.sh [rounds] [steps] [strata binary]
set -euo pipefail
rounds=${1:-3}
steps=${2:-6}
strata=${3:-target/release/strata}
configs=$(cd "$(dirname "$0")/../examples/configs" && pwd)
work=$(cd "$(mktemp -d -p "${TMPDIR:-.}" strata-train-bench.XXXXXX)" && pwd)
trap 'rm -rf "$work"' EXIT
ratios=()
for round in $(seq 1 "$rounds"); do
  order=(offload resident)
  if (( round % 2 == 0 )); then order=(resident offload); fi
  declare -A tps=()
  for which in "${order[@]}"; do
    if ! (cd "$work" && "$OLDPWD/$strata" train --config "$configs/$which.toml" --steps "$steps" --json \
      >"$work/out.json" 2>"$work/err.txt"); then
      echo "round $round: $which failed:" >&2
      tail -20 "$work/err.txt" >&2
      exit 1
    fi
    tps[$which]=$(tail -1 "$work/out.json" | python3 -c 'import json,sys; print(json.load(sys.stdin)["tokens_per_s"])')
  done
  ratio=$(python3 -c "print(${tps[offload]} / ${tps[resident]})")
  echo "round $round: offload ${tps[offload]} tok/s, resident ${tps[resident]} tok/s, ratio $ratio"
  ratios+=("$ratio")
done
python3 -c "import statistics,sys; print('median ratio', statistics.median(map(float, sys.argv[1:])))" "${ratios[@]}"
