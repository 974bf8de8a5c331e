# Sourced by ci/test.sh: installs the NVIDIA libraries that load without a GPU
# and exports the variables that point chorus at them. Idempotent: when the
# wheels are installed this is one python call. Fails the caller (returns 1)
# when a library cannot be provided: the tests that need it run there with
# --include-ignored and must not pass without checking it.
#
#   nvidia-nccl-cu12       -> CHORUS_NCCL_LIB  (ncclGetVersion / ncclGetUniqueId tests)
#   nvidia-cuda-nvrtc-cu12 -> CHORUS_NVRTC_LIB (the cuda kernels compile under NVRTC)

chorus_vendor_lib() {
    # $1: python module path under nvidia/, $2: library file, $3: pip package
    local found
    found="$(python3 - "$1" "$2" 2>/dev/null <<'PY'
import importlib.util, os, sys
try:
    spec = importlib.util.find_spec("nvidia." + sys.argv[1])
except ImportError:
    spec = None
for root in (spec.submodule_search_locations or []) if spec else []:
    path = os.path.join(root, "lib", sys.argv[2])
    if os.path.exists(path):
        print(path)
        break
PY
)" || found=""
    if [ -z "$found" ] && command -v python3 >/dev/null 2>&1; then
        echo "vendor-libs: installing $3" >&2
        python3 -m pip install --quiet --disable-pip-version-check "$3" >&2 || echo "vendor-libs: could not install $3" >&2
        found="$(python3 -c "import nvidia.$1 as m, os; p = os.path.join(list(m.__path__)[0], 'lib', '$2'); print(p if os.path.exists(p) else '')" 2>/dev/null || true)"
    fi
    printf '%s' "$found"
}

chorus_vendor_export() {
    # $1: variable to export, $2: what it is, then chorus_vendor_lib's
    # arguments; $6: the tests that cannot run without it
    local found
    found="$(chorus_vendor_lib "$3" "$4" "$5")"
    if [ -n "$found" ]; then
        export "$1=$found"
        echo "vendor-libs: $1=$found" >&2
    else
        echo "vendor-libs: $2 ($5) could not be provided; $6 cannot run" >&2
        _chorus_vendor_ok=0
    fi
}

_chorus_vendor_ok=1
if command -v python3 >/dev/null 2>&1; then
    chorus_vendor_export CHORUS_NCCL_LIB NCCL nccl libnccl.so.2 nvidia-nccl-cu12 "the NCCL loading tests"
    chorus_vendor_export CHORUS_NVRTC_LIB NVRTC cuda_nvrtc libnvrtc.so.12 nvidia-cuda-nvrtc-cu12 "the NVRTC tests"
else
    echo "vendor-libs: no python3: NCCL and NVRTC cannot be installed, and their loading tests cannot run" >&2
    _chorus_vendor_ok=0
fi
unset -f chorus_vendor_lib chorus_vendor_export
if [ "$_chorus_vendor_ok" = 0 ]; then
    unset _chorus_vendor_ok
    return 1 2>/dev/null || exit 1
fi
unset _chorus_vendor_ok
