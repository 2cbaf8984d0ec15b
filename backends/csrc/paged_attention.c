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

#include "vec_exp.h"  /* vf, vi, exp_neg, vexp_neg (varlen/csrc/) */

#define TILE 16
#define CHUNK 16
_Static_assert(CHUNK == VF_LANES, "a chunk of keys is one vf (vec_exp.h)");
/* Prefetch distance (blocks ahead) and locality hint (1: into L2); measured best of the simple
 * options on a 2-core EPYC (decode at 64 x 1k context: ~10% over no prefetch). */
#ifndef PF_DIST
#define PF_DIST 1
#endif
#ifndef PF_HINT
#define PF_HINT 1
#endif
#ifndef PF_SPREAD
#define PF_SPREAD 1
#endif

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

/* One chunk of keys (c..c+n-1 of a block, keys before j0k outside the window) for NH query heads
 * that share one KV head: K (as [D, bs]) and V rows are loaded once for all NH heads. Rows h of
 * q/acc/mx/sum are the heads' (stride D). Each head's numbers are computed in the same order
 * whatever NH is: a score sums its D products as four partial sums (x % 4), (s0 + s1) + (s2 + s3);
 * an output element adds p_j * v_j key by key in order. */
static inline __attribute__((always_inline)) void heads_chunk(
        const float *restrict Kt, const float *restrict V, const float *restrict q, float *restrict acc,
        float *restrict mx, float *restrict sum, int bs, int c, int n, int j0k, float cap, const int D,
        const int NH) {
    float sc[NH][CHUNK];
    if (n == CHUNK) {  /* fixed-size loops the compiler turns into whole vectors */
        vf s[NH][4], k0, k1, k2, k3;
        for (int h = 0; h < NH; h++) s[h][0] = s[h][1] = s[h][2] = s[h][3] = (vf){0};
        int x = 0;
        for (; x + 3 < D; x += 4) {
            const float *kr = Kt + (int64_t)x * bs + c;
            memcpy(&k0, kr, sizeof k0);
            memcpy(&k1, kr + bs, sizeof k1);
            memcpy(&k2, kr + 2 * bs, sizeof k2);
            memcpy(&k3, kr + 3 * bs, sizeof k3);
            for (int h = 0; h < NH; h++) {
                const float *qh = q + (size_t)h * D + x;
                s[h][0] += qh[0] * k0;
                s[h][1] += qh[1] * k1;
                s[h][2] += qh[2] * k2;
                s[h][3] += qh[3] * k3;
            }
        }
        for (; x < D; x++) {
            memcpy(&k0, Kt + (int64_t)x * bs + c, sizeof k0);
            for (int h = 0; h < NH; h++) s[h][0] += q[(size_t)h * D + x] * k0;
        }
        for (int h = 0; h < NH; h++) {
            const vf sv = (s[h][0] + s[h][1]) + (s[h][2] + s[h][3]);
            memcpy(sc[h], &sv, sizeof sv);
        }
    } else {  /* the same sums, key by key; missing keys weigh exactly 0 */
        for (int h = 0; h < NH; h++) {
            float part[4][CHUNK] = {{0}};
            const float *qh = q + (size_t)h * D;
            for (int x = 0; x < D; x++) {
                const float qx = qh[x];
                const float *restrict kr = Kt + (int64_t)x * bs + c;
                float *restrict pp = part[x < (D & ~3) ? x % 4 : 0];  /* as the vector path */
                for (int j = 0; j < n; j++) pp[j] += qx * kr[j];
            }
            for (int j = 0; j < CHUNK; j++)
                sc[h][j] = j < n ? (part[0][j] + part[1][j]) + (part[2][j] + part[3][j]) : -3.0e38f;
        }
    }
    for (int h = 0; h < NH; h++) {
        float *restrict am = acc + (size_t)h * D;
        float cmax = -3.0e38f;
        if (cap > 0.0f || j0k > 0) /* soft-cap the visible scores; keys outside weigh 0 */
            for (int j = 0; j < CHUNK; j++)
                sc[h][j] = j < j0k || j >= n ? -3.0e38f : cap > 0.0f ? cap * tanhf(sc[h][j] / cap) : sc[h][j];
        for (int j = 0; j < CHUNK; j++) cmax = sc[h][j] > cmax ? sc[h][j] : cmax;
        if (cmax > mx[h]) {
            const float corr = exp_neg(mx[h] - cmax);
            sum[h] *= corr;
#pragma omp simd
            for (int x = 0; x < D; x++) am[x] *= corr;
            mx[h] = cmax;
        }
        vf sv;
        memcpy(&sv, sc[h], sizeof sv);
        sv = vexp_neg(sv - mx[h]);
        memcpy(sc[h], &sv, sizeof sv);
        float csum = 0.0f;
        for (int j = j0k; j < n; j++) csum += sc[h][j];  /* in key order: the same sum always */
        sum[h] += csum;
    }
    /* out += p_j * v_j: a 4-vector slice of every head's output stays in registers over the chunk's
     * keys (4 * NH independent FMA chains), each V row loaded once for the NH heads. */
    if (D % (4 * CHUNK) == 0) {
        float *restrict a0p = acc, *restrict a1p = acc + (NH > 1 ? D : 0);
        for (int x0 = 0; x0 < D; x0 += 4 * CHUNK) {
            vf a0, a1, a2, a3, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0}, v0, v1, v2, v3;
            memcpy(&a0, a0p + x0, sizeof a0);
            memcpy(&a1, a0p + x0 + CHUNK, sizeof a1);
            memcpy(&a2, a0p + x0 + 2 * CHUNK, sizeof a2);
            memcpy(&a3, a0p + x0 + 3 * CHUNK, sizeof a3);
            if (NH > 1) {
                memcpy(&b0, a1p + x0, sizeof b0);
                memcpy(&b1, a1p + x0 + CHUNK, sizeof b1);
                memcpy(&b2, a1p + x0 + 2 * CHUNK, sizeof b2);
                memcpy(&b3, a1p + x0 + 3 * CHUNK, sizeof b3);
            }
            for (int j = j0k; j < n; j++) {
                const float *vr = V + (int64_t)(c + j) * D + x0;
                memcpy(&v0, vr, sizeof v0);
                memcpy(&v1, vr + CHUNK, sizeof v1);
                memcpy(&v2, vr + 2 * CHUNK, sizeof v2);
                memcpy(&v3, vr + 3 * CHUNK, sizeof v3);
                const float p = sc[0][j];
                a0 += p * v0; a1 += p * v1; a2 += p * v2; a3 += p * v3;
                if (NH > 1) {
                    const float p1 = sc[NH > 1 ? 1 : 0][j];
                    b0 += p1 * v0; b1 += p1 * v1; b2 += p1 * v2; b3 += p1 * v3;
                }
            }
            memcpy(a0p + x0, &a0, sizeof a0);
            memcpy(a0p + x0 + CHUNK, &a1, sizeof a1);
            memcpy(a0p + x0 + 2 * CHUNK, &a2, sizeof a2);
            memcpy(a0p + x0 + 3 * CHUNK, &a3, sizeof a3);
            if (NH > 1) {
                memcpy(a1p + x0, &b0, sizeof b0);
                memcpy(a1p + x0 + CHUNK, &b1, sizeof b1);
                memcpy(a1p + x0 + 2 * CHUNK, &b2, sizeof b2);
                memcpy(a1p + x0 + 3 * CHUNK, &b3, sizeof b3);
            }
        }
    } else {
        for (int h = 0; h < NH; h++) {
            float *restrict am = acc + (size_t)h * D;
            for (int j = j0k; j < n; j++) {
                const float *restrict vj = V + (int64_t)(c + j) * D;
                const float p = sc[h][j];
#pragma omp simd
                for (int x = 0; x < D; x++) am[x] += p * vj[x];
            }
        }
    }
}

/* One unit: query rows t0..t1-1 of request `seq`, every head. Blocks are the outer loop, so each
 * block's K and V (all KV heads: one contiguous run each) are read once, sequentially, and the next
 * block is prefetched while this one is used. Elements are float (elem == 4) or bf16 (elem == 2);
 * the math is fp32 either way. D is a compile-time constant for the usual head sizes (see below),
 * which lets the compiler unroll the dot products and reduce them in registers. */
static inline __attribute__((always_inline)) void unit_d(
        const void *q, const void *kc, const void *vc, void *out, int elem, const int32_t *qsl,
        const int32_t *seq_lens, const int32_t *bt, const Dims *dm, int seq, int t0, int t1, float *scratch,
        const int D, const int NH) {
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
        /* a later block lies anywhere in the pool: fetch it ahead, into L2, a slice per head group */
        const char *nk = NULL, *nv = NULL;
        const int64_t pf_bytes = blk_elems * elem, pf_slice = (pf_bytes / (hq / NH) + 63) & ~(int64_t)63;
        if (b + PF_DIST < nblk) {
            nk = (const char *)kc + (int64_t)table[b + PF_DIST] * pf_bytes;
            nv = (const char *)vc + (int64_t)table[b + PF_DIST] * pf_bytes;
#if !PF_SPREAD
            for (int64_t c = 0; c < pf_bytes; c += 64) {
                __builtin_prefetch(nk + c, 0, PF_HINT);
                __builtin_prefetch(nv + c, 0, PF_HINT);
            }
            nk = NULL;
#endif
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
            for (int qh = 0; qh < hq; qh += NH) {  /* NH query heads of one KV head share each K/V load */
                if (nk) {
                    const int64_t c0 = (qh / NH) * pf_slice, c1 = c0 + pf_slice < pf_bytes ? c0 + pf_slice : pf_bytes;
                    for (int64_t c = c0; c < c1; c += 64) {
                        __builtin_prefetch(nk + c, 0, PF_HINT);
                        __builtin_prefetch(nv + c, 0, PF_HINT);
                    }
                }
                const int64_t kvo = (int64_t)(qh / G) * head_elems;
                const int m = r * hq + qh;
                for (int c = lo - lo % CHUNK; c < lim; c += CHUNK)
                    heads_chunk(Kb + kvo, Vb + kvo, qb + (size_t)m * D, acc + (size_t)m * D, mx + m, sum + m,
                                bs, c, lim - c < CHUNK ? lim - c : CHUNK, lo > c ? lo - c : 0, cap, D, NH);
            }
            nk = NULL;  /* the next block is on its way: once per block, whatever the unit's rows */
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
/* Specialised by head size and by how many query heads share a K/V load (2 or 1: NH * D / 16
 * vector accumulators must fit the registers). */
static void unit_64x2(UNIT_ARGS) { unit_d(UNIT_CALL, 64, 2); }
static void unit_64(UNIT_ARGS) { unit_d(UNIT_CALL, 64, 1); }
static void unit_128x2(UNIT_ARGS) { unit_d(UNIT_CALL, 128, 2); }
static void unit_128(UNIT_ARGS) { unit_d(UNIT_CALL, 128, 1); }
static void unit_anyx2(UNIT_ARGS) { unit_d(UNIT_CALL, dm->d, 2); }
static void unit_any(UNIT_ARGS) { unit_d(UNIT_CALL, dm->d, 1); }

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
    const int pair = (hq / hkv) % 2 == 0;
    void (*run)(UNIT_ARGS) = d == 64 ? (pair ? unit_64x2 : unit_64) : d == 128 ? (pair ? unit_128x2 : unit_128)
                             : pair ? unit_anyx2 : unit_any;
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
