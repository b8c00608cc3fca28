#!/usr/bin/env bash
# Build gitops-sync, the one-shot Argo CD sync the GitOps end-to-end test (tests/e2e/test_gitops.py)
# runs: main.go in this folder over github.com/argoproj/gitops-engine, Argo CD's sync engine, at the
# version go.mod pins (the one Argo CD v3.2 uses), from the Go module proxy.
#
# The binary is cached under <cache>/gitops-sync/bin, keyed on this folder's main.go, go.mod,
# go.sum and the Go version; a warm run takes well under a second, a cold one about 200
# CPU-seconds (3-5 min on 2 cores).
# Kept apart from tests/cluster/build.sh so that changing it never invalidates the cluster build.
#
# Usage: bash tests/e2e/gitops/build.sh [--print-bin | --force]
# The last line of stdout is the binary's path. Details go to <cache>/gitops-sync/build.log.
# When it cannot be built on this machine (no go command, no module proxy) the reason is recorded
# in <cache>/gitops-sync/UNAVAILABLE and it exits 3, so the test skips (outside CI).
#
# Environment: PACKTRAIN_CACHE_DIR, PACKTRAIN_GOTOOLCHAIN, PACKTRAIN_GOSUMDB, GOPROXY and GOFLAGS,
# as in tests/cluster/build.sh (the committed go.sum is the trust anchor).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE_ROOT="${PACKTRAIN_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/packtrain}"
DIR="$CACHE_ROOT/gitops-sync"
BIN="$DIR/bin/gitops-sync"
LOG="$DIR/build.log"
UNAVAILABLE="$DIR/UNAVAILABLE"

FORCE=0
for arg in "$@"; do
  case "$arg" in
    --print-bin) echo "$BIN"; exit 0 ;;
    --force) FORCE=1 ;;
    -h|--help) sed -n '2,17p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "build.sh: unknown argument $arg (try --help)" >&2; exit 2 ;;
  esac
done

mkdir -p "$DIR/bin"
exec 9>"$DIR/.lock"
flock 9

say() { echo "gitops build.sh: $*" >&2; echo "[$(date -u +%FT%TZ)] $*" >>"$LOG"; }
GO_MOD_DIR="$HERE"
BUILD_SCRIPT=tests/e2e/gitops/build.sh
# impossible(), the Go environment and GO_VERSION, shared with tests/cluster/build.sh.
# shellcheck source=../../cluster/go_env.sh
source "$HERE/../../cluster/go_env.sh"

STAMP="$({ echo "gitops-sync $GO_VERSION"; cat "$HERE/main.go" "$HERE/go.mod" "$HERE/go.sum"; } | sha256sum | cut -d' ' -f1)"
if [[ $FORCE == 0 && -x "$BIN" && -f "$DIR/stamp" && "$(cat "$DIR/stamp")" == "$STAMP" ]]; then
  say "gitops-sync: up to date"
  rm -f "$UNAVAILABLE"
  echo "$BIN"
  exit 0
fi

(cd "$HERE" && go mod download >>"$LOG" 2>&1) ||
  impossible "cannot download the modules of tests/e2e/gitops from the Go module proxy (GOPROXY=$(go env GOPROXY)); see $LOG"
say "building gitops-sync (github.com/argoproj/gitops-engine; cold: about 200 CPU-seconds)"
t0=$SECONDS; cpu_mark; c0=$CPU_NOW
rm -f "$DIR/stamp"
(cd "$HERE" && "${GO_BUILD_CONTROLLER[@]}" -ldflags "-s -w" -o "$BIN" . >>"$LOG" 2>&1) ||
  { say "gitops-sync build failed; see $LOG"; exit 1; }
echo "$STAMP" >"$DIR/stamp"
rm -f "$UNAVAILABLE"
cpu_mark
say "gitops-sync built in $((SECONDS - t0)) s, $((CPU_NOW - c0)) CPU-s"
echo "$BIN"
