#!/usr/bin/env bash
# kvshare's GPU check (kvshare/testing/gpu_check.py) on a machine without network or venv:
# build the native modules for this python, unpack carried NIXL wheels (.gpu-wheels/, from
# `make gpu-wheels`) into a temporary folder, run the check. JSON in $OUT/gpu_check.json.
#   DEVICE=cuda|cpu (cuda)  PYTHON=python3  GPU_CHECK_SECONDS=240  OUT=<a new temporary folder>
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
BUDGET=${GPU_CHECK_SECONDS:-240}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN} RAY_USAGE_STATS_ENABLED=0

# Native modules: all optional. Without setuptools, kvshare._copy (the one the copies use) alone.
if ! "$PY" setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1; then
  echo "gpu_check: setup.py build_ext failed (build.log); compiling kvshare._copy alone" >&2
  SUFFIX=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
  INCLUDE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
  cc -O2 -shared -fPIC -I"$INCLUDE" kvshare/_copy.c -o "kvshare/_copy$SUFFIX" >>"$OUT/build.log" 2>&1 \
    || echo "gpu_check: kvshare._copy not built: numpy copies" >&2
fi

# NIXL, where wheels were carried and none is installed: a wheel is a zip, no pip needed.
EXTRA=""
if compgen -G ".gpu-wheels/nixl*.whl" >/dev/null && ! "$PY" -c "import nixl" 2>/dev/null; then
  SITE=$(mktemp -d)
  for whl in .gpu-wheels/nixl*.whl; do "$PY" -m zipfile -e "$whl" "$SITE"; done
  EXTRA=":$SITE"
fi

PYTHONPATH=".$EXTRA${PYTHONPATH:+:$PYTHONPATH}" timeout $((${BUDGET%.*} + 120)) \
  "$PY" -m kvshare.testing.gpu_check --device "$DEVICE" --out "$OUT" --seconds "$BUDGET"
