#!/usr/bin/env bash
# examples/demo.sh: cloudckpt's first hour in one command, on one machine, in a few minutes.
#
#   python3 -m venv .venv && . .venv/bin/activate && bash examples/demo.sh
#
# 1. installs what is missing (torch==2.13.0 first, then this package with its test extras);
# 2. starts a local S3 server (SeaweedFS, `python -m cloudckpt.testing.servers.seaweed`);
# 3. trains examples/train.py on 2 processes (FSDP2, async saves every 10 steps, keep_last=3)
#    and sends SIGTERM to ONE rank: every rank saves that step and exits (preemption);
# 4. resumes on 1 process (a different world size) and SIGKILLs the whole job mid-run;
# 5. resumes on 2 processes from the last complete checkpoint and finishes: the steps trained
#    twice show the same loss, i.e. the loss continues where the killed run stopped;
# 6. lists, prunes and verifies the run's checkpoints with the `cloudckpt` CLI;
# 7. stops the server (an EXIT trap: no weed process is left behind, whatever happens) and says
#    where the checkpoints lived.
#
# Output: plain text when stdout is not a terminal (no escape codes); install progress one line
# per package; exit statuses explained in words (helpers in examples/demo_lib.sh).
#
# Env: DEMO_STEPS (default 60), DEMO_STEP_DELAY (seconds slept per step, default 0.15),
#      PYTHON (interpreter, default python).
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python}"
STEPS="${DEMO_STEPS:-60}"
DELAY="${DEMO_STEP_DELAY:-0.15}"
T_START=$(date +%s)

# shellcheck source=examples/demo_lib.sh
. examples/demo_lib.sh
elapsed() { echo "$(( $(date +%s) - T_START )) s"; }

# -- 1. install -------------------------------------------------------------------------------
installed() {
  # run from / so that the checkout itself is not what gets imported
  (cd / && "$PY" -c "import torch, aiobotocore, cloudckpt.runs.manager
from cloudckpt.testing.servers.seaweed.host import find_weed; find_weed()" >/dev/null 2>&1) \
    && command -v cloudckpt >/dev/null && command -v torchrun >/dev/null
}
if ! installed; then
  if [ -z "${VIRTUAL_ENV:-}" ] && [ "$("$PY" -c 'import sys; print(sys.prefix == sys.base_prefix)')" = True ]; then
    echo "demo: cloudckpt is not installed and no virtual environment is active; run:" >&2
    echo "  python3 -m venv .venv && . .venv/bin/activate && bash examples/demo.sh" >&2
    exit 2
  fi
  say "installing torch==2.13.0, then cloudckpt[test] (editable): a few minutes"
  # torch first and pinned: any other torch spec may download a much larger build
  pip_step "torch==2.13.0" torch==2.13.0
  pip_step "cloudckpt[test]" -e '.[test]'
  installed || { echo "demo: installation did not give a working cloudckpt" >&2; exit 1; }
fi
echo "demo: $("$PY" -c 'import torch, cloudckpt; print("torch", torch.__version__, "| cloudckpt", cloudckpt.__version__)')  ($(elapsed))"

# -- clean-up: every process this demo starts carries DEMO_MARK in its environment -------------
DEMO_MARK="cloudckpt-demo-$$-$T_START"
DEMO_TMP="$(mktemp -d "${TMPDIR:-/tmp}/cloudckpt-demo.XXXXXX")"
export CLOUDCKPT_DEMO_RUN="$DEMO_MARK"
SERVER_PID=""
RUN=""
JOB_PID=""
JOB_MARK=""

marked_pids() {  # pids whose environment holds $1 (default: this demo's mark), except ours
  local f pid me=$BASHPID mark="${1:-CLOUDCKPT_DEMO_RUN=$DEMO_MARK}"
  for f in $(grep -lzxF "$mark" /proc/[0-9]*/environ 2>/dev/null); do
    pid="${f#/proc/}"; pid="${pid%/environ}"
    [ "$pid" = "$$" ] || [ "$pid" = "$me" ] && continue
    [ "$(awk '/^PPid:/ { print $2 }' "/proc/$pid/status" 2>/dev/null)" = "$me" ] && continue
    echo "$pid"
  done
}

# kill_job SIGNAL: signal torchrun and every worker of the current job at once. torchrun starts
# its workers in sessions of their own, so they are found by the job's mark in their environment.
kill_job() {
  local pids
  pids="$(marked_pids "CLOUDCKPT_DEMO_JOB=$JOB_MARK")"
  [ -n "$pids" ] && kill "-$1" $pids 2>/dev/null || true
}

cleanup() {
  local rc=$? pid left
  trap - EXIT INT TERM
  if [ -n "$JOB_PID" ]; then
    kill_job KILL
  fi
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  sleep 0.5   # the server's watchdog exits right after weed
  left="$(marked_pids)"
  for pid in $left; do
    kill -0 "$pid" 2>/dev/null || continue
    echo "demo: killing leftover process $pid: $(tr '\0' ' ' 2>/dev/null < "/proc/$pid/cmdline" | cut -c1-100)" >&2
    kill -KILL "$pid" 2>/dev/null || true
  done
  rm -rf "$DEMO_TMP"
  if [ -e "$DEMO_TMP" ] || [ -n "$(marked_pids)" ]; then
    echo "demo: could not remove everything: $DEMO_TMP or a process of this demo is left" >&2
    [ "$rc" -eq 0 ] && rc=1
  fi
  if [ "$rc" -eq 0 ]; then
    echo "demo: the checkpoints lived at $RUN, on the local S3 server at ${AWS_ENDPOINT_URL:-?}"
    echo "demo: that server is stopped and its data (under $DEMO_TMP) is removed;" \
         "no process of this demo is left; finished in $(elapsed)"
    echo "demo: to keep checkpoints, run 'python -m cloudckpt.testing.servers.seaweed' in another" \
         "terminal, eval its export lines, then: torchrun --nproc-per-node 2 examples/train.py" \
         "--url s3://cloudckpt-test/my-run"
  else
    echo "demo: FAILED (exit $rc) after $(elapsed); logs were in $DEMO_TMP (removed)" >&2
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# -- 2. local S3 server -----------------------------------------------------------------------
say "starting a local S3 server: python -m cloudckpt.testing.servers.seaweed"
"$PY" -m cloudckpt.testing.servers.seaweed --bucket cloudckpt-test --workdir "$DEMO_TMP" >"$DEMO_TMP/server.out" 2>"$DEMO_TMP/server.err" &
SERVER_PID=$!
for _ in $(seq 600); do
  grep -q '^export AWS_SECRET_ACCESS_KEY=' "$DEMO_TMP/server.out" 2>/dev/null && break
  kill -0 "$SERVER_PID" 2>/dev/null || { cat "$DEMO_TMP/server.err" >&2; exit 1; }
  sleep 0.1
done
grep -q '^export AWS_SECRET_ACCESS_KEY=' "$DEMO_TMP/server.out" || { echo "demo: server did not start" >&2; exit 1; }
eval "$(grep '^export AWS_' "$DEMO_TMP/server.out")"
head -1 "$DEMO_TMP/server.out"
RUN="s3://cloudckpt-test/demo/run-$T_START"
echo "run URL: $RUN"

LOSSES="$DEMO_TMP/losses.txt"
TRAIN_ARGS=(--url "$RUN" --steps "$STEPS" --save-every 10 --keep-last 3
            --step-delay "$DELAY" --loss-log "$LOSSES" --pid-dir "$DEMO_TMP/pids")

# start_job NPROC LOG: torchrun in the background; its processes carry the job's mark
start_job() {
  rm -rf "$DEMO_TMP/pids"
  JOB_MARK="$DEMO_MARK-job-$(date +%s%N)"
  CLOUDCKPT_DEMO_JOB="$JOB_MARK" OMP_NUM_THREADS=$(( 2 / $1 > 0 ? 2 / $1 : 1 )) \
    torchrun --standalone --nproc-per-node "$1" examples/train.py "${TRAIN_ARGS[@]}" >"$2" 2>&1 &
  JOB_PID=$!
}

# wait_for LOG REGEX: wait until a line of LOG matches (the job must stay alive meanwhile)
wait_for() {
  for _ in $(seq 1800); do
    grep -qsE "$2" "$1" && return 0
    kill -0 "$JOB_PID" 2>/dev/null || { tail -30 "$1" >&2; echo "demo: the job ended early" >&2; exit 1; }
    sleep 0.1
  done
  tail -30 "$1" >&2; echo "demo: timed out waiting for /$2/" >&2; exit 1
}

# finish_job LOG: wait for the job; print its rank-0 lines; return its exit status
finish_job() {
  local rc=0
  wait "$JOB_PID" 2>/dev/null || rc=$?
  JOB_PID=""
  grep -E '^(train:|step |\[ckpt\])' "$1" | sed 's/^/  | /' || true
  return "$rc"
}

loss_at() { awk -v s="$1" -v w="$2" '$1 == s && $3 == w { l = $2 } END { print l }' "$LOSSES"; }

# -- 3. train on 2 processes, SIGTERM one rank -------------------------------------------------
say "training on 2 processes; SIGTERM to rank 1 after step 24 (a spot interruption)"
start_job 2 "$DEMO_TMP/run1.log"
wait_for "$DEMO_TMP/run1.log" '^step +24 '
kill -TERM "$(cat "$DEMO_TMP/pids/rank1.pid")"
rc=0; finish_job "$DEMO_TMP/run1.log" || rc=$?
grep -q 'preemption checkpoint of step' "$DEMO_TMP/run1.log" || { echo "demo: no preemption save" >&2; exit 1; }
STOP1=$(awk '$3 == 2 { s = $1 } END { print s }' "$LOSSES")
echo "  what happened: rank 1 was stopped by SIGTERM, as a spot preemption would; every rank then"
echo "  saved step $STOP1 together and exited with status 143 (= 128 + 15, the status of a process"
echo "  ended by SIGTERM), so that a scheduler can tell a preemption from a crash."
explain_ranks "$DEMO_TMP/run1.log" | sed 's/^/    /'
echo "  torchrun exit status: $rc: $(explain_status "$rc");"
echo "  a wrapper can tell a preemption by train.py's --preempted-marker file (infra/slurm/train.sbatch)"

# -- 4. resume on 1 process, SIGKILL the whole job ----------------------------------------------
say "resuming on 1 process (saved by 2); SIGKILL of the whole job after step 45"
start_job 1 "$DEMO_TMP/run2.log"
wait_for "$DEMO_TMP/run2.log" '^step +45 '
kill_job KILL     # torchrun and its worker, as when a node dies
rc=0; finish_job "$DEMO_TMP/run2.log" || rc=$?
echo "  torchrun exit status: $rc: $(explain_status "$rc")"
echo "  nothing was saved at the kill: the next run resumes from the last complete checkpoint"
RESUMED2=$(sed -nE 's/^train: resumed from step ([0-9]+).*/\1/p' "$DEMO_TMP/run2.log")
[ "$RESUMED2" = "$STOP1" ] || { echo "demo: expected a resume from step $STOP1, got '$RESUMED2'" >&2; exit 1; }
STOP2=$(awk '$3 == 1 { s = $1 } END { print s }' "$LOSSES")

# -- 5. resume on 2 processes and finish --------------------------------------------------------
say "resuming on 2 processes from the last complete checkpoint; training to step $STEPS"
start_job 2 "$DEMO_TMP/run3.log"
finish_job "$DEMO_TMP/run3.log"
RESUMED3=$(sed -nE 's/^train: resumed from step ([0-9]+).*/\1/p' "$DEMO_TMP/run3.log")
[ -n "$RESUMED3" ] && [ "$RESUMED3" -lt "$STOP2" ] || {
  echo "demo: expected a resume from a checkpoint before step $STOP2, got '$RESUMED3'" >&2; exit 1; }

say "does the loss continue where it stopped?"
printf '  preempted at step %s on 2 processes: loss %s\n' "$STOP1" "$(loss_at "$STOP1" 2)"
printf '  resumed from step %s on 1 process:  step %s loss %s\n' "$RESUMED2" "$((RESUMED2 + 1))" "$(loss_at $((RESUMED2 + 1)) 1)"
printf '  killed after step %s; resumed from step %s on 2 processes. Steps trained twice:\n' "$STOP2" "$RESUMED3"
printf '    %-6s %-22s %-22s\n' step "before kill (1 proc)" "after resume (2 procs)"
worst=0
for s in $(seq $((RESUMED3 + 1)) "$STOP2"); do
  a=$(loss_at "$s" 1); b=$(loss_at "$s" 2)
  printf '    %-6s %-22s %-22s\n' "$s" "$a" "$b"
  worst=$(awk -v a="$a" -v b="$b" -v w="$worst" 'BEGIN { d = a - b; if (d < 0) d = -d; print (d > w ? d : w) }')
done
echo "  largest difference: $worst (same batches, same state: only float summation order differs)"
awk -v w="$worst" 'BEGIN { exit !(w < 0.01) }' || { echo "demo: the resumed loss does not continue" >&2; exit 1; }

# -- 6. the CLI -------------------------------------------------------------------------------
say "cloudckpt ls $RUN"
cloudckpt ls "$RUN"
say "cloudckpt prune $RUN --keep-last 2"
cloudckpt prune "$RUN" --keep-last 2
cloudckpt ls "$RUN"
say "cloudckpt verify $RUN   (newest complete checkpoint, every checksum)"
cloudckpt verify "$RUN"

say "done: stopping the server"
# cleanup() runs on EXIT: stops the server and checks that nothing of this demo is left
