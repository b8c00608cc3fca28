#!/usr/bin/env bash
# Build the local Kubernetes control plane the cluster tests run against.
#
# Everything comes from the Go module proxy: kube-apiserver, kube-controller-manager,
# kube-scheduler and kubectl from k8s.io/kubernetes, etcd from go.etcd.io/etcd/server/v3/embed,
# helm from helm.sh/helm/v3, the Kubeflow training-operator from its module, and the Kubeflow
# CRDs copied out of their modules. The add-ons the end-to-end tests run (skipped with
# --no-addons): Kueue's controller from sigs.k8s.io/kueue, the Kubeflow Trainer v2 controller and
# the JobSet controller it drives from github.com/kubeflow/trainer/v2 and sigs.k8s.io/jobset
# (versions in tests/cluster/go/{kueue,trainer}/go.mod), their CRDs and the torch-distributed
# ClusterTrainingRuntime copied out of the same modules into the add-on dir (installed only by the
# tests that use them), and Prometheus from Debian's package (apt-get download + dpkg -x).
# Results go to a cache keyed by the Kubernetes version, and a component is rebuilt only when its
# inputs change, so a warm run takes well under a second.
#
# Usage: bash tests/cluster/build.sh [--print-bin-dir | --print-crd-dir | --print-addon-dir |
#                                     --update-gomod | --force] [--no-training-operator] [--no-addons]
#                                    [--ready-file=PATH]
# --ready-file=PATH is touched once the control plane itself (Kubernetes, etcd, helm, the
# training-operator, the CRDs) is there, while the add-ons still build under the lock (.ci/run
# starts the first cluster tests then; a test that needs an add-on runs this script and waits).
# --update-gomod regenerates tests/cluster/go/kube/go.mod (done automatically when K8S_VERSION
# changes); --force rebuilds everything (e.g. after changing the ldflags below).
# The last line of stdout is the bin directory. Details go to <cache>/build.log.
# An add-on that cannot be had on this machine (no Debian package for Prometheus) is recorded in
# <cache>/UNAVAILABLE-<name>, so only the tests that need it skip (outside CI).
#
# Environment:
#   PACKTRAIN_CACHE_DIR    cache root (default: ${XDG_CACHE_HOME:-~/.cache}/packtrain)
#   PACKTRAIN_GOTOOLCHAIN  passed as GOTOOLCHAIN (default "auto": when the installed Go is older
#                          than a go.mod's `go` line, the go command fetches a newer toolchain
#                          from the module proxy)
#   PACKTRAIN_GOSUMDB      passed as GOSUMDB (default "off": the committed go.sum files and the
#                          pinned sums below are the trust anchor, so runners that reach only a
#                          module proxy work too)
#   GOPROXY, GOFLAGS       honoured as usual; builds use at most 2 parallel jobs (-p 2)
set -euo pipefail

K8S_VERSION=v1.37.2
HELM_VERSION=v3.22.0
TRAINING_OPERATOR_VERSION=v1.9.3
TRAINER_VERSION=v2.1.0
# h1: sums of the modules we only copy CRDs from (verified after download).
TRAINING_OPERATOR_SUM="h1:aaSHqskOtCY8Dn8sVd+l9p5XAczW6O0nYMPjVLAw/lc="
TRAINER_SUM="h1:jRABD9ZYToamNH2atHze3L/VC/v6KCAqUEqsOQOjVTg="

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
GO_SRC="$HERE/go"
CACHE_ROOT="${PACKTRAIN_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/packtrain}"
CLUSTER_DIR="$CACHE_ROOT/cluster/$K8S_VERSION"
BIN="$CLUSTER_DIR/bin"
CRDS="$CLUSTER_DIR/crds"
STAMPS="$CLUSTER_DIR/stamps"
LOG="$CLUSTER_DIR/build.log"
UNAVAILABLE="$CLUSTER_DIR/UNAVAILABLE"
ADDONS="$CLUSTER_DIR/addons"

WITH_TRAINING_OPERATOR=1
WITH_ADDONS=1
READY_FILE=
UPDATE_GOMOD=0
FORCE=0
for arg in "$@"; do
  case "$arg" in
    --print-bin-dir) echo "$BIN"; exit 0 ;;
    --print-crd-dir) echo "$CRDS"; exit 0 ;;
    --print-addon-dir) echo "$ADDONS"; exit 0 ;;
    --update-gomod) UPDATE_GOMOD=1 ;;
    --force) FORCE=1 ;;
    --no-training-operator) WITH_TRAINING_OPERATOR=0 ;;
    --no-addons) WITH_ADDONS=0 ;;
    --ready-file=*) READY_FILE="${arg#--ready-file=}" ;;
    -h|--help) sed -n '2,36p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "build.sh: unknown argument $arg (try --help)" >&2; exit 2 ;;
  esac
done

mkdir -p "$BIN" "$CRDS" "$STAMPS"
exec 9>"$CLUSTER_DIR/.lock"
if ! flock -n 9; then
  echo "build.sh: another build holds $CLUSTER_DIR/.lock; waiting for it" >&2
  flock 9
fi
[[ $FORCE == 1 ]] && rm -f "$STAMPS"/*

say() { echo "build.sh: $*" >&2; echo "[$(date -u +%FT%TZ)] $*" >>"$LOG"; }
run() { echo "[$(date -u +%FT%TZ)] \$ $*" >>"$LOG"; "$@" >>"$LOG" 2>&1; }
GO_MOD_DIR="$GO_SRC/kube"
BUILD_SCRIPT=tests/cluster/build.sh
# impossible(), the Go environment and GO_VERSION, shared with tests/e2e/gitops/build.sh.
# shellcheck source=go_env.sh
source "$HERE/go_env.sh"

# download MODULE@VERSION: print the module's directory and check its sum when one is pinned.
download() {
  local json dir sum
  json="$(go mod download -json "$1" 2>>"$LOG")" ||
    impossible "cannot download $1 from the Go module proxy (GOPROXY=$(go env GOPROXY)); see $LOG"
  dir="$(sed -n 's/^\t"Dir": "\(.*\)",$/\1/p' <<<"$json")"
  sum="$(sed -n 's/^\t"Sum": "\(.*\)",$/\1/p' <<<"$json")"
  if [[ -n "${2:-}" && "$2" != "$sum" ]]; then
    say "checksum mismatch for $1: got $sum, build.sh pins $2"
    exit 1
  fi
  echo "$dir"
}

# fetch_modules DIR: download a module's dependencies first, so that an unreachable proxy is
# reported as "cannot build here" rather than as a compile error.
fetch_modules() {
  (cd "$1" && run go mod download) ||
    impossible "cannot download the modules of $1 from the Go module proxy (GOPROXY=$(go env GOPROXY)); see $LOG"
}

# stamp NAME INPUT...: a digest of what a component was built from.
stamp() {
  local name="$1"; shift
  { echo "$name $GO_VERSION"; printf '%s\n' "$@"; } | sha256sum | cut -d' ' -f1
}
fresh() { [[ -f "$STAMPS/$1" && "$(cat "$STAMPS/$1")" == "$2" ]]; }
bins_present() { local b; for b in "$@"; do [[ -x "$BIN/$b" ]] || return 1; done; }
module_files() { find "$1" -type f \( -name '*.go' -o -name go.mod -o -name go.sum \) -print0 | sort -z | xargs -0 cat; }

# --- Kubernetes + etcd -------------------------------------------------------------------------
# k8s.io/kubernetes replaces its staging modules (k8s.io/api, ...) with ./staging paths, which
# only resolve inside its own repository. Our wrapper go.mod replaces each of them with the
# published v0.Y.Z instead; the list is generated from the downloaded go.mod, never kept by hand.
gen_kube_gomod() {
  local gomod staging_version etcd_version modfile="$GO_SRC/kube/go.mod"
  gomod="$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" 2>>"$LOG" |
    sed -n 's/^\t"GoMod": "\(.*\)",$/\1/p')"
  [[ -f "$gomod" ]] || impossible "cannot download k8s.io/kubernetes@$K8S_VERSION from the Go module proxy; see $LOG"
  staging_version="v0.${K8S_VERSION#v1.}"
  etcd_version="$(awk '$1 == "go.etcd.io/etcd/server/v3" { print $2 }' "$gomod")"
  say "generating $modfile for k8s.io/kubernetes $K8S_VERSION (staging $staging_version, etcd $etcd_version)"
  {
    echo "// Generated by tests/cluster/build.sh --update-gomod from k8s.io/kubernetes@$K8S_VERSION's go.mod."
    echo "module packtrain.dev/tests/cluster/kube"
    echo
    awk '$1 == "go" { print; exit }' "$gomod"
    echo
    echo "require ("
    echo "	go.etcd.io/etcd/server/v3 $etcd_version"
    echo "	k8s.io/kubernetes $K8S_VERSION"
    echo ")"
    echo
    echo "tool ("
    for cmd in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
      echo "	k8s.io/kubernetes/cmd/$cmd"
    done
    echo ")"
    echo
    echo "replace ("
    sed -n 's#^[[:space:]]*\(k8s\.io/[^[:space:]]*\) => \./staging/.*#\1#p' "$gomod" | sort -u |
      while read -r mod; do echo "	$mod => $mod $staging_version"; done
    echo ")"
  } >"$modfile"
  (cd "$GO_SRC/kube" && rm -f go.sum && run go mod tidy) ||
    impossible "go mod tidy failed for the Kubernetes wrapper module (module proxy unreachable?); see $LOG"
}

if [[ $UPDATE_GOMOD == 1 ]] || ! head -1 "$GO_SRC/kube/go.mod" 2>/dev/null | grep -q "k8s.io/kubernetes@$K8S_VERSION's"; then
  gen_kube_gomod
fi

# Version ldflags as hack/lib/version.sh sets them, so the server reports its real version.
# The build date is the release's publication time (from the module's .info), so rebuilds are
# reproducible; the commit is recorded when the proxy reports the module's origin.
kube_ldflags() {
  local info time commit major minor flags="-s -w" pkg kv
  info="$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" 2>>"$LOG" |
    sed -n 's/^\t"Info": "\(.*\)",$/\1/p')"
  time="$(sed -n 's/.*"Time": *"\([^"]*\)".*/\1/p' "$info" | sed 's/\.[0-9]*Z$/Z/')"
  commit="$(sed -n 's/.*"Hash": *"\([0-9a-f]*\)".*/\1/p' "$info")"
  major="${K8S_VERSION#v}"; major="${major%%.*}"
  minor="${K8S_VERSION#v*.}"; minor="${minor%%.*}"
  local -a kvs=("gitVersion=$K8S_VERSION" "gitMajor=$major" "gitMinor=$minor" "gitTreeState=clean" "buildDate=$time")
  [[ -n "$commit" ]] && kvs+=("gitCommit=$commit")
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    for kv in "${kvs[@]}"; do flags+=" -X $pkg.$kv"; done
  done
  echo "$flags"
}

KUBE_BINS=(kube-apiserver kube-controller-manager kube-scheduler kubectl etcd)
KUBE_STAMP="$(stamp kube "$K8S_VERSION" "$(module_files "$GO_SRC/kube")")"
if fresh kube "$KUBE_STAMP" && bins_present "${KUBE_BINS[@]}"; then
  say "kubernetes $K8S_VERSION + etcd: up to date"
else
  say "building kube-apiserver, kube-controller-manager, kube-scheduler, kubectl $K8S_VERSION and etcd (cold: ~12 min on 2 cores)"
  fetch_modules "$GO_SRC/kube"
  t0=$SECONDS; cpu_mark; c0=$CPU_NOW
  (cd "$GO_SRC/kube" && run "${GO_BUILD[@]}" -ldflags "$(kube_ldflags)" -o "$BIN/" \
      k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
      k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl ./etcd) ||
    { say "Kubernetes build failed; see $LOG"; exit 1; }
  echo "$KUBE_STAMP" >"$STAMPS/kube"
  cpu_mark
  say "kubernetes + etcd built in $((SECONDS - t0)) s, $((CPU_NOW - c0)) CPU-s"
fi

# --- helm ----------------------------------------------------------------------------------------
HELM_STAMP="$(stamp helm "$HELM_VERSION" "$(module_files "$GO_SRC/helm")")"
if fresh helm "$HELM_STAMP" && [[ -x "$BIN/helm" ]]; then
  say "helm $HELM_VERSION: up to date"
else
  say "building helm $HELM_VERSION"
  fetch_modules "$GO_SRC/helm"
  t0=$SECONDS; cpu_mark; c0=$CPU_NOW
  (cd "$GO_SRC/helm" && run "${GO_BUILD[@]}" \
      -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION -X helm.sh/helm/v3/internal/version.gitTreeState=clean" \
      -o "$BIN/helm" helm.sh/helm/v3/cmd/helm) ||
    { say "helm build failed; see $LOG"; exit 1; }
  echo "$HELM_STAMP" >"$STAMPS/helm"
  cpu_mark
  say "helm built in $((SECONDS - t0)) s, $((CPU_NOW - c0)) CPU-s"
fi

# --- Kubeflow training-operator (optional) -------------------------------------------------------
if [[ $WITH_TRAINING_OPERATOR == 1 ]]; then
  TO_STAMP="$(stamp training-operator "$TRAINING_OPERATOR_VERSION" "$(module_files "$GO_SRC/kubeflow")")"
  if fresh training-operator "$TO_STAMP" && [[ -x "$BIN/training-operator" ]]; then
    say "training-operator $TRAINING_OPERATOR_VERSION: up to date"
  else
    say "building training-operator $TRAINING_OPERATOR_VERSION"
    fetch_modules "$GO_SRC/kubeflow"
    t0=$SECONDS; cpu_mark; c0=$CPU_NOW
    (cd "$GO_SRC/kubeflow" && run "${GO_BUILD_CONTROLLER[@]}" -ldflags "-s -w" -o "$BIN/training-operator" \
        github.com/kubeflow/training-operator/cmd/training-operator.v1) ||
      { say "training-operator build failed; see $LOG"; exit 1; }
    echo "$TO_STAMP" >"$STAMPS/training-operator"
    cpu_mark
    say "training-operator built in $((SECONDS - t0)) s, $((CPU_NOW - c0)) CPU-s"
  fi
fi

# --- CRDs, copied from their modules -------------------------------------------------------------
CRD_STAMP="$(stamp crds "$TRAINING_OPERATOR_VERSION $TRAINING_OPERATOR_SUM" "$TRAINER_VERSION $TRAINER_SUM")"
if fresh crds "$CRD_STAMP"; then
  say "CRDs: up to date"
else
  to_dir="$(download "github.com/kubeflow/training-operator@$TRAINING_OPERATOR_VERSION" "$TRAINING_OPERATOR_SUM")"
  trainer_dir="$(download "github.com/kubeflow/trainer/v2@$TRAINER_VERSION" "$TRAINER_SUM")"
  rm -rf "$CRDS" && mkdir -p "$CRDS/training-operator" "$CRDS/trainer"
  cp "$to_dir/manifests/base/crds/kubeflow.org_pytorchjobs.yaml" "$CRDS/training-operator/"
  cp "$trainer_dir"/manifests/base/crds/trainer.kubeflow.org_*.yaml "$CRDS/trainer/"
  chmod -R u+w "$CRDS"
  echo "$CRD_STAMP" >"$STAMPS/crds"
  say "CRDs copied to $CRDS"
fi

[[ -z $READY_FILE ]] || touch "$READY_FILE"

# --- add-ons for the end-to-end tests: Kueue, Trainer v2 + JobSet, Prometheus ------------------
mod_info() { (cd "$GO_SRC/$1" && go list -m -f "{{.$3}}" "$2" 2>>"$LOG"); }
# mod_dir WRAPPER MODULE: the source folder of the version of MODULE that WRAPPER requires,
# downloaded again when the module cache no longer holds it (a binary can be up to date while
# its sources are gone, and `go list` then names no folder).
mod_dir() {
  local version dir
  version="$(mod_info "$1" "$2" Version)"
  dir="$(cd "$GO_SRC/$1" && download "$2@$version")"
  [[ -n "$dir" && -d "$dir" ]] || { say "cannot find the sources of $2@$version; see $LOG"; exit 1; }
  echo "$dir"
}

# build_tool NAME WRAPPER PACKAGE MODULE [VERSION_VAR]: build PACKAGE (of MODULE, required by the
# wrapper module tests/cluster/go/WRAPPER) into $BIN/NAME, with VERSION_VAR (a string variable of
# MODULE) set to MODULE's version; rebuilt when the wrapper's go.mod/go.sum change.
build_tool() {
  local name="$1" wrapper="$2" pkg="$3" module="$4" version_var="${5:-}" st version ldflags="-s -w"
  st="$(stamp "$name" "$version_var" "$(module_files "$GO_SRC/$wrapper")")"
  if fresh "$name" "$st" && [[ -x "$BIN/$name" ]]; then
    say "$name: up to date"
    return
  fi
  fetch_modules "$GO_SRC/$wrapper"
  version="$(mod_info "$wrapper" "$module" Version)"
  [[ -n "$version_var" ]] && ldflags+=" -X $version_var=$version"
  say "building $name from $module $version"
  t0=$SECONDS; cpu_mark; c0=$CPU_NOW
  (cd "$GO_SRC/$wrapper" && run "${GO_BUILD_CONTROLLER[@]}" -ldflags "$ldflags" -o "$BIN/$name" "$pkg") ||
    { say "$name build failed; see $LOG"; exit 1; }
  echo "$st" >"$STAMPS/$name"
  cpu_mark
  say "$name $version built in $((SECONDS - t0)) s, $((CPU_NOW - c0)) CPU-s"
}

# Debian's prometheus package: the candidate version apt knows (after `apt-get update` when it knows
# none and we are root), downloaded and unpacked into the cache; fetched again when it changes.
prometheus_candidate() {
  apt-cache policy prometheus 2>/dev/null | awk '$1 == "Candidate:" && $2 != "(none)" { print $2 }'
}
prometheus_unavailable() {
  if [[ -x "$BIN/prometheus" ]]; then
    say "prometheus: keeping the cached one ($1)"
  else
    echo "$1" >"$CLUSTER_DIR/UNAVAILABLE-prometheus"
    say "CANNOT FETCH prometheus: $1 (recorded in $CLUSTER_DIR/UNAVAILABLE-prometheus)"
  fi
}
fetch_prometheus() {
  local version deb dest="$CACHE_ROOT/prometheus" st
  rm -f "$CLUSTER_DIR/UNAVAILABLE-prometheus"
  if ! command -v apt-get >/dev/null || ! command -v dpkg >/dev/null; then
    prometheus_unavailable "no apt-get/dpkg on this machine to fetch Debian's prometheus package"
    return
  fi
  version="$(prometheus_candidate)"
  if [[ -z "$version" && "$(id -u)" == 0 ]]; then
    run apt-get update -q || true
    version="$(prometheus_candidate)"
  fi
  if [[ -z "$version" ]]; then
    prometheus_unavailable "apt knows no 'prometheus' package (run apt-get update as root)"
    return
  fi
  st="$(stamp prometheus "$version")"
  if fresh prometheus "$st" && bins_present prometheus promtool; then
    say "prometheus $version (Debian): up to date"
    return
  fi
  say "fetching Debian's prometheus $version"
  t0=$SECONDS; cpu_mark; c0=$CPU_NOW
  rm -rf "$dest" && mkdir -p "$dest/deb"
  (cd "$dest/deb" && run apt-get download "prometheus=$version") ||
    { prometheus_unavailable "apt-get download prometheus=$version failed; see $LOG"; return; }
  deb="$(ls "$dest"/deb/prometheus_*.deb)"
  run dpkg -x "$deb" "$dest/root" || { say "dpkg -x $deb failed; see $LOG"; exit 1; }
  cp "$dest/root/usr/bin/prometheus" "$dest/root/usr/bin/promtool" "$BIN/"
  echo "$st" >"$STAMPS/prometheus"
  cpu_mark
  say "prometheus $version fetched in $((SECONDS - t0)) s, $((CPU_NOW - c0)) CPU-s"
}

if [[ $WITH_ADDONS == 1 ]]; then
  build_tool kueue kueue sigs.k8s.io/kueue/cmd/kueue sigs.k8s.io/kueue sigs.k8s.io/kueue/pkg/version.GitVersion
  build_tool trainer-controller-manager trainer github.com/kubeflow/trainer/v2/cmd/trainer-controller-manager \
    github.com/kubeflow/trainer/v2
  build_tool jobset trainer sigs.k8s.io/jobset sigs.k8s.io/jobset sigs.k8s.io/jobset/pkg/version.GitVersion
  ADDON_STAMP="$(stamp addons "$(cat "$GO_SRC/kueue/go.sum" "$GO_SRC/trainer/go.sum")")"
  if fresh addons "$ADDON_STAMP" && [[ -d "$ADDONS/kueue/crds" ]]; then
    say "add-on CRDs and runtimes: up to date"
  else
    built_trainer="$(mod_info trainer github.com/kubeflow/trainer/v2 Version)"
    [[ "$built_trainer" == "$TRAINER_VERSION" ]] || {
      say "tests/cluster/go/trainer/go.mod requires trainer $built_trainer, but TRAINER_VERSION is $TRAINER_VERSION"
      exit 1
    }
    kueue_dir="$(mod_dir kueue sigs.k8s.io/kueue)"
    jobset_dir="$(mod_dir trainer sigs.k8s.io/jobset)"
    trainer_dir="$(mod_dir trainer github.com/kubeflow/trainer/v2)"
    rm -rf "$ADDONS" && mkdir -p "$ADDONS/kueue/crds" "$ADDONS/jobset/crds" "$ADDONS/jobset-webhooks" \
      "$ADDONS/trainer/runtimes"
    cp "$kueue_dir"/config/components/crd/bases/*.yaml "$ADDONS/kueue/crds/"
    cp "$jobset_dir"/config/components/crd/bases/*.yaml "$ADDONS/jobset/crds/"
    cp "$jobset_dir/config/components/webhook/manifests.yaml" "$ADDONS/jobset-webhooks/"
    cp "$trainer_dir/manifests/base/runtimes/torch_distributed.yaml" "$ADDONS/trainer/runtimes/"
    chmod -R u+w "$ADDONS"
    echo "$ADDON_STAMP" >"$STAMPS/addons"
    say "add-on CRDs and runtimes copied to $ADDONS"
  fi
  fetch_prometheus
fi

rm -f "$UNAVAILABLE"
echo "$BIN"
