/* Shared by the project's C kernels (backends/csrc/paged_attention.c, varlen/csrc/layer_kernels.c):
 * a 16-lane fp32 vector type (GCC/Clang vector extensions: whatever SIMD the CPU has, one AVX-512
 * register, two AVX2 ones, ...) and exp(x) for x <= 0, scalar and vectorised. One copy, so that
 * both kernels round exp the same way; varlen/c_build.py puts this folder on the include path and
 * keys its cache on this file's content.
 */
#ifndef VARLEN_VEC_EXP_H
#define VARLEN_VEC_EXP_H

#include <stdint.h>
#include <string.h>

#define VF_LANES 16
typedef float vf __attribute__((vector_size(VF_LANES * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(VF_LANES * sizeof(float))));

/* exp(x) for x <= 0, ~1e-7 relative error; a polynomial so that loops over keys vectorise. */
static inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &bits, sizeof s);
    return p * s;
}

/* The same, lane by lane; round-to-nearest by the 1.5 * 2^23 trick. */
static inline vf vexp_neg(vf x) {
    const vi low = x < -87.0f;
    x = (vf)(((vi)x & ~low) | ((vi)(x - x - 87.0f) & low));
    const vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const vf r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    vf p = r * (1.0f / 5040.0f) + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    return p * (vf)bits;
}

#endif
