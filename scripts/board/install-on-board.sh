#!/usr/bin/env bash
# Installs the Tandoor agent on an arm64 board, from a checkout of this repository on the board.
# Run as root from the checkout:
#
#   sudo scripts/board/install-on-board.sh
#
# - Distribution packages, chosen for the distribution it runs on (/etc/os-release; the table
#   below): python3, python3-venv, Arm NN's Python binding (python3-pyarmnn) with its CpuAcc (ACL
#   NEON) and CpuRef backends, and the GpuAcc (ACL OpenCL) backend on a board with a Mali GPU.
#   It says what it chose and why. Arm NN 20.08 on Debian 12 bookworm and Ubuntu 22.04 jammy,
#   23.08 on Debian 13 trixie and Ubuntu 24.04 noble (the last Arm NN with a Python binding);
#   the agent speaks both (agent/run/executors/armnn.py);
# - the venv $TANDOOR_VENV (default /opt/tandoor/venv) with the agent: pip install of the
#   checkout's `agent` extra, binary wheels only (apache-tvm's aarch64 runtime, onnxruntime...);
#   the distribution's pyarmnn is exposed to it alone (a pyarmnn-only path: all of dist-packages
#   would shadow the venv's numpy with the distribution's);
# - systemd/tandoor-agent.service, when the checkout has it, installed and enabled (not started)
#   with what it expects: the `tandoor` system user and /etc/tandoor/agent.toml (from
#   systemd/agent.toml.example unless there is one already).
# - on an RK3588 (device tree rockchip,rk3588, or TANDOOR_RKNN=1): rknn-toolkit-lite2 into the
#   venv, the rknn executor's RKNNLite (docs/npu.md), and a word on librknnrt.so when it is
#   missing (no package registry has it; the agent then runs rknn orders on their ONNX rendering);
# - on an NVIDIA Jetson: what it found for the agent's GPU path (docs/gpu.md): the L4T release and
#   its JetPack, the CUDA runtimes, the driver's libcuda.so.1, TVM's libtvm_runtime_cuda.so in the
#   venv, and one verdict line: whether the agent will run bundles' GPU part, and if not why;
# Idempotent. scripts/board/build.sh runs this same script inside the emulated boards.
# Env: TANDOOR_VENV; TANDOOR_WHEELHOUSE=DIR installs from the wheels in DIR only (a board
#      without internet; scripts/board/build.sh shows how to `pip download` them elsewhere);
#      TANDOOR_GPUACC=1|0 installs the GpuAcc backend or not, whatever the Mali detection says;
#      TANDOOR_DISTRO=CODENAME overrides /etc/os-release's VERSION_CODENAME (a derivative);
#      TANDOOR_RKNN=1|0 installs the RK3588 NPU's Python API or not, whatever the device tree says;
#      TANDOOR_BOARD_ROOT=DIR the GPU findings read DIR's files (default /; the venv: DIR$TANDOOR_VENV).
#   --print-packages [CODENAME]  print the packages for CODENAME (default: this system's) and exit
#   --print-gpu                  print the GPU findings (no root needed) and exit
#   --service-only               only the systemd part (after the unit file changed)
set -euo pipefail
SRC="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${TANDOOR_VENV:-/opt/tandoor/venv}"
BASE_PKGS=(python3 python3-venv ca-certificates python3-pyarmnn)
# codename -> "what it is|Arm NN backend package suffix" (the libarmnn ABI: 22 = 20.08, 33 = 23.08)
declare -A DISTROS=(
  [bookworm]="Debian 12, Arm NN 20.08|22"
  [jammy]="Ubuntu 22.04, Arm NN 20.08|22"
  [trixie]="Debian 13, Arm NN 23.08|33"
  [noble]="Ubuntu 24.04, Arm NN 23.08|33"
)
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

# The RK3588's NPU: its Python API (the agent's rknn executor) is on PyPI; its runtime library
# librknnrt.so is not (vendor images carry it). Must match the toolkit that writes the .rknn.
RKNN_LITE="rknn-toolkit-lite2==2.5.0"
RKNN_LIBS=(/usr/lib/librknnrt.so /usr/lib64/librknnrt.so /usr/lib/aarch64-linux-gnu/librknnrt.so /usr/local/lib/librknnrt.so)

# Prints why this is an RK3588 (or TANDOOR_RKNN=1), or nothing.
rk3588() {
  case "${TANDOOR_RKNN:-auto}" in
    1) echo "TANDOOR_RKNN=1"; return ;;
    0) return 0 ;;
  esac
  local f
  for f in /proc/device-tree/compatible /sys/firmware/devicetree/base/compatible; do
    [[ -r "$f" ]] && tr '\0' '\n' < "$f" | grep -q '^rockchip,rk3588' && { echo "device tree rockchip,rk3588"; return; }
  done
  return 0
}

install_rknn() {
  local why lib
  why="$(rk3588)"
  [[ -n "$why" ]] || return 0
  say "RK3588 ($why): pip install $RKNN_LITE (RKNNLite, the agent's rknn executor)"
  if ! "$VENV/bin/python" -m pip install --disable-pip-version-check --no-cache-dir --progress-bar off \
         --only-binary=:all: "${index[@]}" "$RKNN_LITE"; then
    say "pip could not install $RKNN_LITE for $("$VENV/bin/python" -V) (above; 2.5.0 has aarch64 wheels for" \
        "CPython 3.6-3.12 only); rknn orders will run their ONNX rendering through onnxruntime"
    return 0
  fi
  for lib in "${RKNN_LIBS[@]}"; do
    [[ -e "$lib" ]] && { say "NPU runtime library: $lib"; return 0; }
  done
  say "librknnrt.so is missing: no package registry has it. Vendor RK3588 images carry it as /usr/lib/librknnrt.so;" \
      "else copy rknpu2/runtime/Linux/librknn_api/aarch64/librknnrt.so from Rockchip's rknn-toolkit2 repository" \
      "(release 2.5.0, the toolkit's) to /usr/lib. Until then rknn orders run their ONNX rendering and status says" \
      "npu: unavailable"
}

this_codename() {
  local codename="${TANDOOR_DISTRO:-}"
  if [[ -z "$codename" && -r /etc/os-release ]]; then
    codename="$(. /etc/os-release && echo "${VERSION_CODENAME:-${UBUNTU_CODENAME:-}}")"
  fi
  echo "$codename"
}

# A Mali GPU that ACL's OpenCL kernels can use: Arm's kernel driver (/dev/mali0, what the
# vendor images of RK3588 and other Mali boards ship with libmali's OpenCL), or a device-tree
# node compatible with arm,mali-*. Prints why, or nothing.
mali_gpu() {
  if [[ -e /dev/mali0 ]]; then echo "/dev/mali0"; return; fi
  local f
  for f in /sys/firmware/devicetree/base/*/compatible /sys/firmware/devicetree/base/*/*/compatible; do
    [[ -r "$f" ]] && tr '\0' '\n' < "$f" | grep -q '^arm,mali' && { echo "device tree ${f%/compatible}"; return; }
  done
  return 0
}

# --- NVIDIA Jetson: what the agent's GPU path needs (agent/run/gpu.py, docs/gpu.md) -------------
# The agent runs a bundle's GPU part when NVIDIA's driver libcuda.so.1 serves CUDA 13, the GPU's SM
# is one the bundle has cubins for, and TVM's libtvm_runtime_cuda.so (apache-tvm 0.27's wheel) loads
# with libcudart.so.13; else it runs the CPU library and says `gpu: unavailable (why)`. gpu_report
# reads the same facts from files, before any bundle exists. Everything is read under BOARD_ROOT
# (TANDOOR_BOARD_ROOT, default /: a rootfs looked at from outside, or the tests' fake trees).
BOARD_ROOT="${TANDOOR_BOARD_ROOT:-/}"
# L4T major release -> "JetPack|CUDA major its driver serves" (JetPack 6's CUDA upgrades stay 12.x)
declare -A JETPACKS=([35]="5|11" [36]="6|12" [38]="7|13")
# device-tree SoC -> "module|its GPU's SM"
declare -A TEGRAS=([tegra194]="Xavier|sm_72" [tegra234]="Orin|sm_87" [tegra264]="Thor|sm_110")
# SM -> the aarch64 target that builds cubins for it (compiler/targets.py; tests check they agree)
declare -A GPU_TARGETS=([sm_87]=jetson-orin)
NEED_CUDA=13    # libtvm_runtime_cuda.so of TVM 0.27 links libcudart.so.13 (contract/gpu.py RUNTIME)
CUDART_DIRS=(/usr/local/cuda/lib64 /usr/local/cuda-*/lib64 /usr/local/cuda/targets/aarch64-linux/lib
             /usr/local/cuda-*/targets/aarch64-linux/lib /usr/lib/aarch64-linux-gnu)
DRIVER_DIRS=(/usr/lib/aarch64-linux-gnu/nvidia /usr/lib/aarch64-linux-gnu/tegra /usr/lib/aarch64-linux-gnu /usr/lib64)

# The device tree's compatible strings under BOARD_ROOT, one a line.
dt_compatible() {
  local f
  for f in proc/device-tree/compatible sys/firmware/devicetree/base/compatible; do
    [[ -r "${BOARD_ROOT%/}/$f" ]] && { tr '\0' '\n' < "${BOARD_ROOT%/}/$f"; return; }
  done
  return 0
}

# The agent venv's site-packages under BOARD_ROOT, or nothing.
venv_site() {
  local d
  for d in "${BOARD_ROOT%/}$VENV"/lib/python3*/site-packages; do [[ -d "$d" ]] && { echo "$d"; return; }; done
  return 0
}

# Prints the GPU findings, one a line, the last `verdict: ...`; never fails.
gpu_report() {
  local r="${BOARD_ROOT%/}" rel="" l4t="" jp="" jp_cuda="" soc="" module="" sm="" compat d f major
  local site="" driver="" tvm_ver="" cuda_json="" cudart13=""
  local -a why=() found=()
  local -A cudart=()
  if [[ -r "$r/etc/nv_tegra_release" ]]; then
    rel="$(head -n1 "$r/etc/nv_tegra_release")"
    # "# R36 (release), REVISION: 4.3, GCID: ..." -> 36.4.3
    l4t="$(sed -n 's/^# R\([0-9]*\) (release), REVISION: \([0-9.]*\).*/\1.\2/p' <<< "$rel")"
  fi
  compat="$(dt_compatible | grep -m1 '^nvidia,tegra' || true)"
  if [[ -z "$rel" && -z "$compat" ]]; then
    # not a Jetson: a discrete NVIDIA GPU on an arm64 server would still have the driver
    for d in "${DRIVER_DIRS[@]}"; do [[ -e "$r$d/libcuda.so.1" ]] && driver="$d/libcuda.so.1" && break; done
    if [[ -z "$driver" ]]; then
      echo "GPU: no NVIDIA Jetson or driver found: bundles run their CPU library"
      return 0
    fi
    found+=("GPU: not a Jetson; NVIDIA driver $driver")
  else
    soc="${compat#nvidia,}"
    if [[ -n "${TEGRAS[$soc]:-}" ]]; then module="${TEGRAS[$soc]%|*}" sm="${TEGRAS[$soc]#*|}"; fi
    if [[ -n "$l4t" && -n "${JETPACKS[${l4t%%.*}]:-}" ]]; then
      jp="${JETPACKS[${l4t%%.*}]%|*}" jp_cuda="${JETPACKS[${l4t%%.*}]#*|}"
    fi
    f="GPU: NVIDIA Jetson${module:+ $module}${compat:+ (device tree $compat${sm:+, $sm})}: L4T ${l4t:-unknown}"
    found+=("$f${rel:+ (/etc/nv_tegra_release)}, JetPack ${jp:-unknown}${jp_cuda:+ (its driver serves CUDA $jp_cuda)}")
    for d in "${DRIVER_DIRS[@]}"; do [[ -e "$r$d/libcuda.so.1" ]] && driver="$d/libcuda.so.1" && break; done
    found+=("GPU: driver: ${driver:-libcuda.so.1 not found (in ${DRIVER_DIRS[*]})}")
  fi
  site="$(venv_site)"
  # the CUDA runtimes: the system's, and PyPI's nvidia-cuda-runtime in the venv (the agent looks there too)
  for d in "${CUDART_DIRS[@]}" "${site#"$r"}/nvidia/cu13/lib"; do
    for f in "$r"$d/libcudart.so.[0-9]*; do
      [[ -e "$f" ]] || continue
      major="${f##*/libcudart.so.}" major="${major%%.*}"
      [[ -n "${cudart[$major]:-}" ]] || cudart[$major]="${f#"$r"}"
    done
  done
  if [[ -r "$r/usr/local/cuda/version.json" ]]; then
    cuda_json="$(tr -d '\n' < "$r/usr/local/cuda/version.json" | grep -o '"cuda"[[:space:]]*:[[:space:]]*{[^}]*}' |
                 grep -o '"version"[[:space:]]*:[[:space:]]*"[^"]*"' | sed 's/.*"\([^"]*\)"$/\1/' || true)"
  fi
  local runtimes=""
  for major in $(printf '%s\n' "${!cudart[@]}" | sort -n); do runtimes+="${runtimes:+, }libcudart.so.$major (${cudart[$major]})"; done
  found+=("GPU: CUDA runtime: ${runtimes:-no libcudart.so found}${cuda_json:+; /usr/local/cuda/version.json: CUDA $cuda_json}")
  cudart13="${cudart[$NEED_CUDA]:-}"
  if [[ -z "$site" ]]; then
    found+=("GPU: TVM's CUDA runtime: no agent venv at $VENV yet")
  else
    f="$(compgen -G "$site/apache_tvm-*.dist-info" | head -n1 || true)"
    [[ -n "$f" ]] && tvm_ver="${f##*/apache_tvm-}" tvm_ver="${tvm_ver%.dist-info}"
    if [[ -e "$site/tvm/lib/libtvm_runtime_cuda.so" ]]; then
      found+=("GPU: TVM's CUDA runtime: libtvm_runtime_cuda.so in $VENV (apache-tvm ${tvm_ver:-?})")
    else
      found+=("GPU: TVM's CUDA runtime: libtvm_runtime_cuda.so not in $VENV's tvm (apache-tvm ${tvm_ver:-not installed})")
    fi
  fi
  printf '%s\n' "${found[@]}"
  # the verdict: what the agent's probe (agent/run/gpu.py) will refuse, in its order
  [[ -n "$driver" ]] || why+=("no NVIDIA driver libcuda.so.1 (JetPack's nvidia-l4t-cuda package)")
  if [[ -n "$jp_cuda" ]] && ((jp_cuda < NEED_CUDA)); then
    why+=("JetPack $jp's driver serves CUDA $jp_cuda; TVM 0.27's CUDA runtime needs CUDA $NEED_CUDA and libcudart.so.$NEED_CUDA (JetPack 7.x): flash JetPack 7 to use the GPU")
  fi
  if [[ -n "$sm" && -z "${GPU_TARGETS[$sm]:-}" ]]; then
    why+=("this GPU is $sm; no Tandoor target builds cubins for it (${!GPU_TARGETS[*]}: ${GPU_TARGETS[*]})")
  fi
  if [[ -z "$cudart13" && ! ( -n "$jp_cuda" && jp_cuda -lt NEED_CUDA ) ]]; then
    why+=("no libcudart.so.$NEED_CUDA: install the CUDA $NEED_CUDA runtime (JetPack 7's, or pip install nvidia-cuda-runtime into $VENV)")
  fi
  if [[ -n "$site" && ! -e "$site/tvm/lib/libtvm_runtime_cuda.so" ]]; then
    why+=("no libtvm_runtime_cuda.so: reinstall the agent (its apache-tvm 0.27 wheel has it)")
  fi
  local v="" w
  for w in "${why[@]}"; do v+="${v:+; }$w"; done
  if [[ -n "$v" ]]; then
    echo "GPU: verdict: the agent skips bundles' GPU part and runs their CPU library (gpu: unavailable): $v; see docs/gpu.md"
  elif [[ -z "$jp_cuda" || -z "$sm" ]]; then   # the driver's CUDA or the SM unknown from files
    echo "GPU: verdict: the agent tries bundles' GPU part at load (it needs the driver to serve CUDA $NEED_CUDA and a GPU" \
         "the bundle has cubins for); tandoor-agent status says gpu: unavailable (why) if not"
  else
    echo "GPU: verdict: the agent runs the GPU part of bundles built with --target ${GPU_TARGETS[$sm]} ($sm), after checking it on the bundle's golden pair at load"
  fi
}

# choose CODENAME: PKGS and CHOSEN (one line: what was chosen and why)
choose() {
  local codename="$1" entry abi gpu why
  if [[ -z "$codename" ]]; then
    echo "cannot tell this distribution (no VERSION_CODENAME in /etc/os-release); set TANDOOR_DISTRO to one of: ${!DISTROS[*]}" >&2
    exit 2
  fi
  entry="${DISTROS[$codename]:-}"
  if [[ -z "$entry" ]]; then
    echo "no Arm NN package table for '$codename'; known: ${!DISTROS[*]} (a derivative: TANDOOR_DISTRO=<its base's codename>)" >&2
    exit 2
  fi
  abi="${entry#*|}"
  PKGS=("${BASE_PKGS[@]}" "libarmnn-cpuacc-backend$abi" "libarmnn-cpuref-backend$abi")
  case "${TANDOOR_GPUACC:-auto}" in
    1) gpu=1 why="TANDOOR_GPUACC=1" ;;
    0) gpu=0 why="TANDOOR_GPUACC=0" ;;
    *) why="$(mali_gpu)"; if [[ -n "$why" ]]; then gpu=1 why="Mali GPU: $why"; else gpu=0 why="no Mali GPU found"; fi ;;
  esac
  CHOSEN="$codename (${entry%|*}): CpuAcc + CpuRef backends"
  if ((gpu)); then PKGS+=("libarmnn-gpuacc-backend$abi"); CHOSEN+=" + GpuAcc"; fi
  CHOSEN+=" ($why)"
}

if [[ "${1:-}" == --print-packages ]]; then choose "${2:-$(this_codename)}"; echo "${PKGS[*]}"; exit 0; fi
if [[ "${1:-}" == --print-gpu ]]; then gpu_report || true; exit 0; fi
[[ $(id -u) -eq 0 ]] || { echo "run as root (sudo $0)" >&2; exit 1; }
if [[ "${1:-}" == --service-only ]]; then install_service; exit 0; fi
[[ $# -eq 0 ]] || { echo "usage: $0 [--print-packages [CODENAME] | --print-gpu | --service-only]" >&2; exit 2; }
[[ "$(uname -m)" == aarch64 ]] || say "warning: this is $(uname -m), not aarch64"
choose "$(this_codename)"
say "packages for $CHOSEN: ${PKGS[*]}"

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

install_rknn
# the GPU findings, now that the venv's TVM is there to look at; they never fail the install
while IFS= read -r line; do say "$line"; done < <(gpu_report || true)
install_service
say "done: $("$VENV/bin/tandoor-agent" --version)"
