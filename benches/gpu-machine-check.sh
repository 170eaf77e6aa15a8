#!/usr/bin/env bash
# A GPU machine's checks in one prepared run of at most about 10 minutes
# (BUDGET): the CUDA tests, the pinned pool and copies, the kernels, the
# training comparison with DeepSpeed and torch, and the CPU optimizer's
# server bars on its 16-core host. benches/gpu-machine-prepare.sh fills
# gpu-bin/ with what it needs; docs/gpu-validation.md has the command.
#
# Parts (default: all in this order, cuda only with CUDA_TESTS set; the
# limits are each part's most):
#   env    (5 s)   lscpu, NUMA nodes, THP settings, the GPU: env.txt
#   cuda   (240 s) the CUDA test binaries in $CUDA_TESTS, built here
#                  (`cargo test --release --no-run ...`, see
#                  docs/gpu-validation.md), each at most 90 s: the device
#                  library probe, every kernel against the CPU backend, the
#                  runtime's copies and hazards, the engine's CUDA run
#                  against the CPU device (three times: as is, with
#                  STRATA_FLASH_ATTENTION=0, with CUDA_LAUNCH_BLOCKING=1):
#                  cuda.txt
#   llama  (280 s; not in the default list, name it: `... llama`) the
#                  Llama family's kernels alone, most telling first: the
#                  cuda_ops-* binary's attention cases (grouped-query
#                  heads, packed documents, on CUDA and tensor cores) and
#                  Llama ops against the CPU backend, the engine's tiny
#                  Llama against the CPU device in bf16 (plain and packed,
#                  twice each for the bits), then `strata bench kernels` at
#                  its defaults (b4 s1024 h16 d128; b2 s2048 h32 kv8 d128;
#                  documents of 300) beside torch's
#                  scaled_dot_product_attention: llama.txt
#   nccl   (240 s; last by default, name it to run it first) NCCL
#                  between ranks on the one GPU: the backend's test
#                  binary nccl-* from $CUDA_TESTS (the library's version;
#                  every operation at world size 1; two processes, each
#                  its own NCCL host (NCCL_HOSTID) over the loopback, sums
#                  bit for bit; a killed rank stopping the other within its
#                  timeout), then 8 steps of a small GPT as two `strata
#                  train` processes on the GPU against two threads on the
#                  CPU device, both in bf16: losses within 5e-3 relative
#                  (the engine test's bf16 tolerance): nccl.txt
#   pool   (90 s)  a short training run on the GPU with a 16 GiB pinned
#                  pool: the optimizer's threads committed it, and the
#                  driver registered it where it lies (locked=true, no
#                  "where they lie" warning): pool.txt
#   tiers  (60 s)  `strata bench tiers` on the GPU (the pinned pool's copies
#                  against one raw copy each way, and the drive), 1 GiB, 5
#                  rounds, in a folder under the working directory: tiers.txt
#   kernels (60 s) `strata bench kernels`: attention forward and backward
#                  and a GEMM in TFLOPS, on the GPU at its defaults:
#                  kernels.txt
#   lane   (150 s) benches/optimizer-lane.py at $LANE_THREADS threads
#                  (default 14), 3 rounds, the model computing on the GPU
#                  (DEVICE_KIND=cpu: on the CPU device): lane.txt
#   train  (330 s) benches/gpu_vs_deepspeed.py, 5 timed steps after 2, at
#                  its default 2.63B shape (strata offloaded, DeepSpeed
#                  ZeRO-3 offload, torch, strata resident, in that order;
#                  each peer's result is in train.txt as it finishes):
#                  train.txt
#   bars   (240 s) benches/adam_vs_deepspeed.py at $BARS_THREADS threads
#                  (default 14,16; the 2-thread bars are the 2-core
#                  development machine's), 3 rounds, with torch and
#                  DeepSpeed: AdamW against the best peer and the roofline,
#                  14 threads against 16, the offload step against
#                  DeepSpeed's, the bf16-state steps against the fp32-state
#                  one: bars.txt (its first line names the peers that ran)
#   chart  (200 s) the kernels at 1, 2, 4, 8, 14 and 16 threads, 1 round,
#                  next to the peers, charted: chart.txt, chart.svg
# DeepSpeed's wheels are installed when train, bars or chart are asked
# for; its CPU Adam is built in the background from the start (at most 150
# s, once per machine) when bars or chart are, and the first of them waits
# for it. BUDGET (seconds, default 570) caps the whole run: a
# part gets what is left of it, and one with under 20 s left is skipped.
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
#   WHEELS   a folder of wheels, installed in a temporary folder (not in
#            $OUT, the results folder copied back) when DeepSpeed's
#            CPU Adam cannot be imported: see docs/gpu-validation.md for
#            the list and the commands (Python 3.12 binary wheels).
#   CUDA_TESTS  a folder of CUDA test binaries, for the cuda part.
#   OUT      where results go (default gpu-check/).
#   TINY=1   a small run of every part on any machine, for the tests.
#
# Usage: [STRATA=...] [WHEELS=...] [CUDA_TESTS=...] [OUT=...] [BUDGET=...]
#        bash benches/gpu-machine-check.sh [part...]
set -uo pipefail

here=$(cd "$(dirname "$0")" && pwd)
STRATA=${STRATA:-target/release/strata}
OUT=${OUT:-gpu-check}
TINY=${TINY:-0}
BUDGET=${BUDGET:-570}
BARS_THREADS=${BARS_THREADS:-14,16}
LANE_THREADS=${LANE_THREADS:-14}
parts=("$@")
if [ ${#parts[@]} -eq 0 ]; then
    parts=(env pool tiers kernels lane train bars chart)
    [ -n "${CUDA_TESTS:-}" ] && parts=(env cuda pool tiers kernels lane train bars chart nccl)
fi
failed=0

declare -A limit=([env]=5 [cuda]=240 [llama]=280 [nccl]=240 [pool]=90 [tiers]=60 [kernels]=60 [train]=330 [lane]=150
    [chart]=200 [bars]=240)
if ! [[ $BUDGET =~ ^[0-9]+$ ]]; then
    echo "error: BUDGET=$BUDGET: give the whole run's limit in seconds (a whole number)" >&2
    exit 2
fi
# Parts that need DeepSpeed: its wheels (train, bars, chart), and its CPU
# Adam built on the CPU accelerator (bars, chart).
peer_parts=0 wheel_parts=0
for part in "${parts[@]}"; do
    if [ -z "${limit[$part]:-}" ]; then
        echo "error: unknown part '$part' (env, cuda, llama, nccl, pool, tiers, kernels, train, lane, chart, bars)" >&2
        exit 2
    fi
    case $part in bars | chart) peer_parts=1 wheel_parts=1 ;; train) wheel_parts=1 ;; esac
done
if [ ! -x "$STRATA" ]; then
    echo "error: no strata binary at $STRATA: build one (cargo build --release) or set STRATA" >&2
    exit 2
fi
case " ${parts[*]} " in
    *" cuda "* | *" nccl "* | *" llama "*)
        if [ -z "${CUDA_TESTS:-}" ] || [ ! -d "$CUDA_TESTS" ]; then
            echo "error: the cuda, llama and nccl parts need CUDA_TESTS, a folder of CUDA test binaries (see docs/gpu-validation.md)" >&2
            exit 2
        fi
        CUDA_TESTS=$(cd "$CUDA_TESTS" && pwd)
        ;;
esac
STRATA=$(cd "$(dirname "$STRATA")" && pwd)/$(basename "$STRATA")
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
# `has_gpu`, and the CUDA libraries where strata looks for them.
. "$here/cuda-env.sh"

# `run NAME CMD...`: CMD under its part's time limit (or what is left of
# BUDGET), output appended to $OUT/NAME.txt.
run() {
    local name=$1
    shift
    local seconds=${limit[$name]} left=$((BUDGET - SECONDS - 10))
    [ "$left" -lt "$seconds" ] && seconds=$left
    if [ "$seconds" -lt 20 ]; then
        echo "!! $name skipped: ${left}s of the ${BUDGET}s budget left"
        failed=1
        return
    fi
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

# The carried wheels, installed in a temporary folder (in this shell: the peers'
# workers inherit PYTHONPATH and PATH, ninja included) when DeepSpeed is
# missing.
install_wheels() {
    if [ -n "${WHEELS:-}" ] && [ -d "$WHEELS" ] && ! python3 -c "import deepspeed" > /dev/null 2>&1; then
        site=$(mktemp -d)
        python3 -m pip install --quiet --no-index --no-deps --target "$site" "$WHEELS"/*.whl \
            > "$OUT/wheels.txt" 2>&1 || echo "!! installing the wheels failed (see wheels.txt)"
    fi
    if [ -n "${site:-}" ]; then
        export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/bin:$PATH"
    fi
}

# Builds DeepSpeed's CPU Adam in the background; `peers` waits for it.
deepspeed_build=
start_deepspeed_build() {
    local probe="from deepspeed.ops.adam import DeepSpeedCPUAdam; import torch; \
DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(8))])"
    timeout 150 python3 -c "$probe" > "$OUT/deepspeed.txt" 2>&1 &
    deepspeed_build=$!
}

# The peers that can run here (torch and DeepSpeed, torch alone, or none),
# in $peers once known.
peers=
find_peers() {
    [ -n "$peers" ] && return
    if ! python3 -c "import torch" > /dev/null 2>&1; then
        echo "torch is not importable: strata's kernels run without peers"
        peers=none
    elif [ -n "$deepspeed_build" ] && wait "$deepspeed_build"; then
        peers=torch,deepspeed
    else
        echo "DeepSpeed's CPU Adam is not usable here (see deepspeed.txt; set WHEELS): torch alone is the peer"
        peers=torch
    fi
}
[ "$wheel_parts" = 1 ] && install_wheels
if [ "$peer_parts" = 1 ]; then
    start_deepspeed_build
fi

# The lane bench's model computing on the GPU (or, on a machine without
# one, on the CPU device), with a host budget of $1.
model_config() {
    local kind=cpu device=64MiB
    has_gpu && kind=cuda device=8GiB
    [ "${DEVICE_KIND:-}" = cpu ] && kind=cpu device=64MiB
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
        cuda)
            # Each binary alone (one GPU), its tests one at a time, each
            # run at most 90 s and all within the part's 240; the engine's
            # only those named for CUDA.
            cuda_end=$((SECONDS + 240))
            cuda_run() {
                limit[cuda]=$((cuda_end - SECONDS < 90 ? cuda_end - SECONDS : 90))
                run cuda "$@"
            }
            # The integration tests keep their files under the build's
            # target/tmp (CARGO_TARGET_TMPDIR, compiled in: this checkout's
            # path where they were built).
            mkdir -p "$here/../target/tmp"
            found=0
            for test in "$CUDA_TESTS"/*; do
                [ -f "$test" ] && [ -x "$test" ] || continue
                [[ $(basename "$test") == nccl-* ]] && continue # the nccl part's
                found=$((found + 1))
                if [[ $(basename "$test") == engine-* ]]; then
                    cuda_run "$test" cuda --test-threads=1 --nocapture
                    # Again with attention on the CUDA cores (a fault of the
                    # tensor-core kernels shows as a difference), and with
                    # every kernel launch waited for (an ordering race
                    # between the host and the GPU shows as one).
                    cuda_run env STRATA_FLASH_ATTENTION=0 "$test" cuda --test-threads=1 --nocapture
                    cuda_run env CUDA_LAUNCH_BLOCKING=1 "$test" cuda --test-threads=1 --nocapture
                else
                    cuda_run "$test" --test-threads=1 --nocapture
                fi
            done
            if [ "$found" = 0 ]; then
                echo "!! cuda: no test binary in $CUDA_TESTS (benches/gpu-machine-prepare.sh puts them there)"
                failed=1
            fi
            grep -E "^test result|FAILED|panicked|skipp" "$OUT/cuda.txt" | head -n 40
            ;;
        nccl)
            nccl_end=$((SECONDS + 240))
            nccl_test=$(find "$CUDA_TESTS" -maxdepth 1 -name 'nccl-*' -type f | head -n 1)
            if [ -z "$nccl_test" ]; then
                echo "!! nccl: no nccl-* test binary in $CUDA_TESTS (benches/gpu-machine-prepare.sh puts it there)"
                failed=1
                continue
            fi
            limit[nccl]=150
            run nccl env STRATA_REQUIRE_GPU=1 "$nccl_test" --test-threads=1 --nocapture
            grep -E "^NCCL|^rank|^test result|FAILED|panicked|skipp" "$OUT/nccl.txt" | head -n 20
            # Two processes on the one GPU, each its own NCCL host, each a
            # machine of one (its own device and host budget), as torchrun
            # tells them; then two threads on the CPU device.
            cat > "$OUT/nccl.toml" << 'TOML'
[model]
arch = "gpt2"
vocab = 256
seq = 64
hidden = 128
heads = 2
layers = 2
[train]
steps = 8
micro_batch = 4
ranks = 2
seed = 1
compute_dtype = "bf16"
lr = 0.001
warmup_steps = 2
[placement]
params = "cpu"
optimizer = "cpu"
[optim]
threads = 4
[device]
kind = "cuda"
budget = "1GiB"
[host]
budget = "1GiB"
TOML
            sed 's/^kind = "cuda"/kind = "cpu"/' "$OUT/nccl.toml" > "$OUT/nccl-cpu.toml"
            port=$((29000 + RANDOM % 1000))
            # A rank that fails takes the other down with it (trap).
            two_ranks='pids=()
                trap "kill \${pids[*]} 2> /dev/null" EXIT
                for rank in 0 1; do
                    env RANK=$rank WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 \
                        MASTER_PORT=$port NCCL_HOSTID=strata-check-$rank NCCL_SOCKET_IFNAME=lo \
                        NCCL_NET=Socket NCCL_MULTI_RANK_GPU_ENABLE=1 \
                        "$STRATA" train --config "$OUT/nccl.toml" --json > "$OUT/nccl-rank$rank.json" &
                    pids+=($!)
                done
                wait "${pids[0]}"; first=$?
                wait "${pids[1]}"; second=$?
                exit $((first | second))'
            limit[nccl]=$((nccl_end - SECONDS < 90 ? nccl_end - SECONDS : 90))
            run nccl env STRATA="$STRATA" OUT="$OUT" port=$port bash -c "$two_ranks"
            limit[nccl]=$((nccl_end - SECONDS < 60 ? nccl_end - SECONDS : 60))
            run nccl sh -c "'$STRATA' train --config '$OUT/nccl-cpu.toml' --json > '$OUT/nccl-threads.json'"
            python3 - "$OUT/nccl-rank0.json" "$OUT/nccl-threads.json" << 'PY' | tee -a "$OUT/nccl.txt" || failed=1
import json, sys
def losses(path):
    lines = [l for l in open(path).read().splitlines() if l.startswith("{")]
    return [r["loss"] for r in json.loads(lines[-1])["reports"]]
gpu, cpu = losses(sys.argv[1]), losses(sys.argv[2])
worst = max(abs(g - c) / abs(c) for g, c in zip(gpu, cpu))
print(f"two GPU processes over NCCL: {gpu}\ntwo CPU threads: {cpu}\nworst relative gap {worst:.2e} (bar 5e-3)")
sys.exit(0 if len(gpu) == len(cpu) == 8 and worst <= 5e-3 else 1)
PY
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
        tiers)
            size=1GiB device=cpu
            has_gpu && device=cuda
            [ "$TINY" = 1 ] && size=16MiB
            drive=$(mktemp -d -p .)
            run tiers "$STRATA" bench tiers --dir "$drive" --size "$size" --rounds 5 --device "$device"
            rm -rf "$drive"
            ;;
        llama)
            llama_end=$((SECONDS + 280))
            llama_run() {
                limit[llama]=$((llama_end - SECONDS < $1 ? llama_end - SECONDS : $1))
                shift
                run llama "$@"
            }
            mkdir -p "$here/../target/tmp"
            ops_test=$(find -L "$CUDA_TESTS" -maxdepth 1 -name 'cuda_ops-*' -type f | head -n 1)
            engine_test=$(find -L "$CUDA_TESTS" -maxdepth 1 -name 'engine-*' -type f | head -n 1)
            if [ -z "$ops_test" ] || [ -z "$engine_test" ]; then
                echo "!! llama: no cuda_ops-* or engine-* test binary in $CUDA_TESTS (benches/gpu-machine-prepare.sh puts them there)"
                failed=1
            else
                llama_run 60 "$ops_test" attention_matches rms_norm_rotary_swiglu --test-threads=1 --nocapture
                llama_run 120 "$engine_test" cuda_trains_a_tiny_gqa --test-threads=1 --nocapture
            fi
            if [ "$TINY" = 1 ]; then
                llama_run 100 "$STRATA" bench kernels --seq 64 --heads 4 --kv-heads 2 --documents 20 \
                    --gemm 128x128x128 --rounds 1 --round-ms 10
            else
                llama_run 100 "$STRATA" bench kernels --rounds 3
            fi
            grep -E "^test result|FAILED|panicked|skipp" "$OUT/llama.txt" | head -n 40
            ;;
        kernels)
            if [ "$TINY" = 1 ]; then
                run kernels "$STRATA" bench kernels --seq 64 --heads 2 --gemm 128x128x128 --rounds 1 --round-ms 10
            else
                run kernels "$STRATA" bench kernels
            fi
            ;;
        train)
            # On the GPU's own accelerator (the bars' DeepSpeed CPU Adam
            # build is the CPU accelerator's).
            if [ "$TINY" = 1 ]; then
                run train env -u DS_ACCELERATOR python3 "$here/gpu_vs_deepspeed.py" --strata "$STRATA" \
                    --tiny --peers strata-offload,strata-resident
            else
                run train env -u DS_ACCELERATOR python3 "$here/gpu_vs_deepspeed.py" --strata "$STRATA" \
                    --steps 5 --warmup 2 --peers strata-offload,ds-zero3-offload,torch,strata-resident
            fi
            ;;
        lane)
            model_config 1GiB > "$OUT/lane.toml"
            if [ "$TINY" = 1 ]; then
                run lane python3 "$here/optimizer-lane.py" --strata "$STRATA" --threads 1 \
                    --rounds 1 --steps 5 --config "$OUT/lane.toml"
            else
                run lane python3 "$here/optimizer-lane.py" --strata "$STRATA" --threads "$LANE_THREADS" \
                    --rounds 3 --config "$OUT/lane.toml"
            fi
            ;;
        chart)
            threads=1,2,4,8,14,16 params=67108864 reps=5
            [ "$TINY" = 1 ] && threads=1,2 params=65536 reps=1
            find_peers
            echo "peers: $peers" > "$OUT/chart.txt"
            run chart python3 "$here/adam_vs_deepspeed.py" --strata "$STRATA" --threads "$threads" \
                --params "$params" --rounds 1 --reps "$reps" --peers "$peers" --plot "$OUT/chart.svg"
            ;;
        bars)
            find_peers
            echo "peers: $peers" > "$OUT/bars.txt"
            if [ "$TINY" = 1 ]; then
                run bars python3 "$here/adam_vs_deepspeed.py" --strata "$STRATA" --threads 1,2 \
                    --params 65536 --rounds 1 --reps 1 --peers "$peers"
            else
                run bars python3 "$here/adam_vs_deepspeed.py" --strata "$STRATA" --threads "$BARS_THREADS" \
                    --rounds 3 --peers "$peers"
            fi
            ;;
    esac
done
exit $failed
