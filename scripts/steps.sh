# Shared by the one-call GPU scripts (gpu-check.sh, gpu-distill.sh); sourced after PY, OUT and SUMMARY are set.
# this checkout's hispec (an array: `timeout` runs programs, not shell functions)
HISPEC=("$PY" -c 'import sys; from hispec.cli import main; sys.exit(main())')
note() { echo "$*" | tee -a "$SUMMARY"; }
step() {  # step NAME LIMIT_S COMMAND...: run with a time limit, log to $OUT/NAME.log, record the status
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  echo "== $name (limit ${limit}s)" >&2
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  local status=PASS; [ $rc -ne 0 ] && status="FAIL (exit $rc$([ $rc -eq 124 ] && echo ', timed out'))"
  note "$(printf '%-28s %-26s %4ss' "$name" "$status" $(( $(date +%s) - t0 )))"
  [ $rc -ne 0 ] && tail -n 20 "$OUT/$name.log" >&2
  return $rc
}
