#!/usr/bin/env bash
# Check `make demo` and `make test` the way a newcomer's machine runs them: a freshly bootstrapped
# minimal Debian root with only git, make and python3 added, a clean clone of this repository's HEAD,
# then `make demo` and `make test` as root inside a chroot, each once (the first try is what counts).
#
#   tools/fresh_machine_check.sh [--keep] [--pip-cache DIR] [RELEASE ...]   (default: bookworm trixie)
#
# Needs root on a Debian/Ubuntu host (installs debootstrap with apt if missing) and the network to
# reach Debian's mirror and PyPI. Per release it writes under var/fresh/ (FRESH_DIR):
#   RELEASE-demo.log, RELEASE-test.log   what the two commands printed
#   RELEASE-result.txt                   pass/fail, durations, pytest's summary, .venv and download sizes
# and prints the same summary. The exit status is 0 only if every command of every release passed.
#
# What the root shares with the host: the kernel and the network namespace (loopback included), so
# the tests' servers bind 127.0.0.1 on free ports. The root gets its own /proc, /sys, /dev/pts (a new
# instance) and /dev/shm (tmpfs); no host directory is bound into it except with --pip-cache (pip's
# download cache, to make a second run faster: it changes where the bytes come from, not what is
# installed). Where the host reaches the network through a TLS-inspecting proxy whose CA it trusts
# through SSL_CERT_FILE/PIP_CERT (as this project's workplace does), the root gets a copy of that CA
# bundle and the same variables: that trust belongs to the network, like /etc/resolv.conf, which is
# copied too. A policy-rc.d keeps Debian's packages from starting their services (redis, prometheus)
# inside the root, where they would take the host's default ports. debootstrap's downloaded packages
# are kept in FRESH_DIR/cache/RELEASE-minbase.tgz; every run bootstraps a new root from them.
# Everything still running inside the root at the end (found by its root directory) is stopped by PID,
# the mounts are undone, and the root is removed unless --keep.
set -euo pipefail

REPO=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
FRESH_DIR=${FRESH_DIR:-$REPO/var/fresh}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
keep=0
pip_cache=""
releases=()
while [ $# -gt 0 ]; do
  case $1 in
    --keep) keep=1 ;;
    --pip-cache) pip_cache=$(realpath -m "$2"); shift ;;
    -h | --help) sed -n '2,25p' "$0"; exit 0 ;;
    -*) echo "unknown option $1" >&2; exit 2 ;;
    *) releases+=("$1") ;;
  esac
  shift
done
[ ${#releases[@]} -gt 0 ] || releases=(bookworm trixie)
[ "$(id -u)" -eq 0 ] || { echo "fresh_machine_check: needs root (debootstrap, chroot, mount)" >&2; exit 1; }
if ! command -v debootstrap >/dev/null; then
  echo "installing debootstrap"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
fi
commit=$(git -C "$REPO" rev-parse HEAD)
if [ -n "$(git -C "$REPO" status --porcelain --untracked-files=no)" ]; then
  echo "fresh_machine_check: note: uncommitted changes are not in the check; it clones $commit"
fi
mkdir -p "$FRESH_DIR/cache"

root=""
unmount_root() {
  [ -n "$root" ] && [ -d "$root" ] || return 0
  # Processes the commands left running inside the root (found by their root directory), by PID.
  local pid
  for pid in $(ls /proc | grep -E '^[0-9]+$'); do
    if [ "$(readlink "/proc/$pid/root" 2>/dev/null)" = "$root" ]; then
      echo "stopping pid $pid left in the root: $(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | cut -c1-100)"
      kill -TERM "$pid" 2>/dev/null || true
    fi
  done
  sleep 2
  for pid in $(ls /proc | grep -E '^[0-9]+$'); do
    [ "$(readlink "/proc/$pid/root" 2>/dev/null)" = "$root" ] && kill -KILL "$pid" 2>/dev/null || true
  done
  local m try
  for m in root/.cache/pip dev/shm dev/pts sys proc; do
    mountpoint -q "$root/$m" || continue
    # A process that was just killed may hold the mount a moment longer.
    for try in 1 2 3 4 5 6 7 8 9 10; do
      umount "$root/$m" 2>/dev/null && break
      sleep 1
    done
    if mountpoint -q "$root/$m"; then umount -l "$root/$m" || true; fi
  done
  return 0
}
trap unmount_root EXIT

host_ca=${PIP_CERT:-${SSL_CERT_FILE:-}}
ca_env=()
if [ -n "$host_ca" ]; then
  ca_env=(SSL_CERT_FILE=/etc/ssl/host-network-ca.pem PIP_CERT=/etc/ssl/host-network-ca.pem
    REQUESTS_CA_BUNDLE=/etc/ssl/host-network-ca.pem)
fi
in_root() {  # run a command line as root in the chroot, with a newcomer's plain environment
  chroot "$root" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM=dumb \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "${ca_env[@]}" \
    bash -c "$1"
}

status=0
for release in "${releases[@]}"; do
  root=$FRESH_DIR/$release-root
  tarball=$FRESH_DIR/cache/$release-minbase.tgz
  result=$FRESH_DIR/$release-result.txt
  unmount_root
  rm -rf "$root"
  if [ ! -s "$tarball" ]; then
    echo "== $release: downloading the minimal system (debootstrap --make-tarball)"
    debootstrap --variant=minbase --include=git,make,python3 --make-tarball="$tarball" \
      "$release" "$FRESH_DIR/tmp-$release" "$MIRROR"
    rm -rf "$FRESH_DIR/tmp-$release"
  fi
  echo "== $release: bootstrapping a minimal root with git, make, python3 in $root"
  t0=$SECONDS
  debootstrap --variant=minbase --include=git,make,python3 --unpack-tarball="$tarball" \
    "$release" "$root" "$MIRROR" >"$FRESH_DIR/$release-debootstrap.log" 2>&1 ||
    { tail -20 "$FRESH_DIR/$release-debootstrap.log"; exit 1; }
  boot_s=$((SECONDS - t0))
  security=http://deb.debian.org/debian-security
  cat >"$root/etc/apt/sources.list" <<EOF
deb $MIRROR $release main
deb $MIRROR $release-updates main
deb $security $release-security main
EOF
  printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"
  chmod +x "$root/usr/sbin/policy-rc.d"
  cp /etc/resolv.conf "$root/etc/resolv.conf"
  [ -z "$host_ca" ] || { mkdir -p "$root/etc/ssl" && cp "$host_ca" "$root/etc/ssl/host-network-ca.pem"; }
  # What every installed machine has and a bootstrapped root lacks.
  printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n' >"$root/etc/hosts"
  mount -t proc proc "$root/proc"
  mount -t sysfs -o ro sysfs "$root/sys"
  mkdir -p "$root/dev/pts" "$root/dev/shm"
  mount -t devpts -o newinstance,ptmxmode=0666 devpts "$root/dev/pts"
  mount -t tmpfs -o mode=1777 tmpfs "$root/dev/shm"
  if [ -n "$pip_cache" ]; then
    mkdir -p "$pip_cache" "$root/root/.cache/pip"
    mount --bind "$pip_cache" "$root/root/.cache/pip"
  fi
  git clone -q --no-checkout "$REPO" "$root/root/ttg"
  git -C "$root/root/ttg" checkout -q --detach "$commit"
  python=$(in_root 'python3 --version')

  run_step() {  # run_step NAME: `make NAME` in the clone, timed, logged; sets NAME_s and NAME_rc
    local name=$1 log=$FRESH_DIR/$release-$1.log t
    echo "== $release: make $name (log: $log)"
    t=$SECONDS
    set +e
    in_root "cd /root/ttg && make $name" >"$log" 2>&1
    local rc=$?
    set -e
    eval "${name}_s=$((SECONDS - t)) ${name}_rc=$rc"
    echo "   exit $rc after $((SECONDS - t)) s"
    [ $rc -eq 0 ] || tail -30 "$log"
  }
  run_step demo
  venv_demo=$(du -sm "$root/root/ttg/.venv" 2>/dev/null | cut -f1 || echo 0)
  run_step test
  venv_test=$(du -sm "$root/root/ttg/.venv" 2>/dev/null | cut -f1 || echo 0)
  pip_mb=$(du -sm "$root/root/.cache/pip" 2>/dev/null | cut -f1 || echo 0)
  torch=$(in_root '/root/ttg/.venv/bin/python -c "import torch; print(torch.__version__)"' 2>/dev/null || echo none)
  summary=$(grep -E '[0-9]+ (passed|failed|errors?)\b.* in [0-9.]+s' "$FRESH_DIR/$release-test.log" | tail -1 | tr -d '=' | xargs || true)
  demo_ok=$([ "$demo_rc" -eq 0 ] && grep -q 'what was said' "$FRESH_DIR/$release-demo.log" && echo pass || echo FAIL)
  test_ok=$([ "$test_rc" -eq 0 ] && echo pass || echo FAIL)
  cat >"$result" <<EOF
release=$release
commit=$commit
python=$python
bootstrap_s=$boot_s
demo=$demo_ok
demo_s=$demo_s
venv_after_demo_mb=$venv_demo
test=$test_ok
test_s=$test_s
venv_after_test_mb=$venv_test
pip_cache_mb=$pip_mb
pip_cache_shared=$([ -n "$pip_cache" ] && echo yes || echo no)
host_network_ca=$([ -n "$host_ca" ] && echo yes || echo no)
torch=$torch
pytest=$summary
EOF
  echo "== $release result"
  sed 's/^/   /' "$result"
  [ "$demo_ok" = pass ] && [ "$test_ok" = pass ] || status=1
  unmount_root
  [ $keep -eq 1 ] || rm -rf "$root"
done
root=""
exit $status
