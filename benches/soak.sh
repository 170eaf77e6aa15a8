#!/usr/bin/env bash
# Soak the deterministic simulations with many seeds: whole training runs
# through storage faults (train/tests/simulation.rs) and the residency
# manager's random operations (runtime/tests/simulation.rs).
#
#   benches/soak.sh [SEEDS]        (default 10000; CI runs 200 and 24)
#
# A failure prints its seed and the command that replays it.
set -euo pipefail
seeds="${1:-10000}"
cd "$(dirname "$0")/.."
echo "training runs through storage faults: $seeds seeds"
STRATA_SIM_SEEDS="$seeds" cargo test --release -p strata-train --test simulation -- --nocapture 2>&1 |
    grep -E "seeds in|panicked|seed [0-9]+:|replay|test result"
echo "residency manager: $seeds seeds"
STRATA_SIM_SEEDS="$seeds" cargo test --release -p strata-runtime --test simulation -- --nocapture 2>&1 |
    grep -E "simulation|panicked|seed|test result"
