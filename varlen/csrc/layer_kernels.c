/* Per-layer CPU kernels for the decoder's elementwise work, one pass over each row:
 *   varlen_rmsnorm:      out = w * (x / sqrt(mean(x^2) + eps))
 *   varlen_add_rmsnorm:  sum = a + b; out = rmsnorm(sum)   (the residual add feeding the norm)
 *   varlen_silu_mul:     out = silu(gate) * up             (the MLP's activation feeding down_proj)
 * fp32, rows with their own strides (the last dimension contiguous). Each row is computed by one
 * thread in a fixed order from its own inputs only, so a row's result does not depend on the rest
 * of the batch (batch invariance, as in backends/csrc/paged_attention.c). Rows are split over
 * threads only when there is enough work to pay for waking them.
 *
 * Built at first use by varlen/layer_kernels.py (plain C with OpenMP, loaded with ctypes).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec_exp.h"  /* vf, vi (VF_LANES fp32 lanes), vexp_neg */

/* Below this many elements a call stays on the calling thread. */
#define PAR_MIN 65536

static inline vf vload(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* Sum of squares in a fixed order: VF_LANES partial sums, then the lanes in order, then the tail. */
static inline float sum_sq(const float *x, int64_t d) {
    vf acc = {0};
    int64_t j = 0;
    for (; j + VF_LANES <= d; j += VF_LANES) {
        vf v = vload(x + j);
        acc += v * v;
    }
    float s = 0.0f;
    for (int l = 0; l < VF_LANES; l++) s += acc[l];
    for (; j < d; j++) s += x[j] * x[j];
    return s;
}

static inline void scale_row(const float *x, const float *w, float r, float *out, int64_t d) {
    int64_t j = 0;
    for (; j + VF_LANES <= d; j += VF_LANES) vstore(out + j, vload(w + j) * (vload(x + j) * r));
    for (; j < d; j++) out[j] = w[j] * (x[j] * r);
}

int varlen_rmsnorm(const float *x, int64_t x_stride, const float *w, float *out, int64_t out_stride,
                   int64_t rows, int64_t d, float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * d >= PAR_MIN && threads > 1)
    for (int64_t i = 0; i < rows; i++) {
        const float *xi = x + i * x_stride;
        float r = 1.0f / sqrtf(sum_sq(xi, d) / (float)d + eps);
        scale_row(xi, w, r, out + i * out_stride, d);
    }
    return 0;
}

int varlen_add_rmsnorm(const float *a, int64_t a_stride, const float *b, int64_t b_stride, const float *w,
                       float *sum, int64_t sum_stride, float *out, int64_t out_stride, int64_t rows, int64_t d,
                       float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * d >= PAR_MIN && threads > 1)
    for (int64_t i = 0; i < rows; i++) {
        const float *ai = a + i * a_stride, *bi = b + i * b_stride;
        float *si = sum + i * sum_stride;
        int64_t j = 0;
        for (; j + VF_LANES <= d; j += VF_LANES) vstore(si + j, vload(ai + j) + vload(bi + j));
        for (; j < d; j++) si[j] = ai[j] + bi[j];
        float r = 1.0f / sqrtf(sum_sq(si, d) / (float)d + eps);
        scale_row(si, w, r, out + i * out_stride, d);
    }
    return 0;
}

/* silu(g) = g * sigmoid(g); sigmoid from e = exp(-|g|) <= 1, so nothing overflows. */
static inline vf vsilu(vf g) {
    const vi neg = g < 0.0f;
    const vf absg = (vf)((vi)g & 0x7fffffff);
    const vf e = vexp_neg(-absg);
    const vf inv = 1.0f / (1.0f + e);
    const vf sig = (vf)(((vi)(e * inv) & neg) | ((vi)inv & ~neg));
    return g * sig;
}

int varlen_silu_mul(const float *gate, int64_t g_stride, const float *up, int64_t u_stride, float *out,
                    int64_t out_stride, int64_t rows, int64_t d, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * d >= PAR_MIN && threads > 1)
    for (int64_t i = 0; i < rows; i++) {
        const float *gi = gate + i * g_stride, *ui = up + i * u_stride;
        float *oi = out + i * out_stride;
        int64_t j = 0;
        for (; j + VF_LANES <= d; j += VF_LANES) vstore(oi + j, vsilu(vload(gi + j)) * vload(ui + j));
        for (; j < d; j++) {
            float g = gi[j];
            oi[j] = g / (1.0f + expf(-g)) * ui[j];
        }
    }
    return 0;
}
