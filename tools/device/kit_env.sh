# Source on the device machine from the staged repo (after .whl/device_env.sh): unpacks the kit's
# redis-server into /tmp/kit and puts it on PATH (tools/device/stage_kit.sh made the kit).
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
export KIT_REDIS=/tmp/kit/bin/redis
export KIT_AUDIO=$PWD/.kit/audio
"$KIT_REDIS" --version
