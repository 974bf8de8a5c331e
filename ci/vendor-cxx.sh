# Sourced by ci/test.sh: a host C++ compiler for the host test of the shared
# GPU kernel source (devices/tests/gpu_kernels_host/ compiles it with `c++`
# and runs every kernel on the CPU). Idempotent: when one is installed this
# is one `command -v`. Never fails the caller: without a compiler that test
# prints why it skipped.

if ! command -v c++ >/dev/null 2>&1 && ! command -v g++ >/dev/null 2>&1 && ! command -v clang++ >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1; then
        echo "vendor-cxx: installing g++" >&2
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++) >&2 \
            || echo "vendor-cxx: could not install g++; the host kernel test will skip" >&2
    else
        echo "vendor-cxx: no C++ compiler and no apt-get; the host kernel test will skip" >&2
    fi
fi
