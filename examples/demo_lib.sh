# examples/demo_lib.sh: the output helpers of examples/demo.sh (sourced; also by the tests).
#
#   say TEXT...              a section title (bold only when stdout is a terminal and NO_COLOR
#                            is unset: no escape codes in a log file or a pipe)
#   explain_status CODE      an exit status in plain words (143 -> stopped by SIGTERM, ...)
#   explain_ranks LOG        one line per rank of a torchrun log's failure summary: its exit
#                            status in plain words (nothing when torchrun printed no summary)
#   pip_step LABEL ARGS...   `$PY -m pip install ARGS`, showing one line per package and a
#                            "still installing" line every 15 s, then the time it took; on
#                            failure, the end of pip's output
# Needs: PY (the interpreter).

say() {
  if [ -t 1 ] && [ -z "${NO_COLOR:-}" ]; then
    printf '\n\033[1m== %s\033[0m\n' "$*"
  else
    printf '\n== %s\n' "$*"
  fi
}

explain_status() {
  local code="$1"
  case "$code" in
    0) echo "finished normally" ;;
    1) echo "a process of the job exited with a non-zero status (torchrun then exits 1, whatever that status was)" ;;
    130) echo "interrupted by Ctrl-C (130 = 128 + 2, SIGINT)" ;;
    137) echo "killed by SIGKILL (137 = 128 + 9), as when a node dies: no chance to save anything" ;;
    143) echo "stopped by SIGTERM (143 = 128 + 15), as a spot preemption or 'kubectl delete pod' does" ;;
    *)
      if [ "$code" -gt 128 ] 2>/dev/null; then
        echo "ended by signal $((code - 128)) ($code = 128 + $((code - 128)))"
      else
        echo "failed with status $code"
      fi ;;
  esac
}

explain_ranks() {
  # torchrun's summary holds "rank      : R (local_rank: R)" and then "exitcode  : C (pid: P)"
  awk '/^ *rank *: *[0-9]+/ { sub(/^ *rank *: */, ""); rank = $1 }
       /^ *exitcode *: *-?[0-9]+/ && rank != "" { sub(/^ *exitcode *: */, ""); print rank, $1; rank = "" }' "$1" \
    | sort -un | while read -r rank code; do
        if [ "$code" -lt 0 ]; then code=$((128 - code)); fi   # torchrun writes -N for signal N
        echo "rank $rank exited with $code: $(explain_status "$code")"
      done
}

pip_step() {
  local label="$1" t0 beat rc log
  shift
  t0=$(date +%s)
  log="$(mktemp "${TMPDIR:-/tmp}/cloudckpt-demo-pip.XXXXXX")"
  echo "  installing $label ..."
  ( while sleep 15; do echo "  ... still installing $label ($(( $(date +%s) - t0 )) s so far)"; done ) &
  beat=$!
  set +e
  "$PY" -m pip install --progress-bar off "$@" 2>&1 | tee "$log" \
    | { grep --line-buffered -E '^(Collecting|Processing|Downloading|Installing collected|Successfully installed)' || true; } \
    | sed -u 's/^/    | /'
  rc=${PIPESTATUS[0]}
  set -e
  kill "$beat" 2>/dev/null || true
  wait "$beat" 2>/dev/null || true
  if [ "$rc" -eq 0 ]; then
    echo "  installed $label in $(( $(date +%s) - t0 )) s"
  else
    echo "  installing $label FAILED (pip exit status $rc); the end of pip's output:" >&2
    tail -20 "$log" | sed 's/^/    | /' >&2
  fi
  rm -f "$log"
  return "$rc"
}
