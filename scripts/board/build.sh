#!/usr/bin/env bash
# Builds, or reuses, an emulated arm64 board: a Debian arm64 rootfs run under qemu-user, with
# Debian's Arm NN (python3-pyarmnn, CpuAcc = ACL NEON, CpuRef) and the agent installed the way a
# real board installs it (pip install of the `agent` extra from a checkout copied to
# /opt/tandoor/src, into the venv /opt/tandoor/venv; systemd unit in place). Two boards:
#   bookworm  Debian 12, Python 3.11, Arm NN 20.08 (ACL 20.08)          (the default)
#   trixie    Debian 13, Python 3.13, Arm NN 23.08 (ACL 24.x)
#
#   scripts/board/build.sh [--board NAME]            build or reuse; prints the rootfs path on stdout
#   scripts/board/build.sh [--board NAME] --rebuild  ignore the cache
#
# Layers, each rebuilt only when its own inputs change (cache in $TANDOOR_CACHE/board/NAME/):
#   debian  mmdebstrap arm64 minbase + the packages install-on-board.sh picks for the suite
#           (python3, python3-venv, python3-pyarmnn and the CpuAcc and CpuRef backends)
#           -> debian-<key>.tar.zst; key: suite, mirrors, package list, recipe.
#   board   + the host's local CA certificates, the checkout copied to /opt/tandoor/src and
#           scripts/board/install-on-board.sh run inside (venv, pip install of the agent extra,
#           binary wheels only, unit file) -> board-<key>.tar.zst; key: the debian key, the
#           dependency lists of pyproject.toml, install-on-board.sh, this script, the CA certs.
#           A fresh one unpacks in seconds, or is used in place when $TANDOOR_BOARD_ROOT has it.
#   source  the checkout's pyproject.toml, README.md, agent/, compiler/, systemd/: when they differ
#           from what the rootfs has, they are copied in again and pip-installed with --no-deps
#           (under a minute), so editing the agent never costs a rebuild.
# Exit status 77: this machine cannot run an arm64 board (no root, no binfmt_misc...).
# Env: TANDOOR_CACHE, TANDOOR_BOARD_ROOT (see common.sh), TANDOOR_BOARD_MIRROR,
#      TANDOOR_BOARD_SECURITY_MIRROR, TANDOOR_SKIP_APT=1 (do not apt-get install host tools).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

board="${BOARDS[0]}" rebuild=0
while (($#)); do
  case "$1" in
    --board) (($# >= 2)) || die "--board needs a name (${BOARDS[*]})"; board="$2"; shift 2 ;;
    --board=*) board="${1#*=}"; shift ;;
    --rebuild) rebuild=1; shift ;;
    -h|--help) sed -n '2,/^set -e/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument $1 (try --help)" ;;
  esac
done
use_board "$board"
MIRROR="${TANDOOR_BOARD_MIRROR:-http://deb.debian.org/debian}"
SECURITY="${TANDOOR_BOARD_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"
HOST_PKGS=(qemu-user-static binfmt-support mmdebstrap arch-test zstd dpkg-dev openssh-client)
INSTALLER="$BOARD_DIR/install-on-board.sh"
read -r -a BOARD_PKGS <<< "$(bash "$INSTALLER" --print-packages "$SUITE")"
# not what a board needs from us (a real one has its own sshd): tests/board runs
# scripts/board/run-remote.sh against an sshd on the emulated board, over real ssh
BOARD_PKGS+=(openssh-server)


# ------------------------------------------------------------------------------ helpers
missing_host_tools() {  # the HOST_PKGS not installed, one per line
  local p
  for p in "${HOST_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || echo "$p"
  done
}

ensure_host_tools() {
  [[ "${TANDOOR_SKIP_APT:-0}" == 1 ]] && return 0
  local missing=()
  mapfile -t missing < <(missing_host_tools)
  ((${#missing[@]})) || return 0
  command -v apt-get >/dev/null || cannot "needs ${missing[*]} and there is no apt-get"
  # the boards build side by side: one apt at a time (a second apt-get fails on dpkg's lock), and
  # what the other build installed meanwhile is not installed twice
  mkdir -p "$CACHE_ROOT"
  exec 8>>"$CACHE_ROOT/host-tools.lock"
  flock -x 8
  mapfile -t missing < <(missing_host_tools)
  if ((${#missing[@]})); then
    say "installing host tools: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  exec 8>&-
}

can_run_arm64() {
  [[ "$(uname -m)" == aarch64 ]] && return 0
  local out
  out="$(arch-test arm64 2>&1)" || cannot "arm64 binaries do not run here (arch-test: $out)"
}

sha() { sha256sum | cut -c1-16; }

src_items() { local i; for i in "${SRC_ITEMS[@]}"; do [[ -e "$SRC_ROOT/$i" ]] && echo "$i"; done; }

hash_src() {  # names and contents of the files the board gets from the checkout
  # shellcheck disable=SC2046
  (cd "$SRC_ROOT" && find $(src_items) -type f ! -name '*.pyc' ! -path '*/__pycache__/*' -print0 |
     LC_ALL=C sort -z | xargs -0 -r sha256sum) | sha
}

host_cas() { ls /usr/local/share/ca-certificates/*.crt 2>/dev/null || true; }

pyproject_deps() {  # what pip installs besides the package: a change here means a rebuild
  python3 - "$SRC_ROOT/pyproject.toml" <<'PY' 2>/dev/null || cat "$SRC_ROOT/pyproject.toml"
import json, sys, tomllib
d = tomllib.load(open(sys.argv[1], "rb"))
p = d["project"]
print(json.dumps([d.get("build-system"), p.get("requires-python"), p.get("dependencies"),
                  p.get("optional-dependencies", {}).get("agent")], sort_keys=True))
PY
}

debian_key() {
  { printf '%s\n' "$SUITE" "$MIRROR" "$SECURITY" "${BOARD_PKGS[@]}"; declare -f build_debian; } | sha
}

board_key() {
  { echo "$1"; pyproject_deps; cat "$INSTALLER"; declare -f build_board fetch_wheels; host_cas | xargs -r cat; } | sha
}

# Run a command inside a rootfs that is not (yet) the board; no lock (we hold it exclusively).
#   in_root ROOT CMD...    or    in_root_shared ROOT SHARE_DIR [NAME=VALUE...] -- CMD...
in_root_shared() {
  local root="$1" share="$2"; shift 2
  unshare --mount --propagation private -- "$BOARD_DIR/enter.sh" "$root" "$(realpath "$CPUINFO")" "$share" "$@"
}
in_root() { local root="$1"; shift; in_root_shared "$root" "" -- "$@"; }

prefix() { sed -u "s/^/    $1| /" >&2; }

pack() {  # pack DIR TARBALL
  tar -C "$1" --numeric-owner -I 'zstd -T0 -3' -cpf "$2.tmp" .
  mv -f "$2.tmp" "$2"
}

unpack() {  # unpack TARBALL DIR (DIR must not exist)
  mkdir -p "$2"
  tar -C "$2" --numeric-owner -I zstd -xpf "$1"
}

drop_other() {  # drop_other PREFIX KEEP: remove stale cached tarballs of one layer
  local old
  for old in "$CACHE/$1"-*.tar.zst; do
    [[ -e "$old" && "$old" != "$2" ]] || continue
    say "removing the stale cache $(basename "$old")"
    rm -f "$old"
  done
}

copy_src() {  # the checkout's sources to /opt/tandoor/src in ROOT, replacing what was there
  local dst="$1$SRC_IN_BOARD"
  rm -rf --one-file-system -- "$dst"
  mkdir -p "$dst"
  # shellcheck disable=SC2046
  tar -C "$SRC_ROOT" --exclude=__pycache__ --exclude='*.pyc' -cf - $(src_items) | tar -C "$dst" -xf -
}

# ------------------------------------------------------------------------------ layers
build_debian() {
  local new="$1"
  say "mmdebstrap: arm64 $SUITE minbase + ${BOARD_PKGS[*]} (dpkg under emulation: 5-15 min)"
  # In its own mount namespace: whatever mmdebstrap mounts in the target cannot outlive it.
  # eatmydata: dpkg without fsync. Docs, man pages and locales are not needed on the board.
  unshare --mount --propagation private -- \
    mmdebstrap --mode=root --arch=arm64 --variant=minbase --include="$(IFS=,; echo "${BOARD_PKGS[*]}")" \
      --hook-dir=/usr/share/mmdebstrap/hooks/eatmydata --aptopt='Acquire::Retries "3"' \
      --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
      --dpkgopt='path-exclude=/usr/share/locale/*' \
      "$SUITE" "$new" \
      "deb $MIRROR $SUITE main" "deb $MIRROR $SUITE-updates main" "deb $SECURITY $SUITE-security main" \
      2>&1 | sed -u -e '/^processing /d' -e '/^\.\//d' | prefix mmdebstrap
  [[ -x "$new/usr/bin/python3" ]] || die "mmdebstrap did not produce a rootfs with python3"
}

# The wheels the board's pip will want: the agent extra, binary only, for the board's Python
# and manylinux aarch64 up to its glibc (most specific first, as a board's pip prefers them),
# fetched natively: pip resolving and downloading ~180 MB through TLS under qemu takes minutes
# longer. The board's own pip still resolves and installs from them.
#   fetch_wheels ROOT DIR -> prints DIR, or nothing when there is no usable pip here.
fetch_wheels() {
  local root="$1" wh="$2" pip=() v plats=() py glibc
  if [[ -x "$SRC_ROOT/.venv/bin/python" ]] && "$SRC_ROOT/.venv/bin/python" -m pip --version >/dev/null 2>&1; then
    pip=("$SRC_ROOT/.venv/bin/python" -m pip)
  elif python3 -m pip --version >/dev/null 2>&1; then
    pip=(python3 -m pip)
  else
    return 0
  fi
  py="$(readlink "$root/usr/bin/python3")"; py="${py#python}"                              # 3.11
  glibc="$(dpkg-query --admindir="$root/var/lib/dpkg" -W -f='${Version}' libc6 | cut -d- -f1)"  # 2.36
  [[ "$py" =~ ^3\.[0-9]+$ && "$glibc" =~ ^2\.[0-9]+$ ]] || return 0
  for v in $(seq "${glibc#2.}" -1 17); do plats+=(--platform "manylinux_2_${v}_aarch64"); done
  mkdir -p "$wh"
  if "${pip[@]}" download -q --disable-pip-version-check --only-binary=:all: "${plats[@]}" \
       --platform manylinux2014_aarch64 --python-version "$py" --implementation cp -d "$wh" \
       "$SRC_ROOT[agent]" "setuptools>=77" wheel 2>&1 | sed -u '/is ignored: it is neither/d' | prefix wheels; then
    # the RK3588 NPU's Python API (the emulated boards stand for RK3588s): none for every Python
    # (2.5.0 stops at 3.12), so this one may fail; install-on-board.sh then says so and goes on
    "${pip[@]}" download -q --disable-pip-version-check --only-binary=:all: "${plats[@]}" \
      --platform manylinux2014_aarch64 --python-version "$py" --implementation cp -d "$wh" \
      "$(sed -n 's/^RKNN_LITE="\(.*\)"$/\1/p' "$INSTALLER")" 2>&1 | sed -u '/is ignored: it is neither/d' | prefix wheels || true
    echo "$wh"
  fi
}

build_board() {
  local new="$1" crt n=0 wh env=()
  # pip on the board must trust what the host trusts (a TLS-intercepting proxy's CA, say). This
  # is what update-ca-certificates does with them, done natively (a minute under qemu).
  while read -r crt; do
    [[ -n "$crt" ]] || continue
    install -D -m 0644 "$crt" "$new/usr/local/share/ca-certificates/$(basename "$crt")"
    cat "$crt" >> "$new/etc/ssl/certs/ca-certificates.crt"
    n=$((n + 1))
  done < <(host_cas)
  ((n == 0)) || say "the board trusts the host's $n local CA certificate(s) too"
  [[ -e "$new/etc/resolv.conf" ]] || : > "$new/etc/resolv.conf"
  copy_src "$new"
  say "downloading the board's wheels natively (the agent extra for its Python, manylinux aarch64)"
  rm -rf --one-file-system "$CACHE/wheels"
  wh="$(fetch_wheels "$new" "$CACHE/wheels")"
  if [[ -n "$wh" ]]; then
    say "$(find "$wh" -name '*.whl' | wc -l) wheels, $(du -sh "$wh" | cut -f1); the board's pip installs from them"
    env=(TANDOOR_WHEELHOUSE=/work TANDOOR_RKNN=1)
  else
    env=(TANDOOR_RKNN=1)
    say "could not download the wheels here; the board's pip downloads them itself (slower)"
  fi
  say "installing the agent on the board: $SRC_IN_BOARD/scripts/board/install-on-board.sh" \
      "(pip install of the agent extra under emulation, a few minutes)"
  in_root_shared "$new" "${wh:-}" "${env[@]}" -- "$SRC_IN_BOARD/scripts/board/install-on-board.sh" 2>&1 |
    sed -u -E '/^ +(Downloading|Using cached) /d' | prefix install
  rm -rf --one-file-system "$CACHE/wheels"
  rm -rf --one-file-system "$new/var/cache/apt/archives/"*.deb "$new/var/lib/apt/lists/"* "$new/root/.cache"
}

smoke_test() {  # smoke_test ROOT [quick]: every agent module imports (packaging), Arm NN has CpuAcc
  local root="$1" out
  say "checking the board: arch, agent modules, Arm NN backends${2:+ (quick)}"
  out="$(in_root "$root" python -c '
import importlib, pathlib, platform, sys
# every module of the checkout'"'"'s agent/ and contract/ must import from the installed package
mods = []
for pkg, folder in (("tandoor_agent", "agent"), ("tandoor_contract", "contract")):
    src = pathlib.Path("'"$SRC_IN_BOARD"'") / folder
    mods += sorted(".".join((pkg,) + p.relative_to(src).with_suffix("").parts).removesuffix(".__init__")
                   for p in src.rglob("*.py"))
bad = []
for m in mods:
    try:
        importlib.import_module(m)
    except Exception as e:
        bad.append(f"{m}: {type(e).__name__}: {e}")
if bad:
    sys.exit("agent modules that do not import from the installed package (a subpackage missing "
             "from pyproject.toml [tool.setuptools] packages?):\n  " + "\n  ".join(bad))
from tandoor_agent.run.executors import armnn
ok, why = armnn.available()
line = [platform.machine(), f"{len(mods)} agent modules", why]
if sys.argv[1] != "quick":
    import numpy, onnxruntime, tvm
    line += [f"onnxruntime {onnxruntime.__version__}", f"tvm {tvm.__version__}", f"numpy {numpy.__version__}"]
print(" | ".join(line))
sys.exit(0 if ok and "CpuAcc" in armnn.backends() else 1)' "${2:-full}" 2>&1)" || die "board smoke test failed:
$out"
  say "board: $out"
}

# The single board of before lived in $CACHE_ROOT itself: its Debian layer (the slow part) is
# bookworm's; the rest is stale (the board layer's key changed with the second board).
migrate_old_layout() {
  [[ "$BOARD" == bookworm ]] || return 0
  local f
  for f in "$CACHE_ROOT"/debian-*.tar.zst; do
    [[ -e "$f" ]] || continue
    mkdir -p "$CACHE"
    say "moving the cached Debian layer $(basename "$f") to $CACHE (one board per directory now)"
    mv -n "$f" "$CACHE/"
  done
  if [[ -e "$CACHE_ROOT/rootfs/.tandoor-board" ]]; then
    say "removing the board of the old single-board layout ($CACHE_ROOT/rootfs)"
    safe_rm_rootfs "$CACHE_ROOT/rootfs"
  fi
  rm -f "$CACHE_ROOT"/board-*.tar.zst "$CACHE_ROOT/lock"
}

# ------------------------------------------------------------------------------ main
need_root
ensure_host_tools
ensure_binfmt
can_run_arm64
[[ -f "$CPUINFO" ]] || die "no cpuinfo file $CPUINFO"

migrate_old_layout
mkdir -p "$CACHE"
exec 9>>"$LOCK"
if ! flock -x -n 9; then
  say "waiting for board commands or another build to finish (lock $LOCK)"
  flock -x 9
fi

rm -f "$CACHE"/*.tar.zst.tmp  # from an interrupted run
dkey="$(debian_key)"
bkey="$(board_key "$dkey")"
debian_tar="$CACHE/debian-$dkey.tar.zst"
board_tar="$CACHE/board-$bkey.tar.zst"
have="$(cat "$ROOTFS/.tandoor-board" 2>/dev/null || true)"
if ((rebuild)); then
  rm -f "$debian_tar" "$board_tar"; have=""
fi
new="$CACHE/rootfs.new"
trap 'safe_rm_rootfs "$new" 2>/dev/null || true' EXIT
if [[ "$have" == "$bkey" ]]; then
  say "reusing $ROOTFS (board $bkey)"
else
  safe_rm_rootfs "$new"
  if [[ -f "$board_tar" ]]; then
    say "unpacking the cached board $(basename "$board_tar") ($(du -h "$board_tar" | cut -f1))"
    unpack "$board_tar" "$new"
  else
    if [[ -n "$have" ]]; then say "the board at $ROOTFS is stale (board $have, want $bkey): rebuilding"
    else say "no cached board $bkey: building it (once; minutes)"; fi
    if [[ -f "$debian_tar" ]]; then
      say "unpacking the cached Debian layer $(basename "$debian_tar")"
      unpack "$debian_tar" "$new"
    else
      build_debian "$new"
      say "caching the Debian layer as $(basename "$debian_tar")"
      pack "$new" "$debian_tar"
      drop_other debian "$debian_tar"
    fi
    build_board "$new"
    echo "$bkey" > "$new/.tandoor-board"
    hash_src > "$new/.tandoor-src"
    smoke_test "$new"
    say "caching the board as $(basename "$board_tar")"
    pack "$new" "$board_tar"
    drop_other board "$board_tar"
    say "cached ($(du -h "$board_tar" | cut -f1))"
  fi
  safe_rm_rootfs "$ROOTFS"
  mv "$new" "$ROOTFS"
fi
trap - EXIT

want_src="$(hash_src)"
if [[ "$(cat "$ROOTFS/.tandoor-src" 2>/dev/null || true)" != "$want_src" ]]; then
  say "the checkout changed since the board was built: reinstalling the agent from it (--no-deps)"
  rm -f "$ROOTFS/.tandoor-src"
  copy_src "$ROOTFS"
  in_root "$ROOTFS" "$VENV_IN_BOARD/bin/pip" install --disable-pip-version-check --no-cache-dir \
    --progress-bar off --no-deps --no-build-isolation --no-index -q "$SRC_IN_BOARD" 2>&1 | prefix pip
  in_root "$ROOTFS" "$SRC_IN_BOARD/scripts/board/install-on-board.sh" --service-only 2>&1 | prefix install
  smoke_test "$ROOTFS" quick
  echo "$want_src" > "$ROOTFS/.tandoor-src"
fi
say "board ready: $ROOTFS (run commands on it with scripts/board/run.sh --board $BOARD)"
echo "$ROOTFS"
