#!/bin/sh
# Copy this machine's espeak-ng (binary, the shared libraries it links, and the English and Ukrainian
# data) into one folder that runs elsewhere, e.g. on the GPU machine, which has no espeak-ng and no
# package mirror: the second training session built its corpus shards there (docs/demo-model.md).
#
#   tools/demo_model/espeak_bundle.sh .esp          # then, there: PATH=$PWD/.esp/bin:$PATH
#
# glibc (libc, libm) stays the host's; everything else espeak-ng links comes along, since its audio
# output libraries (pcaudio -> ALSA, PulseAudio) are rarely installed on a compute image. Same binary and
# data, so the same waveforms: a shard built there had the byte count of the one built here.
set -eu
out=${1:?usage: espeak_bundle.sh OUT_DIR}
bin=$(command -v espeak-ng) || { echo "espeak-ng not found (Debian: apt-get install espeak-ng)" >&2; exit 1; }
data=$(espeak-ng --version | sed -n 's/.*Data at: *//p')
[ -d "$data" ] || { echo "espeak-ng data folder not found: '$data'" >&2; exit 1; }
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib" "$out/share/espeak-ng-data"
cp "$bin" "$out/bin/espeak-ng.real"
ldd "$bin" | awk '$3 ~ /^\// {print $3}' | grep -v -E '/(libc|libm)\.so' | while read -r lib; do
  cp -L "$lib" "$out/lib/"
done
# Only what the demo corpus speaks: phoneme tables, intonation, the en and uk dictionaries, voices, languages.
cp -r "$data"/phon* "$data/intonations" "$data/en_dict" "$data/uk_dict" "$data/voices" "$data/lang" \
  "$out/share/espeak-ng-data/"
cat > "$out/bin/espeak-ng" <<'WRAP'
#!/bin/sh
here=$(dirname "$(readlink -f "$0")")
LD_LIBRARY_PATH="$here/../lib" ESPEAK_DATA_PATH="$here/../share" exec "$here/espeak-ng.real" "$@"
WRAP
chmod +x "$out/bin/espeak-ng"
"$out/bin/espeak-ng" -v en-us --stdout "check" | head -c 4 | grep -q RIFF || { echo "bundle does not speak" >&2; exit 1; }
echo "$out: $(du -sh "$out" | cut -f1), espeak-ng $("$out/bin/espeak-ng" --version | awk '{print $4}')"
