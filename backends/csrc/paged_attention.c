/* Paged varlen attention on CPU, reading K/V blocks where they lie in the cache (no gather).
 *
 * One call covers a whole step: prefills, chunks of prefills and decodes, causal with the
 * bottom-right alignment (new token r of a request with L keys sits at position L - q_len + r),
 * GQA (query head qh reads KV head qh / group). Request i's key j lives in block
 * block_tables[i, j / block_size], at offset j % block_size. The cache is this backend's own layout:
 * per block and KV head, K as [D, block_size] (keys side by side, so the scores of a chunk of keys
 * are one vector of FMAs, no horizontal sums) and V as [block_size, D] (rows added into the output).
 *
 * Work is split in units of (request, tile of up to TILE query rows); a unit computes every head
 * of its rows, walking the request's blocks once, each block prefetched while the one before is
 * used. Softmax is the online kind, one update per chunk of CHUNK keys (a chunk never straddles a
 * block). Every query row is computed by one thread, in a fixed order (block by block, keys in
 * order), from its own inputs only: its result depends neither on the rest of the batch, nor on
 * how units are tiled or scheduled (batch invariance for free).
 *
 * Optional per-layer features, as transformers defines them: a sliding window W (position p sees
 * keys p-W+1..p; blocks wholly before a unit's first window are never read, they may be freed),
 * logit soft-capping (score -> cap * tanh(score / cap)) and sinks (one logit per query head that
 * joins the softmax's denominator only).
 *
 * Built at first use by backends/torch_paged.py (plain C with OpenMP, loaded with ctypes).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 16
#define CHUNK 16
/* Prefetch distance (blocks ahead) and locality hint (1: into L2); measured best of the simple
 * options on a 2-core EPYC (decode at 64 x 1k context: ~10% over no prefetch). */
#ifndef PF_DIST
#define PF_DIST 1
#endif
#ifndef PF_HINT
#define PF_HINT 1
#endif

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

/* The same for a whole chunk of keys, with GCC/Clang vector extensions (whatever SIMD the CPU
 * has: one AVX-512 register, two AVX2 ones, ...). Round-to-nearest by the 1.5 * 2^23 trick. */
typedef float vf __attribute__((vector_size(CHUNK * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(CHUNK * sizeof(float))));

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
    int window;                       /* sliding window, or 0: the whole context */
    float softcap;                    /* logit soft-cap, or 0: none */
    const float *sinks;               /* [hq] sink logits, or NULL */
} Dims;

/* One unit: query rows t0..t1-1 of request `seq`, every head. Blocks are the outer loop, so each
 * block's K and V (all KV heads: one contiguous run each) are read once, sequentially, and the next
 * block is prefetched while this one is used. Elements are float (elem == 4) or bf16 (elem == 2);
 * the math is fp32 either way. D is a compile-time constant for the usual head sizes (see below),
 * which lets the compiler unroll the dot products and reduce them in registers. */
static inline __attribute__((always_inline)) void unit_d(
        const void *q, const void *kc, const void *vc, void *out, int elem, const int32_t *qsl,
        const int32_t *seq_lens, const int32_t *bt, const Dims *dm, int seq, int t0, int t1, float *scratch,
        const int D) {
    const int hq = dm->hq, G = dm->hq / dm->hkv, bs = dm->bs, hkv = dm->hkv;
    const int qs = qsl[seq], qlen = qsl[seq + 1] - qs, L = seq_lens[seq], off = L - qlen;
    const int R = t1 - t0, M = R * hq;        /* row m = (query row r, query head qh): m = r * hq + qh */
    const int64_t blk_elems = (int64_t)bs * hkv * D, head_elems = (int64_t)bs * D;
    float *qb = scratch, *acc = qb + (size_t)M * D, *mx = acc + (size_t)M * D, *sum = mx + M,
          *s = sum + M, *kv = s + bs;  /* kv: one block's K then V as fp32 (bf16 only) */
    for (int r = 0; r < R; r++)
        for (int qh = 0; qh < hq; qh++) {
            const int64_t at = (int64_t)(qs + t0 + r) * dm->q_tok + (int64_t)qh * dm->q_head;
            float *dst = qb + (size_t)(r * hq + qh) * D;
            for (int x = 0; x < D; x++)
                dst[x] = (elem == 4 ? ((const float *)q)[at + x] : bf16_to_f32(((const uint16_t *)q)[at + x]))
                         * dm->scale;
        }
    for (int m = 0; m < M; m++) { mx[m] = -3.0e38f; sum[m] = 0.0f; }
    memset(acc, 0, sizeof(float) * (size_t)M * D);
    const int last = off + t1;                 /* keys visible to the unit's last row */
    const int nblk = (last + bs - 1) / bs;
    const int W = dm->window;
    const float cap = dm->softcap;
    /* the block holding the first key the unit's first row sees (with a window, earlier ones are never read) */
    const int first_key = W > 0 && off + t0 - W + 1 > 0 ? off + t0 - W + 1 : 0;
    const int32_t *table = bt + (int64_t)seq * dm->bt_stride;
    for (int b = first_key / bs; b < nblk; b++) {
        const int j0 = b * bs, jn = last - j0 < bs ? last - j0 : bs;
        const int64_t base = (int64_t)table[b] * blk_elems;
        if (b + PF_DIST < nblk) {  /* a later block lies anywhere in the pool: fetch it ahead, into L2 */
            const char *nk = (const char *)kc + (int64_t)table[b + PF_DIST] * blk_elems * elem;
            const char *nv = (const char *)vc + (int64_t)table[b + PF_DIST] * blk_elems * elem;
            for (int64_t c = 0; c < blk_elems * elem; c += 64) {
                __builtin_prefetch(nk + c, 0, PF_HINT);
                __builtin_prefetch(nv + c, 0, PF_HINT);
            }
        }
        const float *Kb, *Vb;
        if (elem == 4) {
            Kb = (const float *)kc + base; Vb = (const float *)vc + base;
        } else {  /* widen this block once, for every row of the unit */
            for (int64_t x = 0; x < blk_elems; x++) {
                kv[x] = bf16_to_f32(((const uint16_t *)kc)[base + x]);
                kv[blk_elems + x] = bf16_to_f32(((const uint16_t *)vc)[base + x]);
            }
            Kb = kv; Vb = kv + blk_elems;
        }
        for (int r = 0; r < R; r++) {
            const int pos = off + t0 + r;  /* this row's position: it sees keys 0..pos */
            const int lim = pos + 1 - j0 < jn ? pos + 1 - j0 : jn;
            const int lo = W > 0 && pos - W + 1 - j0 > 0 ? pos - W + 1 - j0 : 0;  /* first key of the window */
            if (lim <= lo) continue;
            for (int qh = 0; qh < hq; qh++) {
                const int m = r * hq + qh;
                const float *restrict Kt = Kb + (qh / G) * head_elems, *restrict V = Vb + (qh / G) * head_elems;
                const float *restrict qm = qb + (size_t)m * D;
                float *restrict am = acc + (size_t)m * D;
                /* Keys in chunks of CHUNK: fixed-size loops the compiler turns into whole vectors
                 * (the scores, their max and exps); a partial chunk's missing keys weigh exactly 0.
                 * Each score sums its D products in order, whatever the chunk: the same number
                 * for the same key and row, always. */
                for (int c = lo - lo % CHUNK; c < lim; c += CHUNK) {
                    const int n = lim - c < CHUNK ? lim - c : CHUNK;
                    const int j0k = lo > c ? lo - c : 0;  /* keys j0k..n-1 of the chunk are visible */
                    /* Four partial sums over x (x % 4), then (s0 + s1) + (s2 + s3): four
                     * independent FMA chains instead of one latency-bound chain. */
                    vf sv;
                    if (n == CHUNK) {
                        vf s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0}, k0, k1, k2, k3;
                        int x = 0;
                        for (; x + 3 < D; x += 4) {
                            const float *kr = Kt + (int64_t)x * bs + c;
                            memcpy(&k0, kr, sizeof k0);
                            memcpy(&k1, kr + bs, sizeof k1);
                            memcpy(&k2, kr + 2 * bs, sizeof k2);
                            memcpy(&k3, kr + 3 * bs, sizeof k3);
                            s0 += qm[x] * k0;
                            s1 += qm[x + 1] * k1;
                            s2 += qm[x + 2] * k2;
                            s3 += qm[x + 3] * k3;
                        }
                        for (; x < D; x++) {
                            memcpy(&k0, Kt + (int64_t)x * bs + c, sizeof k0);
                            s0 += qm[x] * k0;
                        }
                        sv = (s0 + s1) + (s2 + s3);
                    } else {  /* the same sums, key by key */
                        float part[4][CHUNK] = {{0}}, sc[CHUNK];
                        for (int x = 0; x < D; x++) {
                            const float qx = qm[x];
                            const float *restrict kr = Kt + (int64_t)x * bs + c;
                            float *restrict pp = part[x < (D & ~3) ? x % 4 : 0];  /* as the vector path */
                            for (int j = 0; j < n; j++) pp[j] += qx * kr[j];
                        }
                        for (int j = 0; j < CHUNK; j++)
                            sc[j] = j < n ? (part[0][j] + part[1][j]) + (part[2][j] + part[3][j]) : -3.0e38f;
                        memcpy(&sv, sc, sizeof sv);
                    }
                    float sc[CHUNK], cmax = -3.0e38f;
                    memcpy(sc, &sv, sizeof sc);
                    if (cap > 0.0f || j0k > 0) {  /* soft-cap the visible scores; keys outside weigh 0 */
                        for (int j = 0; j < CHUNK; j++)
                            sc[j] = j < j0k || j >= n ? -3.0e38f : cap > 0.0f ? cap * tanhf(sc[j] / cap) : sc[j];
                        memcpy(&sv, sc, sizeof sv);
                    }
                    for (int j = 0; j < CHUNK; j++) cmax = sc[j] > cmax ? sc[j] : cmax;
                    if (cmax > mx[m]) {
                        const float corr = exp_neg(mx[m] - cmax);
                        sum[m] *= corr;
#pragma omp simd
                        for (int x = 0; x < D; x++) am[x] *= corr;
                        mx[m] = cmax;
                    }
                    sv = vexp_neg(sv - mx[m]);
                    memcpy(sc, &sv, sizeof sc);
                    float csum = 0.0f;
                    for (int j = j0k; j < n; j++) csum += sc[j];  /* in key order: the same sum always */
                    sum[m] += csum;
                    /* out += p_j * v_j, keys in order for every element; a CHUNK-wide slice of
                     * the output stays in a register over all the keys of the chunk. */
                    if (D % CHUNK == 0) {
                        for (int x0 = 0; x0 < D; x0 += CHUNK) {
                            vf a, vv;
                            memcpy(&a, am + x0, sizeof a);
                            for (int j = j0k; j < n; j++) {
                                memcpy(&vv, V + (int64_t)(c + j) * D + x0, sizeof vv);
                                a += sc[j] * vv;
                            }
                            memcpy(am + x0, &a, sizeof a);
                        }
                    } else {
                        for (int j = j0k; j < n; j++) {
                            const float *restrict vj = V + (int64_t)(c + j) * D;
                            const float p = sc[j];
#pragma omp simd
                            for (int x = 0; x < D; x++) am[x] += p * vj[x];
                        }
                    }
                }
            }
        }
    }
    for (int m = 0; m < M; m++) {
        float inv = 1.0f / sum[m];
        if (dm->sinks) {  /* the head's sink logit joins the denominator: rescale both to the larger max */
            const float sink = dm->sinks[m % hq], top = sink > mx[m] ? sink : mx[m];
            const float corr = exp_neg(mx[m] - top);
            inv = corr / (sum[m] * corr + exp_neg(sink - top));
        }
        const int64_t at = ((int64_t)(qs + t0) * hq + m) * D;  /* rows of a request are consecutive */
        for (int x = 0; x < D; x++) {
            const float o = acc[(size_t)m * D + x] * inv;
            if (elem == 4) ((float *)out)[at + x] = o;
            else ((uint16_t *)out)[at + x] = f32_to_bf16(o);
        }
    }
}

#define UNIT_ARGS const void *q, const void *kc, const void *vc, void *out, int elem, const int32_t *qsl, \
    const int32_t *seq_lens, const int32_t *bt, const Dims *dm, int seq, int t0, int t1, float *scratch
#define UNIT_CALL q, kc, vc, out, elem, qsl, seq_lens, bt, dm, seq, t0, t1, scratch
static void unit_64(UNIT_ARGS) { unit_d(UNIT_CALL, 64); }
static void unit_128(UNIT_ARGS) { unit_d(UNIT_CALL, 128); }
static void unit_any(UNIT_ARGS) { unit_d(UNIT_CALL, dm->d); }

/* units: [num_units, 3] int32 (request, first query row, end query row), heaviest first.
 * out: [N, Hq, D] contiguous. Returns 0, or -1 if scratch memory ran out. */
int varlen_paged_attention(const void *q, int64_t q_tok, int64_t q_head, const void *k_cache,
                           const void *v_cache, void *out, int elem, const int32_t *qsl,
                           const int32_t *seq_lens, int num_seqs, const int32_t *block_tables,
                           int64_t bt_stride, const int32_t *units, int num_units, int hq, int hkv, int d,
                           int bs, float scale, int threads, int window, float softcap, const float *sinks) {
    Dims dm = {q_tok, q_head, num_seqs, hq, hkv, d, bs, bt_stride, scale, window, softcap, sinks};
    const size_t M = (size_t)TILE * hq;
    const size_t need = (M * d * 2 + M * 2 + bs + (size_t)2 * bs * hkv * d) * sizeof(float);
    void (*run)(UNIT_ARGS) = d == 64 ? unit_64 : d == 128 ? unit_128 : unit_any;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && num_units > 1)
    {
        float *scratch = (float *)malloc(need);
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int w = 0; w < num_units; w++) {
            if (!scratch) continue;
            const int32_t *u = units + (size_t)w * 3;
            run(q, k_cache, v_cache, out, elem, qsl, seq_lens, block_tables, &dm, u[0], u[1], u[2], scratch);
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}

int varlen_paged_attention_tile(void) { return TILE; }
