#!/usr/bin/env bash
# Wheels for the GPU benchmark on a machine without internet: run this where a package index is
# reachable, copy DIR (`wheels/` at the repository root: git-ignored, what device_run.sh installs)
# with the checkout, then run `bash tests/bench/device_run.sh` there.
#
# The GPU machine has Python 3.12 and its own torch (with torch's dependencies) but a transformers
# older than the trainer's model code, and no pydantic or pyarrow. So this fetches, for CPython
# 3.12 on manylinux x86_64 (whatever Python runs this script), transformers at pyproject's floor or
# newer, pydantic, pyarrow and nvidia-ml-py with their dependencies, and leaves out what the
# machine's torch already brings (torch, nvidia-*, triton, sympy, networkx, jinja2, filelock,
# fsspec) and what no import of the benchmark reaches (the typer/rich command-line tools, hf-xet
# downloads). numpy (a dependency of the machine's own transformers) and Pillow (the model-spec
# code imports PIL; torchvision brings it) are added only while the folder stays within budget.
#
# What is copied beside the checkout is limited to 64 MiB, so the total is printed and checked
# against BUDGET_MIB (62). pyarrow is most of it: 17.x is 38 MiB for cp312, 26.x is 52 MiB; any
# release >= 16 reads NumPy 2 arrays, which is all the benchmark needs of it.
#
#   bash tests/bench/fetch_wheels.sh wheels            # PYTHON=... BUDGET_MIB=... to override
set -euo pipefail

DIR=${1:?usage: bash tests/bench/fetch_wheels.sh DIR}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PYTHON=$(command -v "${PYTHON:-python3}") || { echo "${PYTHON:-python3}: not found" >&2; exit 2; }
[[ $PYTHON == /* ]] || PYTHON=$PWD/$PYTHON  # the downloads run from a scratch folder
BUDGET_MIB=${BUDGET_MIB:-62}
PYARROW=${PYARROW:-"pyarrow>=16,<18"}
TARGET=(--only-binary :all: --python-version 3.12 --implementation cp --abi cp312
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

# The requirement lines as pyproject.toml states them (transformers' floor is the trainer's).
requirement() { grep -oE "\"$1[<>=!~][^\"]*\"" "$ROOT/pyproject.toml" | head -1 | tr -d '"'; }
TRANSFORMERS=$(requirement transformers)
PYDANTIC=$(requirement pydantic)
NVML=$(requirement nvidia-ml-py)
[[ -n $TRANSFORMERS && -n $PYDANTIC && -n $NVML ]] || { echo "pyproject.toml: requirement not found" >&2; exit 2; }

mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
rm -f "$DIR"/*.whl
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
cd "$STAGE"  # not the checkout: its top-level `operator` package would shadow the standard library's
echo "fetching $TRANSFORMERS $PYDANTIC $PYARROW $NVML (+ dependencies) for cp312 manylinux x86_64"
"$PYTHON" -m pip download --quiet --disable-pip-version-check "${TARGET[@]}" -d "$STAGE" \
  "$TRANSFORMERS" "$PYDANTIC" "$PYARROW" "$NVML"
"$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps "${TARGET[@]}" -d "$STAGE" pillow
mkdir "$STAGE/optional"
mv "$STAGE"/pillow-*.whl "$STAGE"/numpy-*.whl "$STAGE/optional/"

# Distribution names as wheel file names spell them (lower case, '_' for '-').
TORCH_BRINGS="torch triton sympy mpmath networkx jinja2 markupsafe filelock fsspec setuptools"
NOT_IMPORTED="typer typer_slim click rich pygments markdown_it_py mdurl shellingham annotated_doc hf_xet"
for wheel in "$STAGE"/*.whl; do
  name=$(basename "$wheel" | cut -d- -f1 | tr '[:upper:]' '[:lower:]')
  if [[ " $TORCH_BRINGS $NOT_IMPORTED " == *" $name "* ]] || [[ $name == nvidia_* && $name != nvidia_ml_py ]]; then
    echo "  left out: $(basename "$wheel")"
    continue
  fi
  cp "$wheel" "$DIR/"
done
[[ -n $(ls "$DIR"/transformers-*.whl "$DIR"/pydantic_core-*cp312*.whl "$DIR"/pyarrow-*cp312*.whl 2>/dev/null) ]] \
  || { echo "transformers, pydantic-core or pyarrow missing from $DIR" >&2; exit 1; }

mib() { du -cb "$@" | tail -1 | awk '{printf "%.1f", $1 / 1048576}'; }
total=$(mib "$DIR"/*.whl)
(( $(awk "BEGIN {print ($total > $BUDGET_MIB)}") )) && {
  echo "required wheels are $total MiB, over the $BUDGET_MIB MiB budget" >&2
  exit 1
}
for wheel in "$STAGE"/optional/*.whl; do
  with=$(mib "$DIR"/*.whl "$wheel")
  if (( $(awk "BEGIN {print ($with <= $BUDGET_MIB)}") )); then
    cp "$wheel" "$DIR/"
  else
    echo "  over budget, left out: $(basename "$wheel") (the GPU machine must have it; device_run.sh checks)"
  fi
done
ls -1 "$DIR"/*.whl | xargs -n1 basename | sed 's/^/  /'
echo "$(ls "$DIR"/*.whl | wc -l) wheels, $(mib "$DIR"/*.whl) MiB in $DIR (budget $BUDGET_MIB MiB)"
