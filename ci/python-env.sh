# The Python environment of the tests checked against PyTorch: a virtual
# environment at ${CHORUS_VENV:-$HOME/.cache/chorus/venv} with the pinned
# numpy, torch (PyPI's default wheel: about 5 GB with its CUDA libraries, a
# few minutes to install), transformers and safetensors. Exports
# CHORUS_PYTHON=<venv>/bin/python, which those tests run.
#
#   source ci/python-env.sh     # as ci/test.sh does
#   bash ci/python-env.sh       # alone: prints the python's path
#
# Idempotent: a complete environment (its stamp lists the pinned versions and
# they are installed) is reused in well under a second. An incomplete one is
# completed, never deleted. $CHORUS_VENV/READY marks a complete environment.
# Concurrent runs take turns on a lock (at most 30 minutes' wait). Fails, and
# fails the caller, when the environment cannot be made: the tests that need
# it would fail anyway, less clearly.

chorus_python_env() (
    set -euo pipefail
    local venv="${CHORUS_VENV:-$HOME/.cache/chorus/venv}"
    # The pins: what PyPI served on 2026-11-23. Change them here only.
    local pins=(numpy==2.4.6 torch==2.15.0 transformers==5.23.0 safetensors==0.8.0)
    local stamp="$venv/chorus-python-env.stamp"
    local want
    want="$(printf '%s\n' "${pins[@]}")"

    complete() {
        [ -f "$venv/READY" ] && [ -x "$venv/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] &&
            "$venv/bin/python" - "${pins[@]}" <<'PY'
import sys
from importlib.metadata import version, PackageNotFoundError
for pin in sys.argv[1:]:
    name, wanted = pin.split("==")
    try:
        if version(name) != wanted:
            sys.exit(1)
    except PackageNotFoundError:
        sys.exit(1)
PY
    }

    if complete; then
        printf '%s\n' "$venv/bin/python"
        return 0
    fi

    if [ -e "$venv" ] && [ ! -f "$venv/pyvenv.cfg" ] && [ -n "$(ls -A "$venv" 2>/dev/null)" ]; then
        echo "python-env: $venv exists and is not a virtual environment; set CHORUS_VENV to another path" >&2
        return 1
    fi
    mkdir -p "$(dirname "$venv")"
    # One installer at a time; the others wait for it, then find it complete.
    exec 9>"$venv.lock"
    if ! flock -w 1800 9; then
        echo "python-env: another install has held $venv.lock for 30 minutes; giving up" >&2
        return 1
    fi
    if complete; then
        printf '%s\n' "$venv/bin/python"
        return 0
    fi

    if ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
        if ! command -v apt-get >/dev/null 2>&1; then
            echo "python-env: python3 with the venv module is needed (python3-venv); install it" >&2
            return 1
        fi
        echo "python-env: installing python3-venv" >&2
        local sudo=""
        if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
        $sudo apt-get update >&2
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y python3 python3-venv >&2
    fi

    local started=$SECONDS
    rm -f "$venv/READY"
    echo "python-env: making $venv (${pins[*]}; torch brings about 5 GB of CUDA libraries)" >&2
    python3 -m venv "$venv" >&2
    timeout 1800 "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-input \
        "${pins[@]}" >&2
    printf '%s\n' "$want" >"$stamp"
    "$venv/bin/python" -c 'import numpy, torch, transformers, safetensors' >&2
    touch "$venv/READY"
    echo "python-env: $venv ready in $((SECONDS - started)) s" >&2
    printf '%s\n' "$venv/bin/python"
)

if _chorus_python="$(chorus_python_env)"; then
    export CHORUS_PYTHON="$_chorus_python"
    echo "python-env: CHORUS_PYTHON=$CHORUS_PYTHON" >&2
    unset _chorus_python
    unset -f chorus_python_env
else
    unset _chorus_python
    unset -f chorus_python_env
    echo "python-env: could not make the Python environment" >&2
    # Sourced: fail the caller's step; run alone: exit.
    return 1 2>/dev/null || exit 1
fi
if [ "${BASH_SOURCE[0]}" = "$0" ]; then printf '%s\n' "$CHORUS_PYTHON"; fi
