#!/usr/bin/env bash
# Time the README's first command from a fresh clone: new venv, no pip cache, no converted model.
#   benchmarks/demo_fresh.sh [SCENARIO]
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d /tmp/autocompress-fresh.XXXXXX)
git clone -q "$src" "$work/repo"
cd "$work/repo"
export PIP_NO_CACHE_DIR=1 AUTOCOMPRESS_CACHE="$work/cache"
start=$(date +%s)
make demo SCENARIO="${1:-h100_batched}" 2>&1 | tee "$work/demo.log" | grep -v "it/s]" | tail -25
end=$(date +%s)
echo "fresh clone -> make demo finished in $((end - start)) s (log: $work/demo.log)"
