#!/usr/bin/env bash
# Installs everything Tandoor needs on a fresh Debian (bookworm) machine.
# Idempotent: a second run checks and returns quickly. Quiet unless it has work to do.
#   scripts/setup.sh            host tools + agent + test deps into .venv
# Env: TANDOOR_PYTHON (interpreter for the venv, default python3), TANDOOR_SKIP_APT=1.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${TANDOOR_PYTHON:-python3}"
say() { printf '[setup] %s\n' "$*" >&2; }

APT_PKGS=(g++-aarch64-linux-gnu mosquitto mosquitto-clients python3-pyarmnn libarmnn-cpuref-backend22)

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

STAMP="$VENV/.tandoor-deps"
WANT="$(sha256sum "$ROOT/pyproject.toml" | cut -c1-16)"
if [[ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]]; then
  say "installing Python packages into .venv (first run takes a few minutes)"
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
  "$VENV/bin/python" -m pip install -q -e "$ROOT[host,agent,demo,test]"
  echo "$WANT" > "$STAMP"
fi
