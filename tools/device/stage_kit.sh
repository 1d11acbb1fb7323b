#!/usr/bin/env bash
# Stage what a whole-gateway run needs on the lent H200 (x86_64, Python 3.12, no network, no
# redis-server, no pydantic/redis-py/soxr/...) into one folder that travels with a device call:
#
#   tools/device/stage_kit.sh DEST [MLX_STAGE_SCRIPT]
#
#   DEST/repo/            this checkout's tracked files (git archive of HEAD) but what does not run there:
#                         the embedded demo model (the run generates its full-size bundle), tests, docs, ops
#   DEST/repo/.before/    with BEFORE=COMMIT: that commit's asr_core/ and gateway/, so that one device call
#                         compares two codes on one machine (lent machines differ by more than most
#                         changes: docs/benchmarks.md), through the same tools and kit
#                         (tools/device/ab.sh runs a phase with each code in turn)
#   DEST/repo/.whl/       MLX + its trimmed CUDA backend (MLX_STAGE_SCRIPT, default
#                         ../shared/tools/stage_mlx_cuda.sh) and, in extra/, cp312 manylinux wheels of
#                         the gateway's dependencies the image lacks (device_env.sh installs them), and
#                         py-spy's (PROFILER=0: not)
#   DEST/repo/.kit/redis.tar.xz   redis-server and the shared libraries it links (not glibc)
#   DEST/repo/.kit/espeak.tar.xz  espeak-ng, its libraries and data (tools/demo_model/espeak_bundle.sh)
#   DEST/repo/.kit/audio/         espeak-ng speech for the calls
#
# The device command then starts with (carry DEST's path relative to the repository that travels):
#   cd DEST/repo && source .whl/device_env.sh && source tools/device/kit_env.sh && ...
# Everything must fit the device's 64 MiB limit together with that repository's own files: the
# script prints the sizes.
set -euo pipefail
dest=${1:?usage: stage_kit.sh DEST [MLX_STAGE_SCRIPT]}
root=$(git rev-parse --show-toplevel)
stage_mlx=${2:-$root/../shared/tools/stage_mlx_cuda.sh}
[ -f "$stage_mlx" ] || [ -f "$dest/mlx-stage/.whl/device_env.sh" ] || {
  echo "MLX stage script not found at $stage_mlx: give its path as the second argument" >&2; exit 1; }
py=${PYTHON:-$root/.venv/bin/python}
mkdir -p "$dest"
dest=$(cd "$dest" && pwd)
rm -rf "$dest/repo"
mkdir -p "$dest/repo"

# 1. The code.
(cd "$root" && git archive HEAD -- . ':(exclude)asr_core/demo_model' ':(exclude)tests' ':(exclude)docs' \
  ':(exclude)ops') | tar -x -C "$dest/repo"
if [ -n "${BEFORE:-}" ]; then
  mkdir -p "$dest/repo/.before"
  (cd "$root" && git archive "$BEFORE" -- asr_core gateway ':(exclude)asr_core/demo_model') \
    | tar -x -C "$dest/repo/.before"
fi

# 2. MLX with CUDA. The shared stage script writes .whl/ into the git checkout it runs in (and edits its
#    .git/info/exclude): run it in a scratch repository and take its .whl/.
mlx="$dest/mlx-stage"
if [ ! -f "$mlx/.whl/device_env.sh" ] || ! ls "$mlx"/.whl/mlx_cuda_13-*-sm90.tar.xz >/dev/null 2>&1; then
  rm -rf "$mlx" && mkdir -p "$mlx" && git -C "$mlx" init -q
  (cd "$mlx" && bash "$stage_mlx")
fi
mkdir -p "$dest/repo/.whl/extra"
cp "$mlx"/.whl/mlx-*-cp312-*.whl "$mlx"/.whl/mlx_cuda_13-*-sm90.tar.xz "$mlx"/.whl/device_env.sh "$dest/repo/.whl/"

# 3. Wheels the image lacks, at the versions this checkout's virtualenv runs.
missing="pydantic pydantic-core pydantic-settings annotated-types typing-inspection python-dotenv redis
hiredis soxr soundfile cffi pycparser jiwer rapidfuzz webrtcvad-wheels defusedxml"
pins=()
for name in $missing; do
  version=$("$py" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
  [ -n "$version" ] || { echo "$name is not installed in $py's environment" >&2; exit 1; }
  pins+=("$name==$version")
done
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dest/repo/.whl/extra" "${pins[@]}"
# py-spy (a profiler, one static binary, ~3 MB) for the profiling phases; the runs go on without it.
# PROFILER=0 leaves it out: a kit with BEFORE= is otherwise past the device's limit.
if [ "${PROFILER:-1}" = 1 ]; then
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux1_x86_64 \
    -d "$dest/repo/.whl/extra" py-spy==0.4.3 || echo "py-spy not staged: the runs will not profile" >&2
fi

# 4. redis-server with its libraries (glibc stays the host's; kit_env.sh puts the host's library folders
#    first, so ours only fill in what the image does not have).
kit="$dest/repo/.kit"
mkdir -p "$kit"
tmp=$(mktemp -d)
mkdir -p "$tmp/bin" "$tmp/lib"
bin=$(readlink -f "$(command -v redis-server)")
cp "$bin" "$tmp/bin/redis-server"
ldd "$bin" | awk '$3 ~ /^\// {print $3}' | grep -v -E '/(libc|libm|libstdc\+\+|libgcc_s)\.so' | while read -r lib; do
  cp -L "$lib" "$tmp/lib/"
done
tar -C "$tmp" -cJf "$kit/redis.tar.xz" .
rm -rf "$tmp"

# 5. espeak-ng with its libraries and data (make-bundle's speech calibration speaks on the device).
tmp=$(mktemp -d)
sh "$root/tools/demo_model/espeak_bundle.sh" "$tmp/esp" >/dev/null
tar -C "$tmp" -cJf "$kit/espeak.tar.xz" esp
rm -rf "$tmp"

# 6. Speech for the calls.
(cd "$root" && "$py" -c "
import sys
from pathlib import Path
from tools.replay.audio import generate_espeak
generate_espeak(Path(sys.argv[1]), int(sys.argv[2]))
" "$kit/audio" "${KIT_AUDIO_FILES:-10}")

for part in "$dest/repo/.whl" "$dest/repo/.kit"; do du -sh "$part"; done
du -sh --exclude=.whl --exclude=.kit "$dest/repo"
# The call sends the checkout's tracked files too, and its untracked ones that git does not ignore: counted
# on disk (whole blocks), the larger of the two measures, so that a kit this passes is not refused.
kit_kib=$(du -sk "$dest/repo" | cut -f1)
sent_kib=$(cd "$root" && git ls-files -z --cached --others --exclude-standard | xargs -0 du -k 2>/dev/null \
  | awk '{s += $1} END {print s + 0}')
total_mib=$(( (kit_kib + sent_kib) / 1024 ))
echo "the kit and the checkout's files the call sends: $total_mib MiB of the device call's 64 MiB"
[ "$total_mib" -lt 64 ] || echo "past the limit: stage with PROFILER=0, or fewer KIT_AUDIO_FILES" >&2
