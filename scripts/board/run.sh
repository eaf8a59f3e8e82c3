#!/usr/bin/env bash
# Runs a command on the emulated arm64 board (built by scripts/board/build.sh).
#
#   scripts/board/run.sh [--board NAME] [--share DIR] [-e NAME=VALUE]... [--] CMD [ARGS...]
#
#   --board NAME  which emulated board: bookworm (the default) or trixie.
#   --share DIR   bind-mount the host directory DIR at /work on the board (the command starts in
#                 /work); put bundles there.
#   -e NAME=VAL   environment for the command (it otherwise gets a clean one: HOME, LANG, and a
#                 PATH with /opt/tandoor/venv/bin first, so `tandoor-agent` and `python` are the
#                 agent's).
#   no CMD        an interactive shell on the board.
#
# The command runs chrooted in a private mount namespace with /proc (and an Arm /proc/cpuinfo:
# 2 x Cortex-A76, or $TANDOOR_BOARD_CPUINFO), /sys, /dev and a fresh /tmp; nothing stays mounted
# after it exits. Its exit status is the command's.
# Example:
#   scripts/board/run.sh --share /tmp/b tandoor-agent run /work/resnet18.hmod --delegate armnn --json
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {  # usage [STATUS]: the header above; on stdout for --help, stderr otherwise
  sed -n '2,/^set -e/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//' >&"$([[ "${1:-2}" == 0 ]] && echo 1 || echo 2)"
  exit "${1:-2}"
}
share="" envs=() board="${BOARDS[0]}"
while (($#)); do
  case "$1" in
    --board) (($# >= 2)) || usage; board="$2"; shift 2 ;;
    --board=*) board="${1#*=}"; shift ;;
    --share) (($# >= 2)) || usage; share="$2"; shift 2 ;;
    --share=*) share="${1#*=}"; shift ;;
    -e|--env) (($# >= 2)) || usage; envs+=("$2"); shift 2 ;;
    -h|--help) usage 0 ;;
    --) shift; break ;;
    -*) echo "run.sh: unknown option $1" >&2; usage ;;
    *) break ;;
  esac
done
for e in "${envs[@]}"; do [[ "$e" == [A-Za-z_]*=* ]] || die "-e wants NAME=VALUE, got '$e'"; done
if [[ -n "$share" ]]; then
  [[ -d "$share" ]] || die "--share $share: not a directory"
  share="$(realpath "$share")"
fi

use_board "$board"
need_root
[[ -f "$ROOTFS/.tandoor-board" ]] || die "no board at $ROOTFS; build it with scripts/board/build.sh --board $BOARD"
ensure_binfmt
[[ -f "$CPUINFO" ]] || die "no cpuinfo file $CPUINFO"

# A shared lock for as long as the command runs (fd 9 is inherited all the way down):
# build.sh takes it exclusively before it replaces or changes the rootfs.
mkdir -p "$CACHE"
exec 9>>"$LOCK"
flock -s -w 600 9 || die "the board is being rebuilt (lock $LOCK held for 10 min)"
exec unshare --mount --propagation private -- \
  "$BOARD_DIR/enter.sh" "$ROOTFS" "$(realpath "$CPUINFO")" "$share" "${envs[@]}" -- "$@"
