# What every cached tool environment of ci/ does alike (the PyTorch venv of
# ci/python-env.sh, the nvcc of ci/candle-cuda.sh): a lock that concurrent
# runs take turns on, a pinned virtual environment made and stamped, and
# the end of a sourced script: export what it made, or fail its caller.
# Sourced by those scripts, which unset these functions when done. Each
# returns 1 on failure: call them with `|| return 1` (a function run inside
# `$(...)` in a condition, as these scripts' are, runs without `set -e`).

# chorus_venv_lock TAG DIR: holds DIR.lock on descriptor 9 for the rest of
# the calling (sub)shell, waiting at most 30 minutes for another holder.
chorus_venv_lock() {
    local tag=$1 dir=$2
    mkdir -p "$(dirname "$dir")"
    exec 9>"$dir.lock"
    if ! flock -w 1800 9; then
        echo "$tag: another install has held $dir.lock for 30 minutes; giving up" >&2
        return 1
    fi
}

# chorus_venv_make TAG DIR VAR STAMP PIN...: makes DIR a virtual environment
# with the PINs (pip, at most 30 minutes) and writes them, one a line, to
# STAMP. DIR must be absent, empty or a virtual environment (an incomplete
# one is completed, never deleted); VAR is the variable that chooses DIR,
# named when DIR is something else.
chorus_venv_make() {
    local tag=$1 dir=$2 var=$3 stamp=$4
    shift 4
    if [ -e "$dir" ] && [ ! -f "$dir/pyvenv.cfg" ] && [ -n "$(ls -A "$dir" 2>/dev/null)" ]; then
        echo "$tag: $dir exists and is not a virtual environment; set $var to another path" >&2
        return 1
    fi
    rm -f "$dir/READY"
    python3 -m venv "$dir" >&2 || return 1
    timeout 1800 "$dir/bin/python" -m pip install --quiet --disable-pip-version-check --no-input "$@" >&2 ||
        return 1
    printf '%s\n' "$@" >"$stamp"
}

# chorus_venv_export TAG VAR WHAT FUNCTION: exports VAR as what FUNCTION
# prints (and prints it too when the script was run, not sourced); or says
# that WHAT could not be made and returns 1 (the sourced script then fails
# its caller). Either way it unsets FUNCTION and these helpers: the last
# call of the sourced script.
chorus_venv_export() {
    local tag=$1 var=$2 what=$3 fn=$4 value status=0
    if value="$("$fn")"; then
        export "$var=$value"
        echo "$tag: $var=$value" >&2
        if [ "${BASH_SOURCE[1]}" = "$0" ]; then printf '%s\n' "$value"; fi
    else
        echo "$tag: could not make $what" >&2
        status=1
    fi
    unset -f "$fn" chorus_venv_lock chorus_venv_make chorus_venv_export
    return $status
}
