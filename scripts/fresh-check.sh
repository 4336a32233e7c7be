#!/usr/bin/env bash
# The README's two commands on a machine that has nothing: a minimal Debian 12 root made by mmdebstrap
# (--variant=minbase), the working tree copied in (tracked and untracked files, not what .gitignore
# ignores), only make, g++ and cmake installed, then `make run` and `make test` inside it with chroot.
# A dependency that this machine has only because someone installed it by hand fails here.
#
#   sudo scripts/fresh-check.sh [--keep] [--root DIR] [--only-run]
#     --keep      leave the root folder in place afterwards (to look inside; it is printed)
#     --root DIR  build the root in DIR (must not exist yet); default: a new folder under /var/tmp
#     --only-run  run `make run` only (a quicker check of the install and build)
# Needs root (mmdebstrap, mount, chroot) and Debian's package archive. Takes ~10 minutes on 2 cores.
set -euo pipefail

keep=0
only_run=0
root=""
while [ $# -gt 0 ]; do
  case "$1" in
    --keep) keep=1 ;;
    --only-run) only_run=1 ;;
    --root) root="${2:?--root needs a folder}"; shift ;;
    -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "fresh-check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done

[ "$(id -u)" -eq 0 ] || { echo "fresh-check: needs root (mmdebstrap, mount and chroot)" >&2; exit 2; }
src="$(cd "$(dirname "$0")/.." && pwd)"
command -v mmdebstrap >/dev/null || {
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap
}

if [ -z "$root" ]; then
  root="$(mktemp -d /var/tmp/moex-fresh.XXXXXX)"
  rmdir "$root"  # mmdebstrap wants to create it
fi
[ -e "$root" ] && { echo "fresh-check: $root exists; give a new folder to --root" >&2; exit 2; }

mounts=()
ca_env=""
cleanup() {
  local status=$?
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do umount -l "${mounts[i]}" 2>/dev/null || true; done
  if [ "$keep" -eq 1 ]; then
    echo "fresh-check: root kept at $root"
  else
    rm -rf --one-file-system "$root"
  fi
  exit $status
}
trap cleanup EXIT
trap 'exit 130' INT TERM

echo "fresh-check: making a minimal Debian 12 root in $root"
start=$(date +%s)
mmdebstrap --quiet --variant=minbase --include=make,g++,cmake bookworm "$root" \
  "deb http://deb.debian.org/debian bookworm main" \
  "deb http://deb.debian.org/debian bookworm-updates main" \
  "deb http://deb.debian.org/debian-security bookworm-security main"
echo "fresh-check: root ready in $(( $(date +%s) - start )) s"

# The working tree as a newcomer's clone would have it, plus files not yet committed.
mkdir -p "$root/src"
(cd "$src" && git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf -) | tar -xf - -C "$root/src"

# What a booted machine has: /proc, /sys, /dev, a tmpfs /dev/shm (MPI's shared memory).
for m in proc sys dev dev/pts; do
  mkdir -p "$root/$m"
  mount --rbind "/$m" "$root/$m"
  mount --make-rslave "$root/$m"
  mounts+=("$root/$m")
done
mkdir -p "$root/dev/shm"
mount -t tmpfs -o size=2g tmpfs "$root/dev/shm"
mounts+=("$root/dev/shm")
cp /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
# This machine's network, not a dependency: a machine whose egress goes through a TLS proxy trusts its CA
# from /usr/local/share/ca-certificates; so does the root (ca-certificates, installed by install-deps,
# adds them to the bundle npm and apt read).
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
  mkdir -p "$root/usr/local/share/ca-certificates"
  cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
  ca_env="NODE_EXTRA_CA_CERTS=/etc/ssl/certs/ca-certificates.crt"  # node's own CA list lacks them
fi

targets="make run N=8"
[ "$only_run" -eq 1 ] || targets="$targets && make test"
echo "fresh-check: running '$targets' inside the root"
start=$(date +%s)
if chroot "$root" /usr/bin/env -i HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
     LANG=C.UTF-8 TERM=dumb $ca_env /bin/bash -c "cd /src && $targets"; then
  echo "fresh-check: PASSED ($targets) in $(( $(date +%s) - start )) s"
else
  status=$?
  echo "fresh-check: FAILED ($targets), exit $status" >&2
  exit $status
fi
