#!/usr/bin/env bash
# Internal (used by run.sh and build.sh): must already run in a private mount namespace
# (unshare --mount --propagation private). Mounts what the board needs and chroots into it;
# every mount vanishes with the namespace when the command exits.
#   enter.sh ROOTFS CPUINFO SHARE_DIR|"" [NAME=VALUE...] -- CMD [ARGS...]
set -euo pipefail
R="$1" CPU="$2" SHARE="$3"
shift 3
envs=()
while (($#)) && [[ "$1" != -- ]]; do envs+=("$1"); shift; done
[[ "${1:-}" == -- ]] && shift
(($#)) || set -- /bin/bash

# Belt and braces: unshare --propagation private already made every mount private, so nothing
# below can propagate back to the host.
mount --make-rprivate /
mount -t proc proc "$R/proc"
# qemu-user shows the host's x86 /proc/cpuinfo to the guest: onnxruntime crashes on import and
# ACL finds no Arm cores. The board sees an Arm one instead.
mount --bind "$CPU" "$R/proc/cpuinfo"
mount --rbind /sys "$R/sys"
mount --rbind /dev "$R/dev"
mount -t tmpfs -o mode=1777 tmpfs "$R/tmp"
if [[ -f /etc/resolv.conf && -e "$R/etc/resolv.conf" ]]; then
  mount --bind /etc/resolv.conf "$R/etc/resolv.conf"
fi
cwd=/root
if [[ -n "$SHARE" ]]; then
  mkdir -p "$R/work"
  mount --bind "$SHARE" "$R/work"
  cwd=/work
fi
exec chroot "$R" /usr/bin/env -i \
  HOME=/root LANG=C.UTF-8 TERM="${TERM:-dumb}" ${QEMU_CPU:+QEMU_CPU="$QEMU_CPU"} \
  PATH=/opt/tandoor/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  "${envs[@]}" \
  /bin/sh -c 'cd "$0" && exec "$@"' "$cwd" "$@"
