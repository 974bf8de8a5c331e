# Sourced by ci/test.sh: installs the AMD libraries that load without a GPU
# and exports the variable that points chorus at them. Idempotent: when the
# package is installed this is one dpkg call. Never fails the caller: when
# the package cannot be installed, the HIP loading test fails with a message
# naming this script.
#
#   Debian's libamdhip64-5 -> CHORUS_HIP_LIB (HIP loads, reports no device; hipRTC
#                             compiles every kernel for real AMD architectures)
#
# RCCL is packaged nowhere we can install from; its test checks the
# missing-library error instead.

if command -v dpkg >/dev/null 2>&1; then
    if ! dpkg -s libamdhip64-5 >/dev/null 2>&1; then
        echo "vendor-hip: installing libamdhip64-5" >&2
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libamdhip64-5) >&2 \
            || echo "vendor-hip: could not install libamdhip64-5; the HIP loading test will fail" >&2
    fi
    _chorus_hip="$(dpkg -L libamdhip64-5 2>/dev/null | grep -E '/libamdhip64\.so\.5$' | head -n 1 || true)"
    if [ -n "$_chorus_hip" ] && [ -e "$_chorus_hip" ]; then
        export CHORUS_HIP_LIB="$_chorus_hip"
        echo "vendor-hip: CHORUS_HIP_LIB=$CHORUS_HIP_LIB" >&2
    fi
    unset _chorus_hip
else
    echo "vendor-hip: no dpkg; install ROCm's libamdhip64 and set CHORUS_HIP_LIB" >&2
fi
