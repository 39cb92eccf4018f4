#!/bin/bash
# MTTR of the main recovery rows, a13cec4 against the working tree, interleaved: each round runs
# every scenario once with each tree. Usage (from the repository root, after `make setup`):
#   git worktree add /tmp/undying-a13cec4 a13cec4
#   bash bench/results/mttr-a13cec4-vs-now/run.sh /tmp/undying-a13cec4
set -euo pipefail
old=${1:?usage: run.sh OLD_CHECKOUT}
out=$(dirname "$0")
for round in 1 2 3; do
  for tree in old new; do
    if [ "$tree" = old ]; then src=$old; else src=$PWD; fi
    PYTHONPATH=$src/src .venv/bin/python "$src/bench/recovery.py" --repeats 1 \
      --only "retry" "SIGKILL worker, warm standby" "recover, SIGKILL node" "job-restart, SIGKILL worker" \
      --out "$out/mttr-$tree-$round.json"
  done
done
