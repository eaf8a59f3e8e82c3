#!/usr/bin/env bash
# Installs everything Tandoor needs on a fresh Debian (bookworm) machine.
# Idempotent: a second run checks and returns quickly. Quiet unless it has work to do.
#   scripts/setup.sh            host tools + agent + test deps into .venv; on x86_64 the RKNN
#                               toolkit into .venv-rknn (tandoor compile --npu)
# Env: TANDOOR_PYTHON (interpreter for the venv, default python3), TANDOOR_SKIP_APT=1,
#      TANDOOR_SKIP_RKNN=1 (no .venv-rknn), TANDOOR_RKNN_TORCH (the torch requirement there).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${TANDOOR_PYTHON:-python3}"
say() { printf '[setup] %s\n' "$*" >&2; }

# chromium + chromium-driver: the fleet console's browser test (a browser download at install
# fails offline); postgresql: the console's PostgreSQL store, started by its tests in a temp dir.
APT_PKGS=(g++-aarch64-linux-gnu mosquitto mosquitto-clients python3-pyarmnn libarmnn-cpuref-backend22
          chromium chromium-driver postgresql)

need_apt=()
if [[ "${TANDOOR_SKIP_APT:-0}" != 1 ]]; then
  for p in "${APT_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need_apt+=("$p")
  done
fi
if ((${#need_apt[@]})); then
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  say "installing Debian packages: ${need_apt[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
  # The mosquitto package starts a system broker on 1883; Tandoor starts its own brokers.
  $SUDO systemctl disable --now mosquitto >/dev/null 2>&1 || true
  $SUDO systemctl disable --now postgresql >/dev/null 2>&1 || true   # the console's tests start their own
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  say "creating $VENV with $($PY --version 2>&1)"
  "$PY" -m venv "$VENV"
fi

# Debian's pyarmnn lives in /usr/lib/python3/dist-packages. Putting all of that on the venv's
# path shadows numpy 2 with Debian's 1.24, so expose only a pyarmnn symlink (see docs).
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if [[ -d /usr/lib/python3/dist-packages/pyarmnn ]]; then
  mkdir -p "$VENV/pyarmnn-only"
  ln -sfn /usr/lib/python3/dist-packages/pyarmnn "$VENV/pyarmnn-only/pyarmnn"
  echo "$VENV/pyarmnn-only" > "$SITE/tandoor-pyarmnn.pth"
fi

# The fleet console's chart library (uPlot), vendored from npm into the package's static dir:
# the console's pages need no internet and no CDN (fleet/console/static/vendor/, not in git).
UPLOT_VERSION=1.6.32
VENDOR="$ROOT/fleet/console/static/vendor"
if [[ "$(cat "$VENDOR/.uplot-version" 2>/dev/null)" != "$UPLOT_VERSION" ]]; then
  if ! command -v npm >/dev/null && [[ "${TANDOOR_SKIP_APT:-0}" != 1 ]]; then   # Debian's nodejs comes without it
    SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends npm >/dev/null
  fi
  command -v npm >/dev/null || { say "npm is needed to vendor uPlot for the fleet console (apt install npm)"; exit 1; }
  say "vendoring uPlot $UPLOT_VERSION from npm into fleet/console/static/vendor"
  tmp="$(mktemp -d)"
  (cd "$tmp" && npm pack -q "uplot@$UPLOT_VERSION" >/dev/null && tar xzf "uplot-$UPLOT_VERSION.tgz")
  mkdir -p "$VENDOR"
  cp "$tmp/package/dist/uPlot.iife.min.js" "$tmp/package/dist/uPlot.min.css" "$tmp/package/LICENSE" "$VENDOR/"
  echo "$UPLOT_VERSION" > "$VENDOR/.uplot-version"
  rm -rf "$tmp"
fi

STAMP="$VENV/.tandoor-deps"
WANT="$(sha256sum "$ROOT/pyproject.toml" | cut -c1-16)"
if [[ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]]; then
  say "installing Python packages into .venv (first run takes a few minutes)"
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
  "$VENV/bin/python" -m pip install -q -e "$ROOT[host,agent,demo,test]"
  echo "$WANT" > "$STAMP"
fi

# The RKNN toolkit (rknn-toolkit2, `tandoor compile --npu`) pins numpy<=1.26, onnx<=1.18,
# protobuf<=4.25 and torch<=2.4, so it lives in its own venv, driven by the compiler as a
# subprocess (compiler/backends/rknn/worker.py); x86_64 hosts only (its wheels are x86_64 and aarch64,
# the aarch64 one for boards that convert on the board). Torch: its Linux wheels <= 2.4 pull the
# CUDA stack, so the toolkit goes in without dependencies, then its dependencies with the venv's
# pins, then the CPU torch pip finds (the toolkit imports and runs with it; docs/npu.md).
RKNN_VENV="$ROOT/.venv-rknn"
RKNN_TORCH="${TANDOOR_RKNN_TORCH:-torch==2.13.0+cpu}"   # a CPU wheel: PyPI's Linux torch pulls CUDA
RKNN_PINS=(rknn-toolkit2==2.5.0 "numpy<=1.26.4" "onnx>=1.16.1,<=1.18" "protobuf>=4.21.6,<=4.25.4"
           "setuptools<81" opencv-python-headless "onnxruntime>=1.17" scipy psutil ruamel.yaml tqdm
           fast-histogram)
if [[ "$(uname -m)" == x86_64 && "${TANDOOR_SKIP_RKNN:-0}" != 1 ]]; then
  RKNN_STAMP="$RKNN_VENV/.tandoor-deps"
  RKNN_WANT="$(printf '%s\n' "${RKNN_PINS[@]}" "$RKNN_TORCH" | sha256sum | cut -c1-16)"
  if [[ "$(cat "$RKNN_STAMP" 2>/dev/null)" != "$RKNN_WANT" ]]; then
    say "installing the RKNN toolkit into .venv-rknn (first run takes a few minutes)"
    [[ -x "$RKNN_VENV/bin/python" ]] || "$PY" -m venv "$RKNN_VENV"
    # pip's resolver complains of the toolkit's torch and opencv-python pins, installed on purpose otherwise
    rpip() { "$RKNN_VENV/bin/python" -m pip install -q "$@" 2>&1 \
               | { grep -v -e "dependency resolver" -e "^rknn-toolkit2 .* requires" -e "is ignored: it is neither" >&2 || true; }; }
    rpip --upgrade pip
    rpip --no-deps "${RKNN_PINS[0]}"
    rpip "${RKNN_PINS[@]:1}"
    rpip "$RKNN_TORCH" "setuptools<81" \
      || { say "no $RKNN_TORCH wheel found: give pip the CPU index (PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu) or set TANDOOR_RKNN_TORCH"; exit 1; }
    "$RKNN_VENV/bin/python" -c "import pkg_resources; from rknn.api import RKNN" >/dev/null 2>&1 \
      || { say "the RKNN toolkit does not import in .venv-rknn; see docs/npu.md"; exit 1; }
    echo "$RKNN_WANT" > "$RKNN_STAMP"
  fi
fi
