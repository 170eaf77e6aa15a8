#!/usr/bin/env bash
# Fills gpu-bin/ (git-ignored) with what benches/gpu-machine-check.sh needs
# on a GPU machine that has no Rust toolchain and no network: the
# stripped strata binary, the CUDA test binaries (the device library
# probe, every kernel against the CPU backend, the runtime's copies, the
# engine, NCCL between ranks), and the Python 3.12 wheels DeepSpeed 0.19.8 needs beyond what
# that machine has (torch, numpy, ninja, psutil and the rest are there).
# Wheels come from ./wheels when it holds them, else from the network.
# Prints the folder's size (copy it to the GPU machine with the repository).
#
# Usage: bash benches/gpu-machine-prepare.sh [folder]   (default gpu-bin)
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=${1:-gpu-bin}
# Only a folder this script made (or none) is replaced.
if [ -e "$out" ] && [ -n "$(ls -A "$out" 2> /dev/null)" ] && [ ! -e "$out/strata" ]; then
    echo "error: $out exists and is not a gpu-bin folder this script made: name another" >&2
    exit 2
fi
rm -rf "$out"
mkdir -p "$out/tests" "$out/wheels"

cargo build --release --quiet
strip -o "$out/strata" target/release/strata

# The test binaries' paths, from cargo's own report of what it built.
executables() {
    cargo test --release --no-run --quiet --message-format=json "$@" |
        python3 -c '
import json, sys
for line in sys.stdin:
    message = json.loads(line)
    if message.get("reason") == "compiler-artifact" and message.get("executable"):
        print(message["executable"])'
}
mapfile -t tests < <(executables -p strata-kernels --test cuda_ops -p strata-runtime --test cuda \
    -p strata-train --test engine -p strata-comm --test nccl)
mapfile -t -O "${#tests[@]}" tests < <(executables -p strata-device --lib)
if [ "${#tests[@]}" != 5 ]; then
    echo "error: expected 5 CUDA test binaries from cargo, got ${#tests[@]}: ${tests[*]}" >&2
    exit 1
fi
for test in "${tests[@]}"; do
    strip -o "$out/tests/$(basename "$test")" "$test"
done

# DeepSpeed and the pure-Python or binary packages it imports that the
# machine lacks, pinned to versions that work together.
wheels=(deepspeed-0.19.8 hjson-3.1.0 pydantic-2.14.4 pydantic_core-2.50.5 annotated_types-0.8.0
    typing_inspection-0.4.5)
for wheel in "${wheels[@]}"; do
    if ! cp wheels/"$wheel"-*.whl "$out/wheels/" 2> /dev/null; then
        name=${wheel%-*} version=${wheel##*-}
        if [ "$name" = deepspeed ]; then
            python3 -m pip wheel --quiet --no-deps -w "$out/wheels" "deepspeed==$version"
        else
            python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
                --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
                -d "$out/wheels" "${name//_/-}==$version"
        fi
    fi
done

ls "$out/tests"
du -sh "$out"
