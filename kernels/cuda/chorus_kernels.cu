// The decoder's fused kernels, one compilation unit: build.rs compiles this
// file to PTX with nvcc (feature `cuda`), and the host tests compile the same
// text with the host's C++ compiler (kernels/tests/host_kernels.rs).
#include "common.cuh"
#include "rms_norm.cuh"
#include "rope.cuh"
#include "swiglu.cuh"
#include "cross_entropy.cuh"
#include "attention_forward.cuh"
#include "attention_backward.cuh"
