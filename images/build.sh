#!/usr/bin/env bash
# Build the three images without a daemon or a registry: localhost/packtrain/{operator,packer,trainer}:dev.
#
#   bash images/build.sh [--force] [operator|packer|trainer ...]
#
# The base is Debian's own packages: mmdebstrap of the release the public python slim images use
# (bookworm) with its python3 and python3-venv, imported as localhost/packtrain/base:bookworm.
# Each Dockerfile takes it as BASE_IMAGE (a release build keeps the public python base) and is
# built by podman with chroot isolation. Dependencies are the hash-locked images/*/requirements.txt.
#
# Everything lives under the cache (images and layers, the locked wheels, stamps, the log):
#   ${PACKTRAIN_CACHE_DIR:-~/.cache/packtrain}/images/{storage,run,tmp,wheels,stamps,build.log}
# An image is rebuilt only when a hash of its inputs changes (Dockerfile, locks, pyproject,
# sources, base, this script); --force rebuilds all. Layers that did not change are reused, and
# images no tag points at any more are pruned. Podman, buildah and mmdebstrap are installed with
# apt when missing (as root on Debian/Ubuntu). When building is impossible on this machine the
# script writes the reason to <cache>/images/UNAVAILABLE and exits 3.
#
# The last line of stdout is the podman storage root: `podman --root <it> images` lists the images.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(dirname "$HERE")"
CACHE_ROOT="${PACKTRAIN_CACHE_DIR:-$HOME/.cache/packtrain}"
CACHE="$CACHE_ROOT/images"
STORE="$CACHE/storage"
LOG="$CACHE/build.log"
SUITE=bookworm
MIRROR="${PACKTRAIN_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
BASE_PACKAGES="python3,python3-venv,ca-certificates"
BASE_TAG="localhost/packtrain/base:$SUITE"
ALL_IMAGES=(operator packer trainer)

force=0
images=()
for arg in "$@"; do
  case "$arg" in
    --force) force=1 ;;
    operator|packer|trainer) images+=("$arg") ;;
    *) echo "usage: bash images/build.sh [--force] [operator|packer|trainer ...]" >&2; exit 2 ;;
  esac
done
[ ${#images[@]} -gt 0 ] || images=("${ALL_IMAGES[@]}")

mkdir -p "$CACHE/stamps" "$CACHE/tmp"
# One build at a time per cache (CI, a test session and a person may start one together).
exec 9>"$CACHE/build.lock"
flock 9
rm -f "$CACHE/UNAVAILABLE"
: >>"$LOG"
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$LOG" >&2; }
impossible() {
  echo "$*" >"$CACHE/UNAVAILABLE"
  echo "images cannot be built on this machine: $*" >&2
  exit 3
}
sha() { sha256sum | cut -c1-64; }
# cpu_mark: what a step cost in CPU seconds.
# shellcheck source=../.ci/cpu_mark.sh
source "$REPO/.ci/cpu_mark.sh"

# --- tools ---------------------------------------------------------------------------------------
missing=()
for tool in podman mmdebstrap; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if [ ${#missing[@]} -gt 0 ]; then
  [ "$(id -u)" = 0 ] || impossible "${missing[*]} missing and not root: install podman buildah mmdebstrap"
  command -v apt-get >/dev/null || impossible "${missing[*]} missing and no apt-get: install podman buildah mmdebstrap"
  log "installing podman buildah mmdebstrap with apt"
  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      podman buildah mmdebstrap uidmap; } >>"$LOG" 2>&1 || impossible "apt-get install podman buildah mmdebstrap failed; see $LOG"
fi
[ "$(id -u)" = 0 ] || impossible "building with chroot isolation and exercising the root filesystems needs root"

# Root-owned storage of our own (kernel overlayfs on the host's filesystem); podman's temporary
# files under the cache too.
export TMPDIR="$CACHE/tmp"
PODMAN=(podman --root "$STORE" --runroot "$CACHE/run" --storage-driver overlay)
"${PODMAN[@]}" info >>"$LOG" 2>&1 || impossible "podman cannot use its storage at $STORE; see $LOG"

# Reproducible: the commit's time and id (when this is a git checkout).
SOURCE_DATE_EPOCH="$(git -C "$REPO" log -1 --format=%ct 2>/dev/null || echo 0)"
REVISION="$(git -C "$REPO" rev-parse HEAD 2>/dev/null || echo unknown)"
VERSION="$(sed -n 's/^version = "\(.*\)"/\1/p' "$REPO/pyproject.toml" | head -1)"
export SOURCE_DATE_EPOCH

# The host's CA bundle is mounted over the base's in every RUN step (never into a layer): the
# build reaches PyPI the way this machine does, through whatever TLS proxy it trusts. Debian's
# pip reads the system bundle.
CA_BUNDLE="${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}"
[ -f "$CA_BUNDLE" ] || impossible "no CA bundle at $CA_BUNDLE (set PIP_CERT)"

# --- the base ------------------------------------------------------------------------------------
base_key="$(printf '%s\n' "$SUITE" "$MIRROR" "$BASE_PACKAGES" "$(sed -n '/^# --- the base/,/^# --- the images/p' "$0")" | sha)"
if [ "$force" = 1 ] || [ "$(cat "$CACHE/stamps/base.key" 2>/dev/null)" != "$base_key" ] \
    || ! "${PODMAN[@]}" image exists "$BASE_TAG"; then
  log "base: mmdebstrap $SUITE + $BASE_PACKAGES"
  t0=$SECONDS
  cpu_mark
  c0=$CPU_NOW
  tarball="$CACHE/tmp/base-$SUITE.tar"
  rm -f "$tarball"
  # minbase, no docs, man pages or locales, no apt lists: what a slim image leaves out too.
  mmdebstrap --variant=minbase --include="$BASE_PACKAGES" \
      --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
      --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
      --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/lintian/*' \
      --aptopt='Acquire::Retries "3"' \
      --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/* "$1"/var/log/*' \
      "$SUITE" "$tarball" "$MIRROR" >>"$LOG" 2>&1 \
    || { rm -f "$tarball"; impossible "mmdebstrap $SUITE from $MIRROR failed; see $LOG"; }
  # The config the public python image has too: PATH, a UTF-8 locale, python3 as the command.
  "${PODMAN[@]}" import --change 'CMD ["python3"]' --change 'ENV LANG=C.UTF-8' \
      --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
      "$tarball" "$BASE_TAG" >>"$LOG" 2>&1
  rm -f "$tarball"
  echo "$base_key" >"$CACHE/stamps/base.key"
  rm -f "$CACHE"/stamps/{operator,packer,trainer}.key
  cpu_mark
  log "base: done in $((SECONDS - t0)) s, $((CPU_NOW - c0)) CPU-s"
fi

# --- the images ----------------------------------------------------------------------------------
inputs_key() {
  local image=$1
  {
    echo "$base_key $SOURCE_DATE_EPOCH $REVISION $VERSION"
    cat "$0" "$HERE/$image/Dockerfile" "$HERE/$image/Dockerfile.dockerignore" \
        "$HERE/$image/requirements.txt" "$HERE/requirements-build.txt" "$HERE/lock_layers.py" \
        "$REPO/pyproject.toml" "$REPO/README.md"
    (cd "$REPO" && find core packer trainer operator -type f ! -name '*.pyc' ! -path '*/__pycache__/*' -print0 \
       | sort -z | xargs -0 sha256sum)
  } | sha
}

# What the dependency layer is made of: when it matches, the build reuses that layer.
deps_key() {
  {
    echo "$base_key"
    git -C "$REPO" log -1 --format=%ct -- "images/$1/requirements.txt" 2>/dev/null || true
    cat "$HERE/$1/Dockerfile" "$HERE/$1/requirements.txt" "$HERE/requirements-build.txt" "$HERE/lock_layers.py"
  } | sha
}

# pip's HTTP cache does not persist through every proxy, so the locked wheels are downloaded
# here once (hash-checked; this machine's Python and glibc pick the files the image's would) and
# handed to the build read-only; it installs them with no index.
WHEELS="$(realpath -m "$CACHE/wheels")"  # absolute: fetch_wheels runs pip from /
PY="${PYTHON:-python3}"
fetch_wheels() {
  mkdir -p "$WHEELS"
  # From /: run in the checkout, `-m` would put its operator/ before the standard library's operator.
  (cd / && "$PY" -m pip download -q --disable-pip-version-check --require-hashes --no-deps --only-binary=:all: \
      -r "$HERE/$1/requirements.txt" -d "$WHEELS") >>"$LOG" 2>&1
}

for image in "${images[@]}"; do
  tag="localhost/packtrain/$image:dev"
  key="$(inputs_key "$image")"
  if [ "$force" = 0 ] && [ "$(cat "$CACHE/stamps/$image.key" 2>/dev/null)" = "$key" ] \
      && "${PODMAN[@]}" image exists "$tag"; then
    log "$image: up to date ($tag)"
    continue
  fi
  # When the dependency layers are cached (same base, Dockerfile and locks), only the small source
  # layers are built again and no wheel is needed. Otherwise the trainer needs its ~4 GB of wheels,
  # its ~7 GB of layers, and, while it commits one (the container's files, a tar, the layer), twice
  # the largest (~1.1 GB, images/lock_layers.py): 14 GB. Keep 8 GB for everyone else.
  deps="$(deps_key "$image")"
  fresh_deps=0
  if [ "$(cat "$CACHE/stamps/$image.deps" 2>/dev/null)" != "$deps" ] || ! "${PODMAN[@]}" image exists "$tag"; then
    fresh_deps=1
  fi
  need_gb=12
  if [ "$image" = trainer ] && [ "$fresh_deps" = 1 ]; then
    need_gb=22
  fi
  free_gb=$(df --output=avail -BG "$CACHE" | tail -1 | tr -dc 0-9)
  [ "$free_gb" -ge "$need_gb" ] || impossible "building $image needs ${need_gb} GB free on $CACHE's disk, $free_gb GB are"
  log "$image: building $tag"
  t0=$SECONDS
  cpu_mark
  c0=$CPU_NOW
  rm -f "$CACHE/stamps/$image.key"
  # The dependency layer's epoch is its lock's commit time: a new commit alone does not rebuild it.
  lock_epoch="$(git -C "$REPO" log -1 --format=%ct -- "images/$image/requirements.txt" 2>/dev/null || true)"
  lock_epoch="${lock_epoch:-0}"
  # /mnt is an empty folder in both bases, so the mount leaves no trace in a layer. The build
  # arguments are the same whether or not wheels were fetched, so cached dependency layers match.
  mkdir -p "$WHEELS"
  wheel_args=(-v "$WHEELS:/mnt:ro" --build-arg PIP_FIND_LINKS=/mnt --build-arg PIP_NO_INDEX=1)
  if [ "$fresh_deps" = 1 ] && ! fetch_wheels "$image"; then
    log "$image: downloading the wheels ahead failed (see $LOG); the build fetches them itself"
    wheel_args=()
  fi
  "${PODMAN[@]}" build --isolation chroot --pull=never --layers \
      -f "$HERE/$image/Dockerfile" --ignorefile "$HERE/$image/Dockerfile.dockerignore" \
      --build-arg "BASE_IMAGE=$BASE_TAG" --build-arg "SOURCE_DATE_EPOCH=$SOURCE_DATE_EPOCH" \
      --build-arg "VERSION=$VERSION" --build-arg "REVISION=$REVISION" \
      --build-arg "LOCK_SOURCE_DATE_EPOCH=$lock_epoch" --build-arg "STAGE_NONCE=$(date +%s%N)" \
      -v "$CA_BUNDLE:/etc/ssl/certs/ca-certificates.crt:ro" "${wheel_args[@]}" \
      -t "$tag" "$REPO" >>"$LOG" 2>&1 \
    || { echo "building $image failed; the end of $LOG:" >&2; tail -30 "$LOG" >&2; exit 1; }
  echo "$key" >"$CACHE/stamps/$image.key"
  echo "$deps" >"$CACHE/stamps/$image.deps"
  # The replaced image and the builder stages' layers: nothing points at them any more.
  "${PODMAN[@]}" image prune -f >>"$LOG" 2>&1 || true
  cpu_mark
  log "$image: built in $((SECONDS - t0)) s, $((CPU_NOW - c0)) CPU-s"
done
# The wheels served only the dependency layers just built (the trainer's are ~4 GB): a lock change
# downloads its own.
rm -rf "$WHEELS"

for image in "${images[@]}"; do
  size="$("${PODMAN[@]}" image inspect --format '{{.Size}}' "localhost/packtrain/$image:dev")"
  log "$(printf '%-9s %6d MB  localhost/packtrain/%s:dev' "$image" $((size / 1000000)) "$image")"
done
echo "$STORE"
