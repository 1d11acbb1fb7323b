# Source on the device machine from the staged repo (after .whl/device_env.sh): unpacks the kit's
# redis-server and espeak-ng into /tmp/kit (tools/device/stage_kit.sh made the kit).
if [ ! -x /tmp/kit/bin/redis-server ]; then
  mkdir -p /tmp/kit
  tar -C /tmp/kit -xJf .kit/redis.tar.xz
  cat > /tmp/kit/bin/redis <<'WRAP'
#!/bin/sh
# The host's libraries first; the kit's fill in what the image lacks.
LD_LIBRARY_PATH=/lib/x86_64-linux-gnu:/usr/lib/x86_64-linux-gnu:/tmp/kit/lib exec /tmp/kit/bin/redis-server "$@"
WRAP
  chmod +x /tmp/kit/bin/redis
fi
if [ ! -x /tmp/kit/esp/bin/espeak-ng ] && [ -f .kit/espeak.tar.xz ]; then
  tar -C /tmp/kit -xJf .kit/espeak.tar.xz
fi
[ -x /tmp/kit/esp/bin/espeak-ng ] && export PATH=/tmp/kit/esp/bin:$PATH
export KIT_REDIS=/tmp/kit/bin/redis
export KIT_AUDIO=$PWD/.kit/audio
"$KIT_REDIS" --version
