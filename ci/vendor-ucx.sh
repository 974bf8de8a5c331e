# Sourced by ci/test.sh: what the ucx backend's build needs. ucx-rs builds the
# UCX 1.22.0 release tarball it bundles (configure + make of ucm/ucs/uct/ucp,
# about 1.6 minutes on 2 cores, once per cargo profile): a C compiler and make,
# nothing else (no autotools, no RDMA headers: the crate's RDMA features are off).
ucx_missing=()
command -v make >/dev/null 2>&1 || ucx_missing+=(make)
command -v cc >/dev/null 2>&1 || ucx_missing+=(gcc)
if [ "${#ucx_missing[@]}" -gt 0 ]; then
    echo "ucx: installing ${ucx_missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${ucx_missing[@]}"
fi
unset ucx_missing
