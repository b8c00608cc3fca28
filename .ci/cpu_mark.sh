# cpu_mark: CPU_NOW = the CPU seconds the finished children of the calling shell have used so far,
# so a step's log line can say what it cost as well as how long it took on a machine others share.
# Sourced by .ci/run, images/build.sh and tests/cluster/go_env.sh. It reads bash's `times` in the
# calling shell: in a command substitution it would run in a fork and count from zero.
cpu_mark() {
  local file
  file="$(mktemp)"
  times >"$file"
  CPU_NOW="$(awk 'NR == 2 { n = 0; for (i = 1; i <= 2; i++) { split($i, t, /[ms]/); n += t[1] * 60 + t[2] } printf "%d", n }' "$file")"
  rm -f "$file"
}
