# The Go environment of the build scripts, sourced by tests/cluster/build.sh and
# tests/e2e/gitops/build.sh: module and build caches under the packtrain cache, the toolchain and
# checksum policy, static binaries, and how a build that cannot happen here is recorded.
#
# The sourcing script sets CACHE_ROOT, LOG, UNAVAILABLE, GO_MOD_DIR (the folder whose go.mod picks
# the toolchain) and BUILD_SCRIPT (named in messages), and defines say(); this sets GO_VERSION.
# No cache key hashes this file: the keys hash GO_VERSION and each build's own inputs.

# Record why a build cannot happen on this machine, so the test fixture can skip loudly
# rather than fail; anything else that goes wrong is a real error.
impossible() {
  printf '%s\n' "$*" >"$UNAVAILABLE"
  say "CANNOT BUILD: $* (recorded in $UNAVAILABLE)"
  exit 3
}

export PATH="$PATH:/usr/local/go/bin"
command -v go >/dev/null || impossible "no 'go' command on PATH; install Go >= 1.26 (https://go.dev/dl) and rerun bash $BUILD_SCRIPT"
export GOMODCACHE="$CACHE_ROOT/go/mod"
export GOCACHE="$CACHE_ROOT/go/build"
export GOTOOLCHAIN="${PACKTRAIN_GOTOOLCHAIN:-auto}"
export GOSUMDB="${PACKTRAIN_GOSUMDB:-off}"
export GOFLAGS="${GOFLAGS:-} -mod=mod -buildvcs=false"
# Every build runs as "${GO_BUILD[@]}" (or GO_BUILD_CONTROLLER) -ldflags ... -o ... PACKAGES. The
# compile flags (GOFLAGS cannot hold them: its entries are split at spaces), measured from an empty
# build cache on JobSet and by rendering the chart 15 times with helm:
#   -dwarf=false  -ldflags -s -w strip DWARF from every binary anyway; not generating it: 187 -> 165 CPU-s
#   -l            no inlining: 174 -> 144 CPU-s to build (-17%), but 1.04 -> 1.40 CPU-s to run (+35%).
# So only the add-on controllers (Kueue, JobSet, Trainer v2, the training-operator, the GitOps engine),
# which sit mostly idle between the few events of a test, are built without inlining; the API server,
# etcd, kubectl and helm, which the tests keep busy, are built as usual. Tried and left out: GOGC=400
# (GOMEMLIMIT=3GiB) for the compiler, 1270 -> 1309 CPU-s for all the Go builds of a cold CI run.
GO_BUILD=(go build -p 2 -trimpath "-gcflags=all=-dwarf=false")
GO_BUILD_CONTROLLER=(go build -p 2 -trimpath "-gcflags=all=-dwarf=false -l")

# cpu_mark: what a step cost in CPU seconds.
# shellcheck source=../../.ci/cpu_mark.sh
source "$(dirname "${BASH_SOURCE[0]}")/../../.ci/cpu_mark.sh"
export CGO_ENABLED=0
GO_VERSION="$(cd "$GO_MOD_DIR" && go env GOVERSION)" ||
  impossible "the go command cannot provide the toolchain the build needs (GOTOOLCHAIN=$GOTOOLCHAIN); see $LOG"
