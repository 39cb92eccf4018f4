#!/usr/bin/env bash
# The first checks of undying on a GPU: one command, one GPU, under 10 minutes, nothing installed.
#
#   PYTHONPATH=src scripts/gpu-check.sh          # from a copy of the working tree (the repository root)
#
# Checks, each under its own time limit (a hang is a FAIL, never a stuck script):
#   preflight           torch, CUDA, NCCL versions; undying imports (pydantic, PyYAML present)
#   nccl-wait           1-rank NCCL: the bounded wait really waits for a collective queued on the GPU
#   nccl-timeout-abort  1-rank NCCL: a collective past comm_timeout raises, the group is aborted, the
#                       process survives NCCL's watchdog, and a next-generation group works
#   nccl-stuck-abort    the same with a receive nobody sends (a collective stuck inside NCCL)
#   snapshot            a CUDA T1 snapshot whose update is still queued on the GPU: the copy sees it
#   adam-placement      an AdamW repaired (send/recv_state), restored from a host state (T2 broadcast) and
#                       from host memory (T1 copy_into): its step counters on the CPU, moments on the GPU
#                       (capturable: all on the GPU), and its next step equal to the source's
#   node-check          the device part of a node's health check (undying/agent/node_check.py): the GPU an NCCL
#                       rank would use is seen and computes a small matmul right
#   bench-checkpoint    bench/checkpoint.py --device cuda at its smallest size (tiny)
#   job-ref-1, job-ref-2, job-kill   1-rank CUDA jobs of examples/gpt (backend nccl, 30 steps): the two
#                       fault-free runs, the run killed at step 15 (restored from T1, node memory),
#                       job-raise (an exception in step 15, retried in the same process), job-nan (a NaN
#                       in step 15's output: the bad-step check fails the step, the replay commits it) and
#                       job-kill-forked (the kill with workers forked from the warm standby) must end
#                       with the same param_sha256; forked-workers: the standby really forked them
#   sharded-ref, sharded-kill  the example sharded with FSDP2 over ft.device_mesh (1 x 1, NCCL mesh
#                       groups): fault-free and killed at step 15 must end with the same param_sha256
# Results go to $OUT if set, else gpu-check-results/: one log per check, summary.txt, the bench JSON.
# GPU_CHECK_CPU=1 runs the same script on CPU (gloo, the NCCL checks skipped): proof that it starts.
# Python packages the GPU machine lacks (pydantic, ...) may travel in a folder named by
# UNDYING_GPU_DEPS (default gpu-deps/), put on PYTHONPATH when it exists.
set -u
cd "$(dirname "$0")/.."
RESULTS="${OUT:-gpu-check-results}"
mkdir -p "$RESULTS"
PYTHON="${PYTHON:-python3}"
DEPS="${UNDYING_GPU_DEPS:-gpu-deps}"
export PYTHONPATH="src${DEPS:+:$DEPS}${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
CPU_FLAG=""
BACKEND=nccl
if [ "${GPU_CHECK_CPU:-0}" = 1 ]; then
    CPU_FLAG="--cpu"
    BACKEND=gloo
elif ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu-check: SKIPPED: no CUDA GPU visible to $PYTHON (GPU_CHECK_CPU=1 runs the CPU path)" \
        | tee "$RESULTS/summary.txt"
    exit 3
fi
STARTED=$(date +%s)
BUDGET_S=${GPU_CHECK_BUDGET_S:-570}  # the whole script stays under 10 minutes even if every check hangs
# The example's digests on GPU also need deterministic kernels; cuBLAS needs this workspace for them.
export CUBLAS_WORKSPACE_CONFIG="${CUBLAS_WORKSPACE_CONFIG:-:4096:8}"
SUMMARY="$RESULTS/summary.txt"
: > "$SUMMARY"
FAILED=0

record() {  # record NAME STATUS DETAIL
    printf '%-20s %-5s %s\n' "$1" "$2" "$3" | tee -a "$SUMMARY"
    [ "$2" = FAIL ] && FAILED=$((FAILED + 1))
    return 0
}

LIMIT=0
limit_for() {  # limit_for NAME WANTED_S: sets LIMIT to WANTED_S cut to the budget left (0: not run, a FAIL)
    local left=$(( BUDGET_S - ($(date +%s) - STARTED) ))
    LIMIT=$2
    [ "$left" -lt "$LIMIT" ] && LIMIT=$left
    if [ "$LIMIT" -lt 15 ]; then
        LIMIT=0
        record "$1" FAIL "not run: the script's ${BUDGET_S} s budget is spent"
    fi
    return 0
}

check() {  # check NAME LIMIT_S COMMAND...: one in-process check; its RESULT line is the verdict
    local name=$1 limit
    limit_for "$1" "$2"
    limit=$LIMIT
    shift 2
    [ "$limit" = 0 ] && return 0
    local log="$RESULTS/$name.log" began rc line
    began=$(date +%s)
    timeout -s KILL "$limit" "$@" > "$log" 2>&1
    rc=$?
    line=$(grep -m1 "^RESULT $name " "$log")
    if [ -n "$line" ]; then
        set -- $line
        shift 2
        local status=$1
        shift
        [ "$status" = PASS ] && [ "$rc" != 0 ] && status=FAIL
        record "$name" "$status" "$* ($(( $(date +%s) - began )) s, rc $rc)"
    else
        record "$name" FAIL "no result (rc $rc$([ "$rc" = 137 ] && echo ": killed after ${limit} s")); see $log"
    fi
}

JOB_FLAGS=(--nnodes 1 --nproc-per-node 1 --monitor-interval 0.3 --checkpoint-interval 10
           --set "backend=$BACKEND" --set heartbeat_interval=0.5 --set heartbeat_timeout=4
           --set comm_timeout=60 --set warm_standby=false --quiet)

job() {  # job NAME [UNDYING ARGS] [-- SCRIPT ARGS]: a 30-step 1-rank run of the example; digest in RESULTS/NAME.sha
    local name=$1
    shift
    local options=() script_args=()
    while [ $# -gt 0 ] && [ "$1" != -- ]; do options+=("$1"); shift; done
    [ $# -gt 0 ] && shift && script_args=("$@")
    local run_dir="$RESULTS/runs/$name" began rc limit
    limit_for "$name" 150
    limit=$LIMIT
    [ "$limit" = 0 ] && return 0
    rm -rf "$run_dir"
    began=$(date +%s)
    timeout -s KILL "$limit" "$PYTHON" -m undying.cli run "${JOB_FLAGS[@]}" --run-dir "$run_dir" ${options[@]+"${options[@]}"} \
        examples/gpt/train.py --steps 30 ${script_args[@]+"${script_args[@]}"} > "$RESULTS/$name.log" 2>&1
    rc=$?
    local digest
    digest=$("$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1]))["param_sha256"])' \
        "$run_dir/result.json" 2>/dev/null)
    if [ "$rc" = 0 ] && [ -n "$digest" ]; then
        echo "$digest" > "$RESULTS/$name.sha"
        record "$name" PASS "param_sha256 ${digest:0:16} ($(( $(date +%s) - began )) s)"
    else
        record "$name" FAIL "rc $rc, no result.json digest; see $RESULTS/$name.log and $run_dir/logs"
    fi
}

echo "gpu-check: results in $RESULTS (backend $BACKEND)"
check preflight 120 "$PYTHON" scripts/gpu_check.py preflight $CPU_FLAG
for name in nccl-wait nccl-timeout-abort nccl-stuck-abort snapshot adam-placement node-check; do
    check "$name" 60 "$PYTHON" scripts/gpu_check.py "$name" $CPU_FLAG
done

began=$(date +%s)
DEVICE=cuda
[ -n "$CPU_FLAG" ] && DEVICE=cpu
limit_for bench-checkpoint 180
limit=$LIMIT
if [ "$limit" = 0 ]; then
    :
elif timeout -s KILL "$limit" "$PYTHON" bench/checkpoint.py --device "$DEVICE" --sizes tiny --repeats 1 --loop-rounds 1 \
        --out "$RESULTS/bench-checkpoint.json" > "$RESULTS/bench-checkpoint.log" 2>&1; then
    record bench-checkpoint PASS "--device $DEVICE --sizes tiny ($(( $(date +%s) - began )) s); table in the log"
else
    record bench-checkpoint FAIL "see $RESULTS/bench-checkpoint.log"
fi

job job-ref-1
job job-ref-2
job job-kill --inject kill:rank=0:step=15
job job-raise --set process_recover=true --recover-strategy retry,dump --inject raise:rank=0:step=15
# A NaN in rank 0's output at step 15: the bad-step check (the gradient norm, on the GPU) fails the step
# on every rank and the replay commits it: bitwise equal to the fault-free runs.
job job-nan --inject nan:rank=0:step=15
# The same kill with the worker forked from the agent's warm standby (the default outside this script):
# forked before and after the fault, or the agent's reason for starting plain processes instead.
job job-kill-forked --set warm_standby=true --inject kill:rank=0:step=15
if grep -q "generation 2 (warm standby)" "$RESULTS/runs/job-kill-forked/logs/rank0.log" 2>/dev/null; then
    record forked-workers PASS "rank 0 forked from the warm standby, before and after the kill"
else
    record forked-workers FAIL "$(grep -h 'warm standby' "$RESULTS/job-kill-forked.log" | tail -1)"
fi
if [ -f "$RESULTS/job-ref-1.sha" ] && [ -f "$RESULTS/job-ref-2.sha" ] && [ -f "$RESULTS/job-kill.sha" ] \
        && [ -f "$RESULTS/job-raise.sha" ] && [ -f "$RESULTS/job-nan.sha" ]; then
    if [ "$(cat "$RESULTS"/job-*.sha | sort -u | wc -l)" = 1 ]; then
        record digests PASS "fault-free x2, killed at 15, raised at 15 (retried), NaN at 15 (replayed): bitwise equal"
    else
        record digests FAIL "param_sha256 differ: $(cat "$RESULTS"/job-*.sha | cut -c1-16 | tr '\n' ' ')"
    fi
    # The kill must have been restored from T1 (node memory), not from the step-10 checkpoint in storage;
    # the exception must have been retried, not turned into a restart.
    "$PYTHON" - "$RESULTS/runs/job-kill" "$RESULTS/runs/job-raise" > "$RESULTS/recovery-paths.txt" 2>&1 <<'PY'
import sys
from undying import events as ev
from undying.events import read_events
loads = [(e.step, e.details.get("source")) for e in read_events(sys.argv[1]) if e.kind == ev.CHECKPOINT_LOAD]
strategies = [e.details.get("strategy") for e in read_events(sys.argv[2]) if e.kind == ev.DECISION]
print(f"kill run loads={loads} raise run decisions={strategies}")
sys.exit(0 if (15, "memory") in loads and strategies == ["retry"] else 1)
PY
    if [ $? = 0 ]; then
        record recovery-paths PASS "kill: step 15 loaded from memory (T1); raise: retried in place"
    else
        record recovery-paths FAIL "$(tail -1 "$RESULTS/recovery-paths.txt")"
    fi
else
    record digests FAIL "a job gave no digest"
fi

# The sharded path: FSDP2 over ft.device_mesh (a 1 x 1 mesh: one GPU), its mesh groups on NCCL.
job sharded-ref -- --mesh 1x1
job sharded-kill --inject kill:rank=0:step=15 -- --mesh 1x1
if [ -f "$RESULTS/sharded-ref.sha" ] && [ -f "$RESULTS/sharded-kill.sha" ]; then
    if [ "$(cat "$RESULTS"/sharded-*.sha | sort -u | wc -l)" = 1 ]; then
        record sharded-digests PASS "FSDP2 on the mesh: fault-free and killed at 15 (job restart): bitwise equal"
    else
        record sharded-digests FAIL "param_sha256 differ: $(cat "$RESULTS"/sharded-*.sha | cut -c1-16 | tr '\n' ' ')"
    fi
fi

echo "gpu-check: $FAILED failed, $(( $(date +%s) - STARTED )) s in all; summary in $SUMMARY" | tee -a "$SUMMARY"
[ "$FAILED" = 0 ]
