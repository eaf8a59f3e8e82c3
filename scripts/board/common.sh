# Shared by scripts/board/*.sh (sourced, not run). Boards, paths, logging, locking, safety checks.
#
# Env:
#   TANDOOR_CACHE          cache root (default ~/.cache/tandoor); board NAME lives in $TANDOOR_CACHE/board/NAME
#   TANDOOR_BOARD_ROOT     the unpacked rootfs of the board chosen (default $TANDOOR_CACHE/board/NAME/rootfs)
#   TANDOOR_BOARD_CPUINFO  the /proc/cpuinfo the board sees (default: 2 x Cortex-A76)
#   TANDOOR_BOARD_QEMU_CPU the CPU qemu-user emulates (default cortex-a76, the RK3588's big core)

BOARD_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SRC_ROOT="$(cd "$BOARD_DIR/../.." && pwd)"
CACHE_ROOT="${TANDOOR_CACHE:-$HOME/.cache/tandoor}/board"
CPUINFO="${TANDOOR_BOARD_CPUINFO:-$BOARD_DIR/cpuinfo-cortex-a76}"
VENV_IN_BOARD=/opt/tandoor/venv
# qemu-user's default CPU, "max", has pointer authentication with the architected QARMA5 cipher,
# which it computes in software on every signed return: Debian 13 builds arm64 packages with
# branch protection, and trixie's Python ran 4x (import numpy) to 9x (compile) slower than
# bookworm's. The Cortex-A76 (ARMv8.2: no PAuth, so its hint instructions are no-ops) is the
# board's own core, and has no SVE or i8mm for ACL to pick kernels the RK3588 cannot run.
# qemu-user reads QEMU_CPU from the environment of each process it starts (enter.sh passes it on).
export QEMU_CPU="${TANDOOR_BOARD_QEMU_CPU:-cortex-a76}"
SRC_IN_BOARD=/opt/tandoor/src

# The emulated boards, one Debian arm64 suite each (the first is the default). What each brings
# is install-on-board.sh's business (its package table); here only what the host needs to know.
BOARDS=(bookworm trixie)
declare -A BOARD_ABOUT=(
  [bookworm]="Debian 12 bookworm arm64, Python 3.11, Arm NN 20.08 (ACL 20.08)"
  [trixie]="Debian 13 trixie arm64, Python 3.13, Arm NN 23.08 (ACL 24.x)"
)

# use_board NAME: sets BOARD, SUITE, CACHE (this board's cache dir), ROOTFS, LOCK.
use_board() {
  local b="$1"
  [[ -n "${BOARD_ABOUT[$b]:-}" ]] || die "unknown board '$b'; the emulated boards are: ${BOARDS[*]}"
  BOARD="$b" SUITE="$b"
  CACHE="$CACHE_ROOT/$b"
  ROOTFS="${TANDOOR_BOARD_ROOT:-$CACHE/rootfs}"
  LOCK="$CACHE/lock"
}

# What goes from the checkout onto a board: the package (pyproject.toml and every package directory
# it names: setuptools refuses to build with one missing), its unit file, the installer.
package_dirs() {
  python3 - "$SRC_ROOT/pyproject.toml" <<'PY' 2>/dev/null || echo contract agent compiler fleet host zoo
import sys, tomllib
print(" ".join(sorted(set(tomllib.load(open(sys.argv[1], "rb"))["tool"]["setuptools"]["package-dir"].values()))))
PY
}
read -r -a SRC_ITEMS <<< "pyproject.toml README.md $(package_dirs) systemd scripts/board/install-on-board.sh"
# exit status meaning "this machine cannot run the arm64 board" (tests skip on it)
EXIT_CANNOT=77

_T0=$SECONDS
say() { printf '[board%s %3ds] %s\n' "${BOARD:+ $BOARD}" "$((SECONDS - _T0))" "$*" >&2; }
die() { printf '[board] error: %s\n' "$*" >&2; exit 1; }
cannot() { printf '[board] cannot run an arm64 board here: %s\n' "$*" >&2; exit "$EXIT_CANNOT"; }

# Mount points at or below $1 in this mount namespace (mountinfo escapes spaces as \040).
mounts_under() {
  local dir
  dir="$(realpath -m "$1")"
  awk -v d="$dir" '{ m = $5; gsub(/\\040/, " ", m); if (m == d || index(m, d "/") == 1) print m }' /proc/self/mountinfo
}

# rm -rf a rootfs, but never one with anything mounted in it (a live rbind of /dev would take
# the host's device nodes with it). Board commands mount inside their own private namespace, so
# a mount seen here is a leftover of a crashed build: refuse and say so, never unmount for the user.
safe_rm_rootfs() {
  local dir="$1" live
  [[ -e "$dir" ]] || return 0
  [[ "$(realpath -m "$dir")" != / ]] || die "refusing to remove /"
  live="$(mounts_under "$dir")"
  if [[ -n "$live" ]]; then
    die "$dir has live mounts; not removing it. Unmount them once nothing uses them, then run again:
$live"
  fi
  rm -rf --one-file-system -- "$dir"
}

# Make this x86 machine run arm64 ELF binaries through qemu-user (binfmt_misc, F flag).
ensure_binfmt() {
  [[ "$(uname -m)" == aarch64 ]] && return 0
  local bm=/proc/sys/fs/binfmt_misc
  if [[ ! -e $bm/status ]]; then
    mount -t binfmt_misc binfmt_misc "$bm" 2>/dev/null ||
      cannot "binfmt_misc is not mounted and cannot be mounted (a container without privileges?)"
  fi
  if [[ ! -e $bm/qemu-aarch64 ]]; then
    command -v update-binfmts >/dev/null || cannot "qemu-aarch64 is not registered with binfmt_misc and update-binfmts is missing (apt-get install qemu-user-static binfmt-support)"
    update-binfmts --enable qemu-aarch64 >/dev/null 2>&1 || update-binfmts --import qemu-aarch64 >/dev/null 2>&1 || true
    [[ -e $bm/qemu-aarch64 ]] || cannot "could not register qemu-aarch64 with binfmt_misc"
  fi
  grep -q '^enabled' $bm/qemu-aarch64 || echo 1 > $bm/qemu-aarch64 ||
    cannot "qemu-aarch64 is registered but disabled"
  # F (fix binary): the kernel opens the interpreter at registration, so it works inside a
  # chroot that has no qemu in it.
  grep -q '^flags:.*F' $bm/qemu-aarch64 ||
    cannot "qemu-aarch64 is registered without the F flag; reinstall qemu-user-static (Debian's registers with F)"
}

need_root() {
  [[ $(id -u) -eq 0 ]] || cannot "needs root (mmdebstrap --mode=root, mount namespaces, chroot); run as root"
}
