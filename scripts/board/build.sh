#!/usr/bin/env bash
# Builds, or reuses, the emulated arm64 board: a Debian bookworm arm64 rootfs run under
# qemu-user, with Arm NN 20.08 (python3-pyarmnn, CpuAcc = ACL NEON, CpuRef) and the agent
# installed the way a real board installs it (pip install of the `agent` extra from a checkout
# copied to /opt/tandoor/src, into the venv /opt/tandoor/venv; systemd unit in place).
#
#   scripts/board/build.sh            build or reuse; prints the rootfs path on stdout
#   scripts/board/build.sh --rebuild  ignore the cache
#
# Two layers, both checked on every run:
#   base    apt packages + venv with the agent's dependencies. Cached as
#           $TANDOOR_CACHE/board/board-<key>.tar.zst, key = sha256 of this script (which holds the
#           package list) and pyproject.toml. Missing or stale: rebuilt (~5 min on 2 cores).
#           Fresh: unpacked in seconds, or used in place if the unpacked rootfs already has it.
#   source  the checkout's pyproject.toml, README.md, agent/, compiler/, systemd/. When they
#           differ from what the rootfs has, they are copied in again and pip-installed with
#           --no-deps (seconds), so editing the agent never costs a base rebuild.
# Exit status 77: this machine cannot run an arm64 board (no root, no binfmt_misc...).
# Env: TANDOOR_CACHE, TANDOOR_BOARD_ROOT (see common.sh), TANDOOR_BOARD_MIRROR,
#      TANDOOR_BOARD_SECURITY_MIRROR, TANDOOR_SKIP_APT=1 (do not apt-get install host tools).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

SUITE=bookworm
MIRROR="${TANDOOR_BOARD_MIRROR:-http://deb.debian.org/debian}"
SECURITY="${TANDOOR_BOARD_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"
HOST_PKGS=(qemu-user-static binfmt-support mmdebstrap arch-test zstd)
BOARD_PKGS=(python3 python3-venv ca-certificates
            python3-pyarmnn libarmnn-cpuacc-backend22 libarmnn-cpuref-backend22)
# What goes from the checkout onto the board (the package and its unit file).
SRC_ITEMS=(pyproject.toml README.md agent compiler systemd)

rebuild=0
case "${1:-}" in
  --rebuild) rebuild=1 ;;
  "") ;;
  -h|--help) sed -n '2,/^set -e/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  *) die "unknown argument $1 (try --help)" ;;
esac

# ------------------------------------------------------------------------------ host side
ensure_host_tools() {
  [[ "${TANDOOR_SKIP_APT:-0}" == 1 ]] && return 0
  local missing=() p
  for p in "${HOST_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  ((${#missing[@]})) || return 0
  command -v apt-get >/dev/null || cannot "needs ${missing[*]} and there is no apt-get"
  say "installing host tools: ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

can_run_arm64() {
  [[ "$(uname -m)" == aarch64 ]] && return 0
  local out
  out="$(arch-test arm64 2>&1)" || cannot "arm64 binaries do not run here (arch-test: $out)"
}

hash_files() {  # sha256 over names and contents of files under the given paths (relative to SRC_ROOT)
  (cd "$SRC_ROOT" && find "$@" -type f ! -name '*.pyc' ! -path '*/__pycache__/*' -print0 2>/dev/null |
     LC_ALL=C sort -z | xargs -0 -r sha256sum) | sha256sum | cut -c1-16
}

base_key() {
  { printf '%s\n' "$SUITE" "${BOARD_PKGS[@]}"; cat "${BASH_SOURCE[0]}" "$SRC_ROOT/pyproject.toml"; } |
    sha256sum | cut -c1-16
}

src_items() { local i; for i in "${SRC_ITEMS[@]}"; do [[ -e "$SRC_ROOT/$i" ]] && echo "$i"; done; }

# Run a command inside a rootfs that is not (yet) the board; no lock (we hold it exclusively).
in_root() {
  local root="$1"; shift
  unshare --mount --propagation private -- "$BOARD_DIR/enter.sh" "$root" "$(realpath "$CPUINFO")" "" -- "$@"
}

# Copy the checkout's sources to /opt/tandoor/src in ROOT (replacing what was there).
copy_src() {
  local root="$1" dst="$1$SRC_IN_BOARD"
  rm -rf --one-file-system -- "$dst"
  mkdir -p "$dst"
  # shellcheck disable=SC2046
  tar -C "$SRC_ROOT" --exclude=__pycache__ --exclude='*.pyc' -cf - $(src_items) | tar -C "$dst" -xf -
}

# systemd unit, if the checkout has one (the board has no systemd running; it is put in place
# and enabled the way `systemctl enable` would, for a real boot).
install_unit() {
  local root="$1" unit="$SRC_ROOT/systemd/tandoor-agent.service"
  if [[ ! -f "$unit" ]]; then
    say "no systemd/tandoor-agent.service in the checkout yet; skipping the unit file"
    return 0
  fi
  install -D -m 0644 "$unit" "$root/etc/systemd/system/tandoor-agent.service"
  local wanted
  wanted="$(sed -n 's/^WantedBy=[[:space:]]*//p' "$unit" | head -n1)"
  if [[ -n "$wanted" ]]; then
    mkdir -p "$root/etc/systemd/system/$wanted.wants"
    ln -sfn /etc/systemd/system/tandoor-agent.service "$root/etc/systemd/system/$wanted.wants/tandoor-agent.service"
  fi
  say "installed systemd unit /etc/systemd/system/tandoor-agent.service${wanted:+ (enabled for $wanted)}"
}

prefix() { sed -u "s/^/    $1| /" >&2; }

# ------------------------------------------------------------------------------ base layer
build_base() {
  local new="$1"
  safe_rm_rootfs "$new"
  say "building the arm64 $SUITE rootfs with mmdebstrap (about 3 min): ${BOARD_PKGS[*]}"
  # In its own mount namespace: whatever mmdebstrap mounts in the target can never outlive it.
  unshare --mount --propagation private -- \
    mmdebstrap --mode=root --arch=arm64 --variant=minbase --include="$(IFS=,; echo "${BOARD_PKGS[*]}")" \
      --aptopt='Acquire::Retries "3"' --dpkgopt='path-exclude=/usr/share/doc/*' \
      --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
      "$SUITE" "$new" \
      "deb $MIRROR $SUITE main" "deb $MIRROR $SUITE-updates main" "deb $SECURITY $SUITE-security main" \
      2>&1 | prefix mmdebstrap
  [[ -x "$new/usr/bin/python3" ]] || die "mmdebstrap did not produce a rootfs with python3"

  # pip on the board must trust what the host trusts (a TLS-intercepting proxy's CA, say).
  local crt n=0
  for crt in /usr/local/share/ca-certificates/*.crt; do
    [[ -f "$crt" ]] || continue
    install -D -m 0644 "$crt" "$new/usr/local/share/ca-certificates/$(basename "$crt")"; n=$((n + 1))
  done
  if ((n)); then
    say "adding $n local CA certificate(s) to the board"
    in_root "$new" update-ca-certificates 2>&1 | prefix ca
  fi
  [[ -e "$new/etc/resolv.conf" ]] || : > "$new/etc/resolv.conf"

  copy_src "$new"
  say "creating $VENV_IN_BOARD and pip-installing the agent extra from $SRC_IN_BOARD (about 1-2 min)"
  in_root "$new" /bin/sh -eu -c '
    python3 -m venv "$0"
    # Debian'"'"'s pyarmnn, and only it: all of dist-packages would shadow numpy 2 with 1.24.
    mkdir -p "$0/pyarmnn-only"
    ln -sfn /usr/lib/python3/dist-packages/pyarmnn "$0/pyarmnn-only/pyarmnn"
    site=$("$0/bin/python" -c "import sysconfig; print(sysconfig.get_paths()[\"purelib\"])")
    echo "$0/pyarmnn-only" > "$site/tandoor-pyarmnn.pth"
    # setuptools/wheel in the venv let later source refreshes install without network.
    "$0/bin/pip" install --disable-pip-version-check --no-cache-dir --progress-bar off \
      --only-binary=:all: "$1[agent]" "setuptools>=77" wheel
  ' "$VENV_IN_BOARD" "$SRC_IN_BOARD" 2>&1 | grep -v -E '^ +(Downloading|Using cached) ' | prefix pip
  install_unit "$new"
  rm -rf --one-file-system "$new/var/cache/apt/archives/"*.deb "$new/var/lib/apt/lists/"* "$new/root/.cache"
}

smoke_test() {
  local root="$1" out
  say "checking the board: arch, Arm NN backends, agent"
  out="$(in_root "$root" python -c '
import platform, sys
from tandoor_agent.executors import armnn
import onnxruntime, numpy
ok, why = armnn.available()
print(platform.machine(), "|", why, "| onnxruntime", onnxruntime.__version__, "| numpy", numpy.__version__)
sys.exit(0 if ok and "CpuAcc" in armnn.backends() else 1)' 2>&1)" || die "board smoke test failed:
$out"
  say "board: $out"
}

# ------------------------------------------------------------------------------ main
need_root
ensure_host_tools
ensure_binfmt
can_run_arm64
[[ -f "$CPUINFO" ]] || die "no cpuinfo file $CPUINFO"

mkdir -p "$CACHE"
exec 9>>"$LOCK"
if ! flock -x -n 9; then
  say "waiting for board commands or another build to finish (lock $LOCK)"
  flock -x 9
fi

key="$(base_key)"
tarball="$CACHE/board-$key.tar.zst"
have="$(cat "$ROOTFS/.tandoor-board" 2>/dev/null || true)"
changed=0
if ((rebuild)); then
  rm -f "$tarball"; have=""
fi
if [[ "$have" == "$key" ]]; then
  say "reusing $ROOTFS (base $key)"
else
  new="$CACHE/rootfs.new"
  trap 'safe_rm_rootfs "$new" 2>/dev/null || true' EXIT
  if [[ -f "$tarball" ]]; then
    say "unpacking the cached board $(basename "$tarball") ($(du -h "$tarball" | cut -f1))"
    safe_rm_rootfs "$new"
    mkdir -p "$new"
    tar -C "$new" --numeric-owner -I zstd -xpf "$tarball"
  else
    [[ -n "$have" ]] && say "the board at $ROOTFS is stale (base $have, want $key): rebuilding"
    [[ -z "$have" ]] && say "no cached board for base $key: building it (about 5 min, once)"
    build_base "$new"
    echo "$key" > "$new/.tandoor-board"
    hash_files $(src_items) > "$new/.tandoor-src"
    smoke_test "$new"
    say "caching the board as $(basename "$tarball")"
    tar -C "$new" --numeric-owner -I 'zstd -T0 -3' -cpf "$tarball.tmp" .
    mv -f "$tarball.tmp" "$tarball"
    for old in "$CACHE"/board-*.tar.zst; do
      [[ "$old" == "$tarball" ]] || { say "removing the stale cache $(basename "$old")"; rm -f "$old"; }
    done
    say "cached ($(du -h "$tarball" | cut -f1))"
  fi
  safe_rm_rootfs "$ROOTFS"
  mv "$new" "$ROOTFS"
  trap - EXIT
fi

want_src="$(hash_files $(src_items))"
if [[ "$(cat "$ROOTFS/.tandoor-src" 2>/dev/null || true)" != "$want_src" ]]; then
  say "the checkout changed since the board was built: reinstalling the agent from it (no deps)"
  copy_src "$ROOTFS"
  in_root "$ROOTFS" "$VENV_IN_BOARD/bin/pip" install --disable-pip-version-check --no-cache-dir \
    --progress-bar off --no-deps --no-build-isolation --no-index -q "$SRC_IN_BOARD" 2>&1 | prefix pip
  install_unit "$ROOTFS"
  echo "$want_src" > "$ROOTFS/.tandoor-src"
  changed=1
fi
((changed)) && smoke_test "$ROOTFS"
say "board ready: $ROOTFS (run commands with scripts/board/run.sh)"
echo "$ROOTFS"
