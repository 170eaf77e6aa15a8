#!/usr/bin/env bash
# The CPU optimizer's server bars in one prepared run, sized to a lent GPU
# machine's device time (a command may run 10 minutes; a session has 15 in
# all, machine start included): its 16-core host runs the optimizer, its
# GPU the compute.
#
# Parts (default: all, in this order; the limits are each part's most):
#   env    (5 s)   lscpu, NUMA nodes, THP settings, the GPU: env.txt
#   pool   (90 s)  a short training run on the GPU with a 16 GiB pinned
#                  pool: the optimizer's threads committed it, and the
#                  driver registered it where it lies (locked=true, no
#                  "where they lie" warning): pool.txt
#   lane   (180 s) benches/optimizer-lane.py at 2, 8 and 14 threads, 2
#                  rounds, the model computing on the GPU: lane.txt
#   chart  (150 s) strata's kernels alone at 1, 2, 4, 8, 14 and 16
#                  threads, 1 round, charted: chart.txt, chart.svg
#   bars   (300 s) benches/adam_vs_deepspeed.py at 2, 14 and 16 threads, 3
#                  rounds, with torch and DeepSpeed: AdamW against the best
#                  peer and the roofline at 2 and 16, 14 threads against 16,
#                  the offload step against DeepSpeed's at 16, the bf16-state
#                  steps against the fp32-state one: bars.txt (its first
#                  line names the peers that ran); DeepSpeed's CPU Adam is
#                  built first (up to 150 s more), once per machine
# Two calls fit the device time: `env pool lane chart`, then `bars`. The
# script warns when the parts asked for could run past 9 minutes.
#
# What a part wrote stays in $OUT when a later one fails. Exit status: 2
# for a bad argument (before anything runs), else 1 if any part failed or
# ran out of time.
#
# Inputs:
#   STRATA   the strata binary (default target/release/strata). The GPU
#            machine has no Rust: build here and carry a stripped copy
#            (`strip -o gpu-bin/strata target/release/strata`, ~10 MB; the
#            folder git-ignored) with STRATA=gpu-bin/strata.
#   WHEELS   a folder of wheels, installed under $OUT/site when DeepSpeed's
#            CPU Adam cannot be imported: see docs/gpu-validation.md for
#            the list and the commands (Python 3.12 binary wheels).
#   OUT      where results go (default server-check/).
#   TINY=1   a small run of every part on any machine, for the tests.
#
# Usage: [STRATA=...] [WHEELS=...] [OUT=...] bash benches/server-cpu-check.sh [part...]
set -uo pipefail

here=$(cd "$(dirname "$0")" && pwd)
STRATA=${STRATA:-target/release/strata}
OUT=${OUT:-server-check}
TINY=${TINY:-0}
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(env pool lane chart bars)
failed=0

declare -A limit=([env]=5 [pool]=90 [lane]=180 [chart]=150 [bars]=300)
total=0
for part in "${parts[@]}"; do
    if [ -z "${limit[$part]:-}" ]; then
        echo "error: unknown part '$part' (env, pool, lane, chart, bars)" >&2
        exit 2
    fi
    total=$((total + limit[$part]))
    [ "$part" = bars ] && total=$((total + 150))
done
if [ ! -x "$STRATA" ]; then
    echo "error: no strata binary at $STRATA: build one (cargo build --release) or set STRATA" >&2
    exit 2
fi
STRATA=$(cd "$(dirname "$STRATA")" && pwd)/$(basename "$STRATA")
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
if [ "$total" -gt 540 ]; then
    echo "warning: these parts may take up to ${total}s, more than a 10-minute device call leaves after start-up: split them (env pool lane chart, then bars)" >&2
fi
has_gpu() { command -v nvidia-smi > /dev/null && nvidia-smi -L > /dev/null 2>&1; }

# `run NAME CMD...`: CMD under its part's time limit, output appended to
# $OUT/NAME.txt.
run() {
    local name=$1
    shift
    local seconds=${limit[$name]}
    echo "== $name (at most ${seconds}s): $*"
    timeout --kill-after=10 "$seconds" "$@" >> "$OUT/$name.txt" 2>&1
    local rc=$?
    tail -n 25 "$OUT/$name.txt"
    case $rc in
        0) ;;
        124) echo "!! $name ran past ${seconds}s"; failed=1 ;;
        137) echo "!! $name was killed: past ${seconds}s, or out of memory"; failed=1 ;;
        *) echo "!! $name failed (exit $rc)"; failed=1 ;;
    esac
}

# DeepSpeed's CPU Adam on the CPU accelerator (a GPU host would otherwise
# build it against CUDA, which needs a toolkit matching torch's), built
# once here so that a failure shows before the timed run.
export DS_ACCELERATOR=cpu

# The carried wheels, installed under $OUT/site (in this shell: the peers'
# workers inherit PYTHONPATH and PATH, ninja included) when DeepSpeed is
# missing.
install_wheels() {
    if [ -n "${WHEELS:-}" ] && [ -d "$WHEELS" ] && ! python3 -c "import deepspeed" > /dev/null 2>&1; then
        python3 -m pip install --quiet --no-index --no-deps --target "$OUT/site" "$WHEELS"/*.whl \
            > "$OUT/wheels.txt" 2>&1 || echo "!! installing the wheels failed (see wheels.txt)"
    fi
    if [ -d "$OUT/site" ]; then
        export PYTHONPATH="$OUT/site${PYTHONPATH:+:$PYTHONPATH}" PATH="$OUT/site/bin:$PATH"
    fi
}

deepspeed_ready() {
    local probe="from deepspeed.ops.adam import DeepSpeedCPUAdam; import torch; \
DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(8))])"
    timeout 150 python3 -c "$probe" > "$OUT/deepspeed.txt" 2>&1 && return 0
    echo "DeepSpeed's CPU Adam is not usable here (see deepspeed.txt; set WHEELS): torch alone is the peer"
    return 1
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

# The lane bench's model computing on the GPU (or, on a machine without
# one, on the CPU device), with a host budget of $1.
model_config() {
    local kind=cpu device=64MiB
    has_gpu && kind=cuda device=8GiB
    python3 "$here/optimizer-lane.py" --print-config |
        sed -e "s/^kind = \"cpu\"/kind = \"$kind\"/" -e "s/^budget = \"64MiB\"/budget = \"$device\"/" \
            -e "s/^budget = \"1GiB\"/budget = \"$1\"/"
}

for part in "${parts[@]}"; do
    : > "$OUT/$part.txt"
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
        pool)
            host=16GiB
            [ "$TINY" = 1 ] && host=1GiB
            model_config "$host" > "$OUT/pool.toml"
            run pool env STRATA_LOG=debug "$STRATA" train --config "$OUT/pool.toml" --steps 3
            committed=$(grep "pinned host pool committed" "$OUT/pool.txt" | tail -n 1)
            echo "${committed:-!! pool: no 'pinned host pool committed' line}"
            [ -z "$committed" ] && failed=1
            if has_gpu; then
                # The CUDA device's fallback warns "... where they lie".
                if grep -q "where they lie" "$OUT/pool.txt" || [[ $committed != *locked=true* ]]; then
                    echo "!! pool: the pinned pool was not registered where it lies (see pool.txt)"
                    failed=1
                fi
            fi
            ;;
        lane)
            model_config 1GiB > "$OUT/lane.toml"
            if [ "$TINY" = 1 ]; then
                run lane python3 "$here/optimizer-lane.py" --strata "$STRATA" --threads 1 \
                    --rounds 1 --steps 5 --config "$OUT/lane.toml"
            else
                run lane python3 "$here/optimizer-lane.py" --strata "$STRATA" --threads 2,8,14 \
                    --rounds 2 --config "$OUT/lane.toml"
            fi
            ;;
        chart)
            threads=1,2,4,8,14,16 params=67108864
            [ "$TINY" = 1 ] && threads=1,2 params=65536
            run chart python3 "$here/adam_vs_deepspeed.py" --strata "$STRATA" --threads "$threads" \
                --params "$params" --rounds 1 --peers none --plot "$OUT/chart.svg"
            ;;
        bars)
            install_wheels
            peers=$(peers)
            echo "peers: $peers" > "$OUT/bars.txt"
            if [ "$TINY" = 1 ]; then
                run bars python3 "$here/adam_vs_deepspeed.py" --strata "$STRATA" --threads 1,2 \
                    --params 65536 --rounds 1 --reps 1 --peers "$peers"
            else
                run bars python3 "$here/adam_vs_deepspeed.py" --strata "$STRATA" --threads 2,14,16 \
                    --rounds 3 --peers "$peers"
            fi
            ;;
    esac
done
exit $failed
