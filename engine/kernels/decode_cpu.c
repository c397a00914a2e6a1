/* The glue of a CPU decode step, one call each instead of 5-20 torch ops.
 *
 * A decode step of a small model on CPU spends more time dispatching the small ops
 * between its matmuls (norms, rotary, attention over a handful of cache blocks, SwiGLU's
 * product, residual adds) than in them. These loops do the same arithmetic as the torch
 * path in engine/models, on the same layouts, in float32 with bfloat16 where that path
 * rounds to bfloat16 (the quantized matmul's inputs and outputs), so the results agree
 * to rounding. Loaded by engine/kernels/cpu_decode.py (built at first use with the
 * system's C compiler); every pointer and size is checked there.
 *
 * Layouts: bf16 values are uint16_t; the KV cache of one layer is
 * [num_blocks, 2, block_size, kv_heads, head_dim] (keys then values of each block).
 */
#include <math.h>
#include <omp.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, as torch's float -> bfloat16 conversion does (a NaN stays a
 * quiet NaN). Branch-free, so that the loops calling it vectorize. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t nan = (u >> 16) | 0x40u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

/* e^x for x <= 0 (softmax's shifted scores, silu's e^-|x|), Cephes' expf: x = n ln2 + r with |r| <=
 * ln2/2, e^r by a degree-6 polynomial (relative error ~1e-7), times 2^n built in the
 * exponent bits. Inline and branch-free, so the softmax loop vectorizes (libm's expf is
 * a call per element). */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * 1.44269504f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

/* 16 bfloat16 values as float32, and 16 float32 values rounded as f32_to_bf16 does. */
static inline f32x16 from_bf16x16(const uint16_t *src) {
    u16x16 h;
    memcpy(&h, src, sizeof h);
    u32x16 u = __builtin_convertvector(h, u32x16) << 16;
    f32x16 f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline u16x16 to_bf16x16(f32x16 f) {
    u32x16 u;
    memcpy(&u, &f, sizeof u);
    u32x16 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, nan = (u >> 16) | 0x40u;
    u32x16 is_nan = (u32x16)((u & 0x7fffffffu) > 0x7f800000u);
    return __builtin_convertvector((rounded & ~is_nan) | (nan & is_nan), u16x16);
}

/* 16 cached values from `at` as float32 (a bfloat16 is a float32's upper half). */
static inline f32x16 load16(const void *cache, int cache_bf16, int64_t at) {
    if (cache_bf16) return from_bf16x16((const uint16_t *)cache + at);
    f32x16 f;
    memcpy(&f, (const float *)cache + at, sizeof f);
    return f;
}

static inline float hsum16(f32x16 v) {
#ifdef __AVX512F__
    return _mm512_reduce_add_ps((__m512)v);
#else
    float lanes[16];
    memcpy(lanes, &v, sizeof lanes);
    for (int k = 8; k >= 1; k /= 2)
        for (int j = 0; j < k; j++) lanes[j] += lanes[j + k];
    return lanes[0];
#endif
}

/* exp_nonpositive on 16 lanes (the same reduction and polynomial; n rounded to nearest by
 * adding and subtracting 1.5 * 2^23, which keeps |r| <= ln2/2). */
static inline f32x16 exp16(f32x16 x) {
    const f32x16 lowest = x - x - 87.0f, magic = x - x + 12582912.0f;
    i32x16 low = x < lowest;
    x = (f32x16)(((i32x16)x & ~low) | ((i32x16)lowest & low));
    f32x16 n = (x * 1.44269504f + magic) - magic;
    f32x16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
    f32x16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    i32x16 bits = (__builtin_convertvector(n, i32x16) + 127) << 23;
    return p * (f32x16)bits;
}

/* out[r] = bf16(x[r] / sqrt(mean(x[r]^2) + eps) * w) for each of `rows` rows of n. */
static void norm_row(const float *x, const float *w, uint16_t *out, int64_t n, float eps) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = f32_to_bf16(x[i] * inv * w[i]);
}

void rms_norm_bf16(const float *x, const float *w, uint16_t *out, int64_t rows, int64_t n,
                   float eps) {
    for (int64_t r = 0; r < rows; r++) norm_row(x + r * n, w, out + r * n, n, eps);
}

/* The residual add of a bfloat16 delta into h (in place), then h's norm: h += delta;
 * out = bf16(rms_norm(h) * w). */
void add_rms_norm_bf16(float *h, const uint16_t *delta, const float *w, uint16_t *out,
                       int64_t rows, int64_t n, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        float *hr = h + r * n;
        const uint16_t *dr = delta + r * n;
        for (int64_t i = 0; i < n; i++) hr[i] += bf16_to_f32(dr[i]);
        norm_row(hr, w, out + r * n, n, eps);
    }
}

/* SwiGLU's product: out = bf16(bf16(silu(gate)) * up) for gate|up rows of 2*inter, with
 * silu(x) = x / (1 + e^-x) computed from e = e^-|x| <= 1 (x >= 0: x / (1 + e); x < 0:
 * x e / (1 + e)), so that the loop vectorizes. */
void silu_mul_bf16(const uint16_t *gate_up, int64_t stride, uint16_t *out, int64_t rows,
                   int64_t inter) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + r * stride;
        const uint16_t *u = g + inter;
        uint16_t *o = out + r * inter;
        int64_t i = 0;
        for (; i + 16 <= inter; i += 16) {
            f32x16 x = from_bf16x16(g + i), zero = x - x;
            i32x16 negative = x < zero;
            f32x16 minus_abs = (f32x16)(((i32x16)x & negative) | ((i32x16)(-x) & ~negative));
            f32x16 e = exp16(minus_abs);
            f32x16 times = (f32x16)(((i32x16)(x * e) & negative) | ((i32x16)x & ~negative));
            u16x16 silu = to_bf16x16(times / (1.0f + e));
            u16x16 y = to_bf16x16(from_bf16x16((const uint16_t *)&silu) * from_bf16x16(u + i));
            memcpy(o + i, &y, sizeof y);
        }
        for (; i < inter; i++) {
            float x = bf16_to_f32(g[i]);
            float e = exp_nonpositive(x < 0.0f ? x : -x);
            float silu = (x < 0.0f ? x * e : x) / (1.0f + e);
            o[i] = f32_to_bf16(bf16_to_f32(f32_to_bf16(silu)) * bf16_to_f32(u[i]));
        }
    }
}

/* Neox rotation of one head in place: (a, b) -> (a cos - b sin, b cos + a sin). */
static void rotate(float *x, const float *cs, int64_t half) {
    for (int64_t i = 0; i < half; i++) {
        float a = x[i], b = x[i + half], c = cs[i], s = cs[half + i];
        x[i] = a * c - b * s;
        x[i + half] = b * c + a * s;
    }
}

/* q|k|v rows (bf16, `stride` apart) -> rotated queries (float32 [T, heads, dim]) and the
 * rotated key and the value of each token written to its cache slot. `table` rows are
 * cos|sin of each position (float32 [positions, dim]). cache_bf16 selects the cache's
 * element type (0: float32, 1: bfloat16). Returns -1 when out of memory. */
int rope_store(const uint16_t *qkv, int64_t stride, const float *table, const int64_t *pos,
                const int64_t *slots, int64_t tokens, int64_t heads, int64_t kv_heads,
                int64_t dim, int64_t block_size, float *q_out, void *cache, int cache_bf16) {
    int64_t half = dim / 2, kv = kv_heads * dim;
    float *k = malloc(sizeof(float) * (size_t)kv);
    if (k == NULL) return -1;
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t *row = qkv + t * stride;
        const float *cs = table + pos[t] * dim;
        float *q = q_out + t * heads * dim;
        for (int64_t i = 0; i < heads * dim; i++) q[i] = bf16_to_f32(row[i]);
        for (int64_t i = 0; i < kv; i++) k[i] = bf16_to_f32(row[heads * dim + i]);
        for (int64_t h = 0; h < heads; h++) rotate(q + h * dim, cs, half);
        for (int64_t h = 0; h < kv_heads; h++) rotate(k + h * dim, cs, half);
        const uint16_t *v = row + heads * dim + kv;
        int64_t block = slots[t] / block_size, off = slots[t] % block_size;
        int64_t key_at = ((block * 2) * block_size + off) * kv;
        int64_t value_at = ((block * 2 + 1) * block_size + off) * kv;
        if (cache_bf16) {
            uint16_t *c = cache;
            for (int64_t i = 0; i < kv; i++) {
                c[key_at + i] = f32_to_bf16(k[i]);
                c[value_at + i] = v[i];
            }
        } else {
            float *c = cache;
            for (int64_t i = 0; i < kv; i++) {
                c[key_at + i] = k[i];
                c[value_at + i] = bf16_to_f32(v[i]);
            }
        }
    }
    free(k);
    return 0;
}

/* Scores of the `group` query heads against keys [from, to): scores[g][t - from] =
 * scale * q_g . k_t, each key row converted once. nv = dim / 16 is a constant where
 * this is inlined, so the group's queries stay in registers. */
static inline void key_scores(const f32x16 *qv, const void *cache, int cache_bf16,
                              const int32_t *table, int64_t from, int64_t to,
                              int64_t block_size, int64_t kv, int64_t group, float scale,
                              float *scores, const int nv) {
    int64_t len = to - from;
    /* Token t is row t % block_size of block table[t / block_size]: walk the blocks (one
     * division per block, not per row). */
    for (int64_t t = from; t < to;) {
        int64_t off = t % block_size, n = block_size - off < to - t ? block_size - off : to - t;
        int64_t at = ((int64_t)table[t / block_size] * 2 * block_size + off) * kv;
        for (int64_t j = 0; j < n; j++, t++, at += kv) {
            f32x16 k[16];
            for (int v = 0; v < nv; v++) k[v] = load16(cache, cache_bf16, at + 16 * v);
            for (int64_t g = 0; g < group; g++) {
                f32x16 s = qv[g * nv] * k[0];
                for (int v = 1; v < nv; v++) s += qv[g * nv + v] * k[v];
                scores[g * len + t - from] = hsum16(s) * scale;
            }
        }
    }
}

/* acc_g = sum_t p_g[t] v_t over values [from, to), one head at a time so that its nv
 * accumulators stay in registers (the value rows, re-read per head, are in cache). */
static inline void weigh_values(const float *p, const void *cache, int cache_bf16,
                                const int32_t *table, int64_t from, int64_t to,
                                int64_t block_size, int64_t kv, float *acc, const int nv) {
    f32x16 a[16];
    for (int v = 0; v < nv; v++) a[v] = (f32x16){0};
    for (int64_t t = from; t < to;) {
        int64_t off = t % block_size, n = block_size - off < to - t ? block_size - off : to - t;
        int64_t at = (((int64_t)table[t / block_size] * 2 + 1) * block_size + off) * kv;
        for (int64_t j = 0; j < n; j++, t++, at += kv)
            for (int v = 0; v < nv; v++) a[v] += p[t - from] * load16(cache, cache_bf16, at + 16 * v);
    }
    memcpy(acc, a, sizeof(f32x16) * (size_t)nv);
}

/* One work item of a decode step's attention: the `group` query heads that share one kv
 * head, over the keys and values of positions [from, to) of their sequence. Leaves, per
 * head g, the partial softmax state of its range (flash-decoding): top[g] = max score,
 * total[g] = sum e^(score - top[g]), acc[g] = sum e^(score - top[g]) * value
 * (unnormalized). scores: [group, to - from] scratch. nv = dim / 16 (dim a multiple of 16,
 * at most 256; group * nv at most 256). */
static inline void attend_range(const float *q, const void *cache, int cache_bf16,
                                const int32_t *table, int64_t from, int64_t to,
                                int64_t block_size, int64_t kv, int64_t group, float scale,
                                float *scores, float *top, float *total, float *acc,
                                const int nv) {
    int64_t len = to - from;
    f32x16 qv[256]; /* group * nv <= 256: the caller checks */
    memcpy(qv, q, sizeof(f32x16) * (size_t)(group * nv));
    key_scores(qv, cache, cache_bf16, table, from, to, block_size, kv, group, scale, scores, nv);
    for (int64_t g = 0; g < group; g++) {
        float *sg = scores + g * len, m = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max : m)
        for (int64_t t = 0; t < len; t++) m = sg[t] > m ? sg[t] : m;
        int64_t t = 0;
        f32x16 sums = {0};
        for (; t + 16 <= len; t += 16) {
            f32x16 e;
            memcpy(&e, sg + t, sizeof e);
            e = exp16(e - m);
            memcpy(sg + t, &e, sizeof e);
            sums += e;
        }
        sum = hsum16(sums);
        for (; t < len; t++) sum += (sg[t] = exp_nonpositive(sg[t] - m));
        top[g] = m;
        total[g] = sum;
        weigh_values(sg, cache, cache_bf16, table, from, to, block_size, kv, acc + g * 16 * nv, nv);
    }
}

/* One cached element as float32. */
static inline float cached(const void *cache, int cache_bf16, int64_t at) {
    return cache_bf16 ? bf16_to_f32(((const uint16_t *)cache)[at]) : ((const float *)cache)[at];
}

/* attend_range for a head dim that is not a multiple of 16 (scalar: small test models). */
static void attend_range_any(const float *q, const void *cache, int cache_bf16,
                             const int32_t *table, int64_t from, int64_t to,
                             int64_t block_size, int64_t kv, int64_t dim, int64_t group,
                             float scale, float *scores, float *top, float *total,
                             float *acc) {
    int64_t len = to - from;
    memset(acc, 0, sizeof(float) * (size_t)(group * dim));
    for (int64_t g = 0; g < group; g++) {
        float m = -INFINITY, sum = 0.0f, *sg = scores + g * len;
        for (int64_t t = from; t < to; t++) {
            int64_t at = ((int64_t)table[t / block_size] * 2 * block_size + t % block_size) * kv;
            float d = 0.0f;
            for (int64_t i = 0; i < dim; i++) d += q[g * dim + i] * cached(cache, cache_bf16, at + i);
            sg[t - from] = d * scale;
            m = sg[t - from] > m ? sg[t - from] : m;
        }
        for (int64_t t = from; t < to; t++) {
            int64_t at =
                (((int64_t)table[t / block_size] * 2 + 1) * block_size + t % block_size) * kv;
            float w = exp_nonpositive(sg[t - from] - m);
            sum += w;
            for (int64_t i = 0; i < dim; i++) acc[g * dim + i] += w * cached(cache, cache_bf16, at + i);
        }
        top[g] = m;
        total[g] = sum;
    }
}

/* How many ranges each (sequence, kv head) is split into: enough items for two per
 * thread, each range at least 32 positions (a shorter one costs more to merge than it
 * saves). */
static int64_t attention_splits(int64_t longest, int64_t pairs, int64_t threads) {
    int64_t want = (2 * threads + pairs - 1) / pairs, most = (longest + 31) / 32;
    int64_t splits = want < most ? want : most;
    return splits < 1 ? 1 : splits;
}

/* Attention of one query token per sequence over its paged cache (grouped heads: query
 * head h reads kv head h / (heads / kv_heads)). Writes bf16 [seqs, heads * dim]. The
 * (sequence, kv head) pairs are split into position ranges (`attention_splits`), computed
 * on the calling thread's OpenMP team (torch's runtime: the library links the libgomp that
 * torch loaded), then merged per head: with M = max_i top_i and w_i = e^(top_i - M),
 *     out = sum_i w_i acc_i / sum_i w_i total_i,
 * which is softmax(q K^T scale) V over the whole sequence. Returns -1 when out of memory. */
int decode_attention(const float *q, const void *cache, int cache_bf16, const int32_t *tables,
                      int64_t table_stride, const int32_t *seq_lens, int64_t seqs,
                      int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                      float scale, uint16_t *out) {
    int64_t longest = 1, kv = kv_heads * dim, group = heads / kv_heads;
    for (int64_t s = 0; s < seqs; s++)
        if (seq_lens[s] > longest) longest = seq_lens[s];
    int64_t pairs = seqs * kv_heads;
    int64_t splits = attention_splits(longest, pairs, omp_get_max_threads());
    int64_t items = pairs * splits, chunk = (longest + splits - 1) / splits;
    int64_t state = group * (dim + 2); /* top, total, acc of one item */
    float *partial = malloc(sizeof(float) * (size_t)(items * state));
    if (partial == NULL) return -1;
    size_t item = cache_bf16 ? sizeof(uint16_t) : sizeof(float);
    int failed = 0;
#pragma omp parallel for schedule(static) reduction(| : failed)
    for (int64_t i = 0; i < items; i++) {
        int64_t s = i / (kv_heads * splits), h = i / splits % kv_heads, part = i % splits;
        int64_t from = part * chunk, to = from + chunk < seq_lens[s] ? from + chunk : seq_lens[s];
        float *p = partial + i * state;
        if (from >= to) { /* an empty range: no weight in the merge */
            for (int64_t g = 0; g < group; g++) p[g] = -INFINITY, p[group + g] = 0.0f;
            continue;
        }
        float *scratch = malloc(sizeof(float) * (size_t)(group * (to - from)));
        if (scratch == NULL) {
            failed = 1;
            continue;
        }
        const float *qh = q + (s * heads + h * group) * dim;
        const void *ch = (const char *)cache + (size_t)(h * dim) * item;
        const int32_t *tb = tables + s * table_stride;
        float *top = p, *total = p + group, *acc = p + 2 * group;
        /* attend_range holds the group's queries in 256 vectors of 16 */
        int vectors = dim % 16 == 0 && dim <= 256 && group * (dim / 16) <= 256;
        if (vectors && dim == 64) /* constant nv: the accumulators live in registers */
            attend_range(qh, ch, cache_bf16, tb, from, to, block_size, kv, group, scale,
                         scratch, top, total, acc, 4);
        else if (vectors && dim == 128)
            attend_range(qh, ch, cache_bf16, tb, from, to, block_size, kv, group, scale,
                         scratch, top, total, acc, 8);
        else if (vectors)
            attend_range(qh, ch, cache_bf16, tb, from, to, block_size, kv, group, scale,
                         scratch, top, total, acc, (int)(dim / 16));
        else
            attend_range_any(qh, ch, cache_bf16, tb, from, to, block_size, kv, dim, group,
                             scale, scratch, top, total, acc);
        free(scratch);
    }
    if (!failed) {
        for (int64_t pair = 0; pair < pairs; pair++) {
            const float *first = partial + pair * splits * state;
            uint16_t *o = out + pair * group * dim; /* pair = s * kv_heads + h */
            for (int64_t g = 0; g < group; g++) {
                float m = -INFINITY, total = 0.0f, merged[dim];
                for (int64_t k = 0; k < splits; k++)
                    m = first[k * state + g] > m ? first[k * state + g] : m;
                memset(merged, 0, sizeof merged);
                for (int64_t k = 0; k < splits; k++) {
                    const float *p = first + k * state;
                    if (p[group + g] == 0.0f) continue;
                    float w = exp_nonpositive(p[g] - m);
                    total += w * p[group + g];
                    for (int64_t d = 0; d < dim; d++) merged[d] += w * p[2 * group + g * dim + d];
                }
                for (int64_t d = 0; d < dim; d++) o[g * dim + d] = f32_to_bf16(merged[d] / total);
            }
        }
    }
    free(partial);
    return failed ? -1 : 0;
}

/* IEEE half -> float (GGUF's block scales), subnormals included. */
static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1fu) {
        bits = sign | 0x7f800000u | (man << 13); /* inf, NaN */
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else {
        float f = (float)man * 5.9604644775390625e-8f; /* 2^-24 */
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* 16 int8 codes as float32 (intrinsics where there are: GCC scalarizes the generic
 * int8 -> int32 conversion). */
static inline f32x16 codes16(const uint8_t *src) {
    f32x16 f;
#if defined(__AVX512F__)
    __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)src)));
    memcpy(&f, &v, sizeof f);
#elif defined(__AVX2__)
    __m128i b = _mm_loadu_si128((const __m128i *)src);
    __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
    memcpy(&f, &lo, sizeof lo);
    memcpy((char *)&f + sizeof lo, &hi, sizeof hi);
#else
    for (int i = 0; i < 16; i++) f[i] = (float)(int8_t)src[i];
#endif
    return f;
}

/* y[i, r] = sum over r's Q8_0 blocks b of d_b * (q_b . x_i[32 b : 32 b + 32]), in float32,
 * for `m` rows x_i of `cols` floats against `rows` weight rows of cols / 32 blocks (34
 * bytes each: an IEEE half d, then 32 int8 codes q). The exact dot products of the
 * dequantized weights (to float32 rounding): an lm_head kept as GGUF's Q8_0 read once,
 * on the calling thread's team, rows split between its threads. */
void q8_0_matmul(const uint8_t *w, int64_t rows, int64_t cols, const float *x, int64_t m,
                 float *y) {
    int64_t blocks = cols / 32, row_bytes = blocks * 34;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *row = w + r * row_bytes;
        for (int64_t i = 0; i < m; i++) {
            const float *xi = x + i * cols;
            f32x16 acc = {0};
            for (int64_t b = 0; b < blocks; b++) {
                const uint8_t *block = row + b * 34;
                uint16_t half;
                memcpy(&half, block, sizeof half);
                f32x16 x0, x1;
                memcpy(&x0, xi + 32 * b, sizeof x0);
                memcpy(&x1, xi + 32 * b + 16, sizeof x1);
                f32x16 s = codes16(block + 2) * x0 + codes16(block + 18) * x1;
                acc += f16_to_f32(half) * s;
            }
            y[i * rows + r] = hsum16(acc);
        }
    }
}
