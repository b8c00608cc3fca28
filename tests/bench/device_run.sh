#!/usr/bin/env bash
# The one command for a GPU machine without internet: install the wheels copied with the checkout,
# check the attention kernels, benchmark, and leave ONE JSON and ONE table, whatever happens.
#
#   bash tests/bench/device_run.sh             # on the GPU machine (wheels/ from fetch_wheels.sh)
#   bash tests/bench/device_run.sh --dry-run   # anywhere: no install, CPU, tiny sizes (CI)
#
# Results go to $OUT when it is set, else tests/bench/results/device_run/: device_run.json (every
# phase's status and time, the kernel check, the smoke and 3B benchmarks, a summary) and
# device_run.txt (the same as a table); each phase's own JSON and log beside them.
#
# Phases on one H200, with their time limits (the whole run must fit in 9 minutes; each limit is
# also cut to what is left of DEADLINE_S, so a slow phase shortens the next instead of overrunning):
#   1. install   <= 45 s  (expected ~15 s: 21 wheels, 61 MiB, into .bench-site/ with pip --target
#                          --no-compile, no venv or system change; the machine keeps its own torch)
#      preflight <= 20 s  (~5 s: what imports, from where, torch's CUDA)
#   2. kernels   <= 150 s (expected ~100 s: varlen fwd+bwd vs fp32, 8 head layouts x 8192 tokens,
#                          ~10 s; native GQA vs K/V copies, ~5 s; compiled flex fwd+bwd, ~60 s of
#                          compilation; one-call vision vs per segment on the 3B tower's width, 8
#                          blocks, varlen/flex/sdpa, ~30 s)
#   3. smoke     <= 60 s  (expected ~35 s: gpu_bench --tiny on CUDA, varlen and sdpa: the CUDA
#                          path end to end before minutes go into the 3B)
#   4. bench     <= 240 s (expected ~200 s: 3B, 600 samples packed at 8192; per run a fresh model
#                          (~15 s), 2 warm-up + 5 timed steps (~1-2 s each); packed varlen, then the
#                          padded baseline (4 micro-batches a step), then flex (+~60 s compile) and
#                          sdpa; the fp32 reference of the equivalence check once (~20 s); gpu_bench
#                          starts no run after 190 s)
#   5. report    <= 10 s  (~5 s: the merge imports torch)
# Total of the limits: 525 s (8 min 45 s); DEADLINE_S (default 530) bounds the whole.
# The dry run (CPU, ~35 s of CPU time in all) has wide limits: CI shares its cores.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
DRY=0
[[ ${1:-} == --dry-run ]] && DRY=1
WANTED=${PYTHON:-python3}
PYTHON=$(command -v "$WANTED") || { echo "$WANTED: not found" >&2; exit 2; }
[[ $PYTHON == /* ]] || PYTHON=$PWD/$PYTHON  # phases run from other folders
RESULTS=${OUT:-$ROOT/tests/bench/results/device_run}
DEADLINE_S=${DEADLINE_S:-$((DRY ? 900 : 530))}  # the dry run: CI's shared CPUs, generous limits
START=$SECONDS
mkdir -p "$RESULTS" && RESULTS=$(cd "$RESULTS" && pwd)
rm -f "$RESULTS"/{phases.tsv,kernel_check.json,smoke.json,bench.json,device_run.json,device_run.txt}
cd "$ROOT" || exit 2

# phase NAME LIMIT_S COMMAND...: runs COMMAND under a time limit, logs to NAME.log, records
# "NAME status rc seconds" (status ok, failed, timeout or skipped) in phases.tsv.
phase() {
  local name=$1 limit=$2 left t0 rc status
  shift 2
  left=$((DEADLINE_S - (SECONDS - START) - 10))  # 10 s kept for the report
  ((left < limit)) && limit=$left
  if ((limit < 5)); then
    printf '%s\tskipped\t-\t0\tno time left\n' "$name" >>"$RESULTS/phases.tsv"
    return
  fi
  echo "== $name (limit ${limit}s)"
  t0=$SECONDS
  timeout --kill-after=10 "$limit" bash -c '"$@"' "$name" "$@" > >(tee "$RESULTS/$name.log") 2>&1
  rc=$?
  case $rc in 0) status=ok ;; 124 | 137) status=timeout ;; *) status=failed ;; esac
  printf '%s\t%s\t%s\t%s\t-\n' "$name" "$status" "$rc" "$((SECONDS - t0))" >>"$RESULTS/phases.tsv"
}

skip() { printf '%s\tskipped\t-\t0\t%s\n' "$1" "$2" >>"$RESULTS/phases.tsv"; }

install_wheels() {
  local site=$ROOT/.bench-site
  shopt -s nullglob
  local wheels=("$ROOT"/wheels/*.whl)
  ((${#wheels[@]})) || { echo "no wheels in $ROOT/wheels: run tests/bench/fetch_wheels.sh where there is an index"; return 1; }
  rm -rf "$site"
  # From /tmp: the checkout's top-level `operator` package would shadow the standard library's.
  if (cd /tmp && "$PYTHON" -m pip --version >/dev/null 2>&1); then
    (cd /tmp && "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --disable-pip-version-check \
      --target "$site" "${wheels[@]}") || return 1
  else  # no pip: a wheel is a zip of what goes into site-packages (plus *.data/{purelib,platlib})
    (cd /tmp && "$PYTHON" - "$site" "${wheels[@]}" <<'PY') || return 1
import shutil, sys, zipfile
from pathlib import Path

site = Path(sys.argv[1])
for wheel in sys.argv[2:]:
    zipfile.ZipFile(wheel).extractall(site)
for data in site.glob("*.data"):
    for lib in ("purelib", "platlib"):
        for item in (data / lib).glob("*") if (data / lib).is_dir() else []:
            shutil.move(str(item), str(site / item.name))
PY
  fi
  echo "installed ${#wheels[@]} wheels into $site"
}

# What the benchmark imports, from where (PYTHONPATH first: the copied wheels win over older ones).
preflight() {
  cd /tmp && "$PYTHON" - <<'PY'
import importlib
import sys

missing = []
for name in ("torch", "numpy", "PIL", "pydantic", "pyarrow", "transformers", "pynvml"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"), getattr(module, "__file__", ""))
    except ImportError as e:
        missing.append(name)
        print(name, "MISSING:", e)
if "torch" not in missing:
    import torch

    print("cuda:", torch.cuda.is_available(), torch.version.cuda, "python", sys.version.split()[0])
sys.exit(1 if set(missing) - {"pynvml"} else 0)  # without NVML only SM utilisation is missing
PY
}

export ROOT PYTHON
export -f install_wheels preflight
export PYTHONPATH="$ROOT/.bench-site${PYTHONPATH:+:$PYTHONPATH}"
if ((DRY)); then
  skip install "dry run"
  phase preflight 60 preflight
  phase kernels 300 "$PYTHON" tests/bench/kernel_check.py --tiny --out "$RESULTS/kernel_check.json"
  phase smoke 300 "$PYTHON" tests/bench/gpu_bench.py --tiny --backends varlen,sdpa --samples 16 --max-length 512 \
    --steps 1 --warmup 0 --out "$RESULTS/smoke.json"
  skip bench "dry run: no 3B without a GPU (the smoke phase ran the same code on the tiny model)"
else
  phase install 45 install_wheels
  phase preflight 20 preflight
  phase kernels 150 "$PYTHON" tests/bench/kernel_check.py --out "$RESULTS/kernel_check.json"
  phase smoke 60 "$PYTHON" tests/bench/gpu_bench.py --tiny --backends varlen,sdpa --out "$RESULTS/smoke.json"
  phase bench 240 "$PYTHON" tests/bench/gpu_bench.py --models 3b --backends varlen,flash,flex,sdpa \
    --budget-s 190 --out "$RESULTS/bench.json"
fi
timeout 20 "$PYTHON" tests/bench/gpu_bench.py --merge "$RESULTS"
rc=$?
if [[ ! -s $RESULTS/device_run.json ]]; then  # the merge itself could not run: still one JSON
  (cd /tmp && "$PYTHON" - "$RESULTS" "$rc") <<'PY'
import json, sys
from pathlib import Path

folder = Path(sys.argv[1])
lines = (folder / "phases.tsv").read_text().splitlines() if (folder / "phases.tsv").is_file() else []
phases = [dict(zip(("phase", "status", "rc", "seconds", "note"), line.split("\t"))) for line in lines]
report = {"passed": False, "merge_failed": f"gpu_bench.py --merge exited {sys.argv[2]}", "phases": phases}
(folder / "device_run.json").write_text(json.dumps(report, indent=1))
(folder / "device_run.txt").write_text("device run: FAILED (no merged report)\n" + "\n".join(lines) + "\n")
PY
  rc=1
fi
echo "total $((SECONDS - START)) s; results in $RESULTS/device_run.json and device_run.txt"
exit $rc
