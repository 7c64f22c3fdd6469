// ATen's Vectorized<float> mapped to the registers -march=native gives. Include this before any ATen header:
// it defines CPU_CAPABILITY_* from the compiler's own target macros, so Vectorized<float> is AVX2 or AVX-512,
// and gives the inline namespace a name of our own, so these instantiations can never be confused with
// libtorch's copies of the same headers. Every source that uses Vectorized includes it, so they all agree.
// HYDRAGEN_VEC_CAPABILITY names the choice as torch.backends.cpu.get_cpu_capability() does. Where libtorch
// runs the same capability (its default on the same CPU), quant_matmul.cpp's SwiGLU is at::silu's own vector
// formula bit for bit; where it runs another (ATEN_CPU_CAPABILITY, HYDRAGEN_CPP_FLAGS), the vector and scalar
// parts split elsewhere and an element may round differently.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define CPU_CAPABILITY_AVX512
#define HYDRAGEN_VEC_CAPABILITY "AVX512"
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX2
#define HYDRAGEN_VEC_CAPABILITY "AVX2"
#else
#define HYDRAGEN_VEC_CAPABILITY "DEFAULT"
#endif
#define CPU_CAPABILITY hydragen_step_attention
