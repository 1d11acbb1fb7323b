#!/usr/bin/env bash
# Install the system packages the tests and the demo use (real redis-server, sipp, espeak-ng, sox,
# promtool, OpenBLAS), only those that are missing. Debian/Ubuntu: apt; macOS: Homebrew.
# On Debian/Ubuntu it also adds python3-venv when $PYTHON (default python3) is the distribution's own
# Python: its `-m venv` needs that package, and a minimal install does not have it.
set -euo pipefail
pkgs=("$@")
if [ "$(uname -s)" = "Darwin" ]; then
  command -v brew >/dev/null || { echo "Homebrew is needed on macOS: https://brew.sh" >&2; exit 1; }
  missing=()
  for p in "${pkgs[@]}"; do brew list --formula "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] || brew install "${missing[@]}"
  exit 0
fi
python=$(command -v "${PYTHON:-python3}" || true)
if [ -n "$python" ] && dpkg-query -S "$(readlink -f "$python")" >/dev/null 2>&1; then
  pkgs+=(python3-venv)
fi
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "installing system packages: ${missing[*]}"
$sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq
$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
# The Debian prometheus and redis packages start system services; the tests start their own on
# loopback ports, so the system ones are left as the package set them up.
