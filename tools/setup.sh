#!/usr/bin/env bash
# Creates the virtual environment (pinned by requirements.lock) with the extras in $EXTRAS
# (default: test; `make docs` and `make test-slow` add docs) and installs the Fashion-MNIST
# IDX files. Idempotent: a finished step is not redone.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
EXTRAS="${EXTRAS:-test}"
STAMP="$VENV/.installed"
LOG="$VENV/install.log"

# The stamp lists the extras installed: asking for one it lacks installs again.
missing_extra() {
  local extra
  for extra in ${EXTRAS//,/ }; do
    grep -qx "$extra" "$STAMP" 2>/dev/null || return 0
  done
  return 1
}

if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ] || [ requirements.lock -nt "$STAMP" ] \
    || missing_extra; then
  # Keep what was installed before: `make docs` after `make test` installs test and docs.
  EXTRAS="$(printf '%s\n' ${EXTRAS//,/ } $(cat "$STAMP" 2>/dev/null) | sort -u | paste -sd, -)"
  echo "fedjax_pan: creating $VENV and installing dependencies (about a minute)..."
  start=$(date +%s)
  "$PYTHON" -m venv "$VENV"
  mkdir -p "$VENV"
  if ! "$VENV/bin/python" -m pip install --disable-pip-version-check -c requirements.lock -e ".[$EXTRAS]" >"$LOG" 2>&1; then
    tail -n 30 "$LOG" >&2
    echo "fedjax_pan: dependency installation failed; full log in $LOG" >&2
    exit 1
  fi
  printf '%s\n' ${EXTRAS//,/ } > "$STAMP"
  echo "fedjax_pan: environment ready in $(( $(date +%s) - start )) s"
fi

FMNIST_DIR="${FEDJAX_PAN_FASHION_MNIST_DIR:-/usr/share/datasets/fashion-mnist}"
if [ ! -f "$FMNIST_DIR/train-images-idx3-ubyte.gz" ] && [ ! -f "$FMNIST_DIR/train-images-idx3-ubyte" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "fedjax_pan: installing the Debian package dataset-fashion-mnist..."
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q dataset-fashion-mnist >/dev/null; } \
      || echo "fedjax_pan: could not install dataset-fashion-mnist with apt-get" >&2
  else
    cat >&2 <<MSG
fedjax_pan: Fashion-MNIST IDX files not found in $FMNIST_DIR.
  Install them with 'sudo apt-get install dataset-fashion-mnist', or put the four files
  train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz,
  t10k-labels-idx1-ubyte.gz in a folder and set FEDJAX_PAN_FASHION_MNIST_DIR to it.
  Tests that need the real data are skipped until then.
MSG
  fi
fi
