#!/usr/bin/env bash
# The board tests (tests/board) against a real arm64 board over SSH instead of the emulated one.
#
#   scripts/board/run-remote.sh [--install] user@host [pytest args...]
#
# Bundles are compiled here (host, x86) for aarch64, copied to a temporary directory on the
# board, run there with `tandoor-agent run --delegate armnn --json` (and with pyarmnn made
# unavailable, and a host-only bundle), and their outputs compared here with the host
# onnxruntime reference, exactly as against the emulated board.
#
# Needs: key-based ssh to the board; on the board, an arm64 distribution install-on-board.sh knows
# (Debian bookworm or trixie, Ubuntu 22.04 or 24.04, or a derivative) and the agent in /opt/tandoor/venv. --install puts it there: copies this
# checkout's sources to ~/tandoor-src on the board and runs scripts/board/install-on-board.sh with
# sudo (it asks for a password on a terminal if sudo needs one). Here: scripts/setup.sh done.
# Env: TANDOOR_BOARD_VENV   the agent's venv on the board (default /opt/tandoor/venv)
#      TANDOOR_BOARD_SSH_OPTS  extra ssh/scp options, e.g. "-o Port=2222 -i ~/.ssh/board" (used for ssh and scp)
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

install=0
if [[ "${1:-}" == --install ]]; then install=1; shift; fi
[[ $# -ge 1 && "$1" != -* ]] || { sed -n '2,/^set -e/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//' >&2; exit 2; }
target="$1"; shift
venv="${TANDOOR_BOARD_VENV:-$VENV_IN_BOARD}"
# shellcheck disable=SC2206
opts=(-o BatchMode=yes ${TANDOOR_BOARD_SSH_OPTS:-})

arch="$(ssh "${opts[@]}" "$target" uname -m)" || die "cannot ssh to $target"
[[ "$arch" == aarch64 ]] || die "$target is $arch, not aarch64"

if ((install)); then
  say "copying the checkout's sources to $target:tandoor-src"
  # shellcheck disable=SC2046
  tar -C "$SRC_ROOT" --exclude=__pycache__ --exclude='*.pyc' -czf - \
      $(cd "$SRC_ROOT" && for i in "${SRC_ITEMS[@]}"; do [[ -e "$i" ]] && echo "$i"; done) |
    ssh "${opts[@]}" "$target" 'rm -rf tandoor-src && mkdir tandoor-src && tar -C tandoor-src -xzf -'
  say "installing the agent on $target (sudo scripts/board/install-on-board.sh)"
  ssh -t "${opts[@]}" "$target" "sudo TANDOOR_VENV='$venv' tandoor-src/scripts/board/install-on-board.sh"
fi
ssh "${opts[@]}" "$target" "test -x '$venv/bin/tandoor-agent'" ||
  die "no agent at $target:$venv; install it with: $0 --install $target"

say "running tests/board against $target ($(ssh "${opts[@]}" "$target" "'$venv/bin/tandoor-agent' --version"))"
cd "$SRC_ROOT"
TANDOOR_BOARD_SSH="$target" TANDOOR_BOARD_VENV="$venv" exec "$SRC_ROOT/.venv/bin/python" -m pytest tests/board "$@"
