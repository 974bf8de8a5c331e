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

# shellcheck source=ci/venv.sh
source "$(dirname "${BASH_SOURCE[0]}")/venv.sh"

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

    # One installer at a time; the others wait for it, then find it complete.
    chorus_venv_lock python-env "$venv" || return 1
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
    echo "python-env: making $venv (${pins[*]}; torch brings about 5 GB of CUDA libraries)" >&2
    chorus_venv_make python-env "$venv" CHORUS_VENV "$stamp" "${pins[@]}" || return 1
    "$venv/bin/python" -c 'import numpy, torch, transformers, safetensors' >&2
    touch "$venv/READY"
    echo "python-env: $venv ready in $((SECONDS - started)) s" >&2
    printf '%s\n' "$venv/bin/python"
)

# Sourced: fail the caller's step; run alone: print the value, or exit 1.
chorus_venv_export python-env CHORUS_PYTHON "the Python environment" chorus_python_env || return 1 2>/dev/null || exit 1
