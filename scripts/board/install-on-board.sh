#!/usr/bin/env bash
# Installs the Tandoor agent on an arm64 Debian (bookworm) board, from a checkout of this
# repository on the board. Run as root from the checkout:
#
#   sudo scripts/board/install-on-board.sh
#
# - Debian packages: python3, python3-venv, Arm NN 20.08 (python3-pyarmnn) with its CpuAcc (ACL
#   NEON) and CpuRef backends;
# - the venv $TANDOOR_VENV (default /opt/tandoor/venv) with the agent: pip install of the
#   checkout's `agent` extra, binary wheels only (apache-tvm's aarch64 runtime, onnxruntime...);
#   Debian's pyarmnn is exposed to it alone (a pyarmnn-only path: all of dist-packages would
#   shadow the venv's numpy 2 with Debian's 1.24);
# - systemd/tandoor-agent.service, when the checkout has it, installed and enabled (not started)
#   with what it expects: the `tandoor` system user and /etc/tandoor/agent.toml (from
#   systemd/agent.toml.example unless there is one already).
# Idempotent. scripts/board/build.sh runs this same script inside the emulated board.
# Env: TANDOOR_VENV; TANDOOR_WHEELHOUSE=DIR installs from the wheels in DIR only (a board
#      without internet; scripts/board/build.sh shows how to `pip download` them elsewhere).
#   --print-packages   print the Debian packages and exit
#   --service-only     only the systemd part (after the unit file changed)
set -euo pipefail
SRC="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${TANDOOR_VENV:-/opt/tandoor/venv}"
PKGS=(python3 python3-venv ca-certificates
      python3-pyarmnn libarmnn-cpuacc-backend22 libarmnn-cpuref-backend22)
say() { printf '[install-on-board] %s\n' "$*" >&2; }

# The unit file and what it expects (the steps in its header): the tandoor system user, and
# /etc/tandoor/agent.toml from the example unless there is one. Enabled, not started: edit the
# config, then `systemctl start tandoor-agent`.
install_service() {
  local unit="$SRC/systemd/tandoor-agent.service" wanted
  if [[ ! -f "$unit" ]]; then
    say "no systemd/tandoor-agent.service in the checkout; no unit installed"
    return 0
  fi
  if ! id -u tandoor >/dev/null 2>&1; then
    useradd --system --home-dir /var/lib/tandoor --shell /usr/sbin/nologin --groups video tandoor
  fi
  install -D -m 0644 "$unit" /etc/systemd/system/tandoor-agent.service
  if [[ ! -e /etc/tandoor/agent.toml && -f "$SRC/systemd/agent.toml.example" ]]; then
    install -d -m 0755 /etc/tandoor
    install -m 0640 -g tandoor "$SRC/systemd/agent.toml.example" /etc/tandoor/agent.toml
  fi
  if [[ -d /run/systemd/system ]]; then
    systemctl daemon-reload
    systemctl enable tandoor-agent.service
  else  # no systemd running (a chroot): enable it the way systemctl would
    wanted="$(sed -n 's/^WantedBy=[[:space:]]*//p' "$unit" | head -n1)"
    if [[ -n "$wanted" ]]; then
      mkdir -p "/etc/systemd/system/$wanted.wants"
      ln -sfn /etc/systemd/system/tandoor-agent.service "/etc/systemd/system/$wanted.wants/tandoor-agent.service"
    fi
  fi
  say "tandoor-agent.service installed and enabled (not started): edit /etc/tandoor/agent.toml, then systemctl start tandoor-agent"
}

if [[ "${1:-}" == --print-packages ]]; then echo "${PKGS[*]}"; exit 0; fi
[[ $(id -u) -eq 0 ]] || { echo "run as root (sudo $0)" >&2; exit 1; }
if [[ "${1:-}" == --service-only ]]; then install_service; exit 0; fi
[[ $# -eq 0 ]] || { echo "usage: $0 [--print-packages | --service-only]" >&2; exit 2; }
[[ "$(uname -m)" == aarch64 ]] || say "warning: this is $(uname -m), not aarch64"

missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  say "apt-get install ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  say "creating $VENV"
  python3 -m venv "$VENV"
fi
site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
mkdir -p "$VENV/pyarmnn-only"
ln -sfn /usr/lib/python3/dist-packages/pyarmnn "$VENV/pyarmnn-only/pyarmnn"
echo "$VENV/pyarmnn-only" > "$site/tandoor-pyarmnn.pth"

index=()
if [[ -n "${TANDOOR_WHEELHOUSE:-}" ]]; then index=(--no-index --find-links "$TANDOOR_WHEELHOUSE"); fi
say "pip install '$SRC[agent]' into $VENV (binary wheels only${index:+, from $TANDOOR_WHEELHOUSE})"
# setuptools/wheel in the venv let a later reinstall of the sources work offline
# (pip install --no-deps --no-build-isolation --no-index $SRC).
"$VENV/bin/python" -m pip install --disable-pip-version-check --no-cache-dir --progress-bar off \
  --only-binary=:all: "${index[@]}" "$SRC[agent]" "setuptools>=77" wheel

install_service
say "done: $("$VENV/bin/tandoor-agent" --version)"
