/* Paged varlen attention on CPU, reading K/V blocks where they lie in the cache (no gather).
 *
 * One call covers a whole step: prefills, chunks of prefills and decodes, causal with the
 * bottom-right alignment (new token r of a request with L keys sits at position L - q_len + r),
 * GQA (query head qh reads KV head qh / group). The cache is [num_blocks, block_size, Hkv, D] for
 * K and for V; request i's key j lives in block block_tables[i, j / block_size], row j % block_size.
 *
 * Work is split in units of (request, KV head, tile of up to TILE query rows); a unit computes all
 * `group` query heads of its KV head together, so each K/V row is loaded once per unit. Softmax is
 * the online kind, one update per block. Every query row is computed by one thread, in a fixed order
 * (block by block, keys in order), from its own inputs only: its result depends neither on the
 * rest of the batch, nor on how units are tiled or scheduled (batch invariance for free).
 *
 * Built at first use by backends/torch_paged.py (plain C with OpenMP, loaded with ctypes).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 16

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

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);  /* NaN stays NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

typedef struct {
    int64_t q_tok, q_head;            /* q strides, in elements */
    int num_seqs, hq, hkv, d, bs;
    int64_t bt_stride;                /* block_tables row stride */
    float scale;
} Dims;

/* One unit. `kb`/`vb` point at the cache's KV head h of block 0 (element offset h * D). Elements
 * are float (elem == 4) or bf16 (elem == 2); the math is fp32 either way. */
static void unit(const void *q, const void *kc, const void *vc, void *out, int elem,
                 const int32_t *qsl, const int32_t *seq_lens, const int32_t *bt,
                 const Dims *dm, int seq, int h, int t0, int t1, float *scratch) {
    const int D = dm->d, G = dm->hq / dm->hkv, bs = dm->bs, hkv = dm->hkv;
    const int qs = qsl[seq], qlen = qsl[seq + 1] - qs, L = seq_lens[seq], off = L - qlen;
    const int M = (t1 - t0) * G;
    float *qb = scratch, *acc = qb + (size_t)M * D, *mx = acc + (size_t)M * D, *sum = mx + M,
          *s = sum + M, *kv = s + bs;  /* kv: one block's K then V rows of head h, as fp32 (bf16 only) */
    for (int r = 0; r < t1 - t0; r++)
        for (int g = 0; g < G; g++) {
            const int64_t at = (int64_t)(qs + t0 + r) * dm->q_tok + (int64_t)(h * G + g) * dm->q_head;
            float *dst = qb + (size_t)(r * G + g) * D;
            for (int x = 0; x < D; x++)
                dst[x] = (elem == 4 ? ((const float *)q)[at + x] : bf16_to_f32(((const uint16_t *)q)[at + x]))
                         * dm->scale;
        }
    for (int m = 0; m < M; m++) { mx[m] = -3.0e38f; sum[m] = 0.0f; }
    memset(acc, 0, sizeof(float) * (size_t)M * D);
    const int last = off + t1;                 /* keys visible to the tile's last row */
    const int nblk = (last + bs - 1) / bs;
    const int64_t row_stride = (int64_t)hkv * D, blk_stride = (int64_t)bs * hkv * D;
    for (int b = 0; b < nblk; b++) {
        const int j0 = b * bs, jn = last - j0 < bs ? last - j0 : bs;
        const int64_t base = (int64_t)bt[(int64_t)seq * dm->bt_stride + b] * blk_stride + (int64_t)h * D;
        const float *K, *V;
        int64_t ks;
        if (elem == 4) {
            K = (const float *)kc + base; V = (const float *)vc + base; ks = row_stride;
        } else {  /* widen this block's rows once, for all M rows of the unit */
            for (int j = 0; j < jn; j++)
                for (int x = 0; x < D; x++) {
                    kv[j * D + x] = bf16_to_f32(((const uint16_t *)kc)[base + j * row_stride + x]);
                    kv[(bs + j) * D + x] = bf16_to_f32(((const uint16_t *)vc)[base + j * row_stride + x]);
                }
            K = kv; V = kv + (size_t)bs * D; ks = D;
        }
        for (int m = 0; m < M; m++) {
            const int pos = off + t0 + m / G;  /* this row's position: it sees keys 0..pos */
            const int lim = pos + 1 - j0 < jn ? pos + 1 - j0 : jn;
            if (lim <= 0) continue;
            const float *qm = qb + (size_t)m * D;
            float bmax = -3.0e38f;
            for (int j = 0; j < lim; j++) {
                const float *kj = K + j * ks;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int x = 0; x < D; x++) dot += qm[x] * kj[x];
                s[j] = dot;
                bmax = dot > bmax ? dot : bmax;
            }
            const float newm = bmax > mx[m] ? bmax : mx[m];
            float *am = acc + (size_t)m * D;
            if (newm > mx[m]) {
                const float corr = exp_neg(mx[m] - newm);
                sum[m] *= corr;
#pragma omp simd
                for (int x = 0; x < D; x++) am[x] *= corr;
                mx[m] = newm;
            }
            float bsum = 0.0f;
#pragma omp simd reduction(+ : bsum)
            for (int j = 0; j < lim; j++) {
                s[j] = exp_neg(s[j] - newm);
                bsum += s[j];
            }
            sum[m] += bsum;
            for (int j = 0; j < lim; j++) {
                const float *vj = V + j * ks;
                const float p = s[j];
#pragma omp simd
                for (int x = 0; x < D; x++) am[x] += p * vj[x];
            }
        }
    }
    for (int r = 0; r < t1 - t0; r++)
        for (int g = 0; g < G; g++) {
            const int m = r * G + g;
            const float inv = 1.0f / sum[m];
            const int64_t at = ((int64_t)(qs + t0 + r) * dm->hq + h * G + g) * D;
            for (int x = 0; x < D; x++) {
                const float o = acc[(size_t)m * D + x] * inv;
                if (elem == 4) ((float *)out)[at + x] = o;
                else ((uint16_t *)out)[at + x] = f32_to_bf16(o);
            }
        }
}

/* units: [num_units, 3] int32 (request, first query row, end query row), heaviest first; each
 * is run for every KV head. out: [N, Hq, D] contiguous. Returns 0, or -1 if scratch ran out. */
int varlen_paged_attention(const void *q, int64_t q_tok, int64_t q_head, const void *k_cache,
                           const void *v_cache, void *out, int elem, const int32_t *qsl,
                           const int32_t *seq_lens, int num_seqs, const int32_t *block_tables,
                           int64_t bt_stride, const int32_t *units, int num_units, int hq, int hkv, int d,
                           int bs, float scale, int threads) {
    Dims dm = {q_tok, q_head, num_seqs, hq, hkv, d, bs, bt_stride, scale};
    const int G = hq / hkv;
    const size_t M = (size_t)TILE * G;
    const size_t need = (M * d * 2 + M * 2 + bs + (size_t)2 * bs * d) * sizeof(float);
    const int total = num_units * hkv;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && total > 1)
    {
        float *scratch = (float *)malloc(need);
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int w = 0; w < total; w++) {
            if (!scratch) continue;
            const int32_t *u = units + (size_t)(w / hkv) * 3;
            unit(q, k_cache, v_cache, out, elem, qsl, seq_lens, block_tables, &dm, u[0], w % hkv, u[1], u[2],
                 scratch);
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}

int varlen_paged_attention_tile(void) { return TILE; }
