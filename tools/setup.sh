#!/usr/bin/env bash
# Creates the virtual environment (pinned by requirements.lock) and installs the
# Fashion-MNIST IDX files. Idempotent: a finished step is not redone.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.installed"
LOG="$VENV/install.log"

if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ] || [ requirements.lock -nt "$STAMP" ]; then
  echo "fedjax_pan: creating $VENV and installing dependencies (about a minute)..."
  start=$(date +%s)
  "$PYTHON" -m venv "$VENV"
  mkdir -p "$VENV"
  if ! "$VENV/bin/python" -m pip install --disable-pip-version-check -c requirements.lock -e '.[test]' >"$LOG" 2>&1; then
    tail -n 30 "$LOG" >&2
    echo "fedjax_pan: dependency installation failed; full log in $LOG" >&2
    exit 1
  fi
  touch "$STAMP"
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
