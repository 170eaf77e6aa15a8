#!/usr/bin/env bash
# The CPU optimizer's server bars in one prepared run, sized to a lent GPU
# machine's device time (a command may run 10 minutes; a session has 15 in
# all): its 16-core host runs the optimizer, its GPU the compute.
#
# Parts (default: all, in this order; run them in separate calls when one
# call's time is short):
#   env    lscpu, NUMA nodes, THP settings, the GPU's name: env.txt
#   bars   benches/adam_vs_deepspeed.py at 2, 14 and 16 threads, 3 rounds:
#          AdamW against torch, DeepSpeed and the roofline at 2 and 16,
#          14 threads against 16, the offload step against DeepSpeed's at
#          16, the bf16-state steps against the fp32-state one: bars.txt,
#          bars.json
#   chart  the same at 1, 2, 4, 8, 14 and 16 threads, 1 round, charted:
#          chart.txt, chart.svg
#   lane   benches/optimizer-lane.py at 2, 8 and 14 threads, 2 rounds, the
#          model computing on the GPU where there is one: lane.txt
#   pool   one short training run on the GPU with a 16 GiB pinned pool:
#          whether the optimizer's threads committed it and the driver
#          registered it where it lies (no "could not page-lock"
#          warning): pool.txt
#
# Every part has a time limit; what a part wrote stays in $OUT when a
# later one fails. Exit status: 1 if any part failed or ran out of time.
#
# Inputs:
#   STRATA   the strata binary (default target/release/strata). The GPU
#            machine has no Rust: build here and carry a stripped copy
#            (`strip -o gpu-bin/strata target/release/strata`, ~10 MB; the
#            folder git-ignored) with STRATA=gpu-bin/strata.
#   WHEELS   a folder of wheels installed when deepspeed is missing
#            (`pip wheel --no-deps deepspeed pydantic pydantic-core
#            annotated-types typing-inspection typing-extensions hjson` for
#            the machine's Python; carried like the binary).
#   OUT      where results go (default server-check/).
#   TINY=1   a small run of every part on any machine, for the tests.
#
# Usage: [STRATA=...] [WHEELS=...] [OUT=...] bash benches/server-cpu-check.sh [part...]
set -uo pipefail

here=$(cd "$(dirname "$0")" && pwd)
STRATA=${STRATA:-target/release/strata}
OUT=${OUT:-server-check}
TINY=${TINY:-0}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(env bars chart lane pool)
failed=0

if [ ! -x "$STRATA" ]; then
    echo "error: no strata binary at $STRATA: build one (cargo build --release) or set STRATA" >&2
    exit 2
fi
STRATA=$(cd "$(dirname "$STRATA")" && pwd)/$(basename "$STRATA")
has_gpu() { command -v nvidia-smi > /dev/null && nvidia-smi -L > /dev/null 2>&1; }

# `run LIMIT NAME CMD...`: CMD under a time limit, its output in $OUT/NAME.txt.
run() {
    local limit=$1 name=$2
    shift 2
    echo "== $name (at most ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.txt" 2>&1
    local rc=$?
    tail -n 25 "$OUT/$name.txt"
    case $rc in
        0) ;;
        124 | 137) echo "!! $name ran past ${limit}s"; failed=1 ;;
        *) echo "!! $name failed (exit $rc)"; failed=1 ;;
    esac
}

# The peers that can run here: torch and DeepSpeed, torch alone, or none.
peers() {
    if ! python3 -c "import torch" > /dev/null 2>&1; then
        echo "torch is not importable: strata's kernels run without peers" >&2
        echo none
    elif deepspeed_ready >&2; then
        echo torch,deepspeed
    else
        echo torch
    fi
}

deepspeed_ready() {
    python3 -c "import deepspeed" > /dev/null 2>&1 && return 0
    if [ -n "${WHEELS:-}" ] && [ -d "$WHEELS" ]; then
        pip install --quiet --no-index --no-deps "$WHEELS"/*.whl > "$OUT/wheels.txt" 2>&1
        python3 -c "import deepspeed" > /dev/null 2>&1 && return 0
    fi
    echo "deepspeed is not importable (set WHEELS to a folder of wheels): the peers run as torch only"
    return 1
}

# A training config computing on the GPU (or, tiny, on the CPU device).
gpu_config() {
    local host_budget=$1
    local kind=cpu budget=64MiB
    has_gpu && kind=cuda budget=8GiB
    sed -e "s/^kind = \"cpu\"/kind = \"$kind\"/" -e "s/^budget = \"64MiB\"/budget = \"$budget\"/" \
        -e "s/^budget = \"1GiB\"/budget = \"$host_budget\"/" <<'EOF'
[model]
vocab = 256
seq = 64
hidden = 512
heads = 8
layers = 4

[train]
micro_batch = 2
compute_dtype = "bf16"

[placement]
params = "cpu"
optimizer = "cpu"

[device]
kind = "cpu"
budget = "64MiB"

[host]
budget = "1GiB"
EOF
}

for part in "${parts[@]}"; do
    case $part in
        env)
            {
                date -u
                lscpu
                echo; cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/defrag 2>&1
                echo; command -v numactl > /dev/null && numactl --hardware
                echo; has_gpu && nvidia-smi -L
                echo; "$STRATA" --version 2>&1
            } > "$OUT/env.txt" 2>&1
            grep -E "^(Model name|Thread|Core|Socket|NUMA node)" "$OUT/env.txt"
            ;;
        bars)
            peers=$(peers)
            if [ "$TINY" = 1 ]; then
                run 300 bars python3 "$here/adam_vs_deepspeed.py" --strata "$STRATA" --threads 1,2 \
                    --params 65536 --rounds 1 --reps 1 --peers "$peers"
            else
                run 330 bars python3 "$here/adam_vs_deepspeed.py" --strata "$STRATA" --threads 2,14,16 \
                    --rounds 3 --peers "$peers"
            fi
            ;;
        chart)
            if [ "$TINY" = 1 ]; then
                run 300 chart python3 "$here/adam_vs_deepspeed.py" --strata "$STRATA" --threads 1,2 \
                    --params 65536 --rounds 1 --reps 1 --peers none --plot "$OUT/chart.svg"
            else
                run 300 chart python3 "$here/adam_vs_deepspeed.py" --strata "$STRATA" \
                    --threads 1,2,4,8,14,16 --rounds 1 --peers "$(peers 2> /dev/null)" --plot "$OUT/chart.svg"
            fi
            ;;
        lane)
            gpu_config 1GiB > "$OUT/lane.toml"
            if [ "$TINY" = 1 ]; then
                run 300 lane python3 "$here/optimizer-lane.py" --strata "$STRATA" --threads 1 \
                    --rounds 1 --steps 5 --config "$OUT/lane.toml"
            else
                run 240 lane python3 "$here/optimizer-lane.py" --strata "$STRATA" --threads 2,8,14 \
                    --rounds 2 --config "$OUT/lane.toml"
            fi
            ;;
        pool)
            host=16GiB
            [ "$TINY" = 1 ] && host=1GiB
            gpu_config "$host" > "$OUT/pool.toml"
            run 120 pool env STRATA_LOG=debug "$STRATA" train --config "$OUT/pool.toml" --steps 3
            if ! grep -q "pinned host pool committed" "$OUT/pool.txt" 2> /dev/null; then
                echo "!! pool: no 'pinned host pool committed' line"
                failed=1
            fi
            if grep -q "could not page-lock" "$OUT/pool.txt" 2> /dev/null; then
                echo "!! pool: the pinned pool was not locked where it lies (see pool.txt)"
                failed=1
            fi
            grep "pinned host pool committed" "$OUT/pool.txt" 2> /dev/null | tail -n 2
            ;;
        *)
            echo "error: unknown part '$part' (env, bars, chart, lane, pool)" >&2
            exit 2
            ;;
    esac
done
exit $failed
