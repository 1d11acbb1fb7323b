#!/usr/bin/env bash
# Create or complete the project's virtualenv with the given pyproject extras:
#   tools/setup_venv.sh VENV PYTHON EXTRAS        (e.g. .venv python3 cpu,fast)
# - A virtualenv that an interrupted run left unusable (no interpreter, no pip, another Python
#   version than PYTHON) is removed and made again, so a second `make` never fails differently.
# - With the `reference` extra on Linux x86_64, torch is first asked of PyTorch's CPU-only index (a
#   ~190 MB wheel); where that index cannot be reached, pip takes torch from PyPI as usual, whose
#   Linux x86_64 wheel is the CUDA build (~3 GB of downloads). docs/fresh-machine.md has the sizes.
# Installing is incremental: extras already installed are not downloaded again.
set -euo pipefail
venv=$1
python=$2
extras=$3
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}

py_version() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null; }

want=$(py_version "$python") || {
  echo "setup_venv: '$python' does not run; install Python >= 3.11 (Debian: apt-get install python3)" >&2
  exit 1
}
if [ -e "$venv" ]; then
  problem=""
  if [ ! -x "$venv/bin/python" ] || ! have=$(py_version "$venv/bin/python"); then
    problem="its interpreter does not run"
  elif [ "$have" != "$want" ]; then
    problem="it has Python $have, $python is $want"
  elif ! "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
    problem="it has no pip (an interrupted set-up?)"
  fi
  if [ -n "$problem" ]; then
    echo "setup_venv: $venv is unusable ($problem): making it again"
    rm -rf "$venv"
  fi
fi
if [ ! -e "$venv" ]; then
  if ! "$python" -m venv "$venv"; then
    rm -rf "$venv"  # never leave a half-made one behind
    echo "setup_venv: '$python -m venv' failed; on Debian/Ubuntu it needs the python3-venv package" \
      "(tools/install_system_deps.sh installs it)" >&2
    exit 1
  fi
  "$venv/bin/python" -m pip install -q --upgrade pip
fi

# torch from the CPU index before pip resolves the extras: a torch that is already there satisfies
# the pin (2.13.0+cpu is a 2.13.0), so the next step does not fetch the CUDA build.
if [[ ",$extras," == *",reference,"* ]] && [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ] &&
  ! "$venv/bin/python" -c 'import importlib.metadata as m; m.version("torch")' >/dev/null 2>&1; then
  torch_req=$("$venv/bin/python" - <<'EOF'
import tomllib

with open("pyproject.toml", "rb") as f:
    reqs = tomllib.load(f)["project"]["optional-dependencies"]["reference"]
print(next(r for r in reqs if r.replace(" ", "").startswith("torch")))
EOF
  )
  echo "setup_venv: asking $TORCH_CPU_INDEX for the CPU build of $torch_req"
  if "$venv/bin/python" -m pip install -q --retries 2 --timeout 20 --index-url "$TORCH_CPU_INDEX" \
    "$torch_req"; then
    echo "setup_venv: installed $("$venv/bin/python" -c 'import importlib.metadata as m; print("torch", m.version("torch"))')"
  else
    echo "setup_venv: the CPU index did not serve $torch_req; pip takes torch from PyPI (the CUDA build)"
  fi
fi
echo "setup_venv: installing the project with extras [$extras] into $venv"
"$venv/bin/python" -m pip install -q -e ".[$extras]"
