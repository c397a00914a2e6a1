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
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, as torch's float -> bfloat16 conversion does. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
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
#pragma omp simd
        for (int64_t i = 0; i < inter; i++) {
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

/* One cached row (a key or a value of one kv head) as float32 in `out`. */
static void load_row(const void *cache, int cache_bf16, int64_t at, int64_t dim, float *out) {
    if (cache_bf16) {
        const uint16_t *src = (const uint16_t *)cache + at;
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) {
            uint32_t u = (uint32_t)src[i] << 16;
            float f;
            memcpy(&f, &u, sizeof f);
            out[i] = f;
        }
    } else {
        memcpy(out, (const float *)cache + at, sizeof(float) * (size_t)dim);
    }
}

/* The `group` query heads that share one kv head, over their sequence's keys and values:
 * softmax(q.K * scale) V, each key and value row read once for the whole group.
 * scores: [group, len] scratch; acc: [group, dim] out; row: [dim] scratch. */
static void attend_group(const float *q, const void *cache, int cache_bf16,
                         const int32_t *table, int64_t len, int64_t block_size, int64_t kv,
                         int64_t dim, int64_t group, float scale, float *scores, float *acc,
                         float *row) {
    /* Token t lives in block table[t / block_size] at t % block_size: walk the blocks. */
    for (int64_t start = 0; start < len; start += block_size) {
        int64_t key_at = (int64_t)table[start / block_size] * 2 * block_size * kv;
        int64_t n = len - start < block_size ? len - start : block_size;
        for (int64_t off = 0; off < n; off++) {
            load_row(cache, cache_bf16, key_at + off * kv, dim, row);
            for (int64_t g = 0; g < group; g++) {
                const float *qg = q + g * dim;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t i = 0; i < dim; i++) dot += qg[i] * row[i];
                scores[g * len + start + off] = dot * scale;
            }
        }
    }
    for (int64_t g = 0; g < group; g++) {
        float *sg = scores + g * len, top = -INFINITY, total = 0.0f;
        for (int64_t t = 0; t < len; t++) top = sg[t] > top ? sg[t] : top;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < len; t++) {
            sg[t] = exp_nonpositive(sg[t] - top);
            total += sg[t];
        }
        float inv = 1.0f / total;
#pragma omp simd
        for (int64_t t = 0; t < len; t++) sg[t] *= inv;
    }
    memset(acc, 0, sizeof(float) * (size_t)(group * dim));
    for (int64_t start = 0; start < len; start += block_size) {
        int64_t value_at = ((int64_t)table[start / block_size] * 2 + 1) * block_size * kv;
        int64_t n = len - start < block_size ? len - start : block_size;
        for (int64_t off = 0; off < n; off++) {
            load_row(cache, cache_bf16, value_at + off * kv, dim, row);
            for (int64_t g = 0; g < group; g++) {
                float p = scores[g * len + start + off], *ag = acc + g * dim;
#pragma omp simd
                for (int64_t i = 0; i < dim; i++) ag[i] += p * row[i];
            }
        }
    }
}

/* Attention of one query token per sequence over its paged cache (grouped heads: query
 * head h reads kv head h / (heads / kv_heads)); `head_off` is the head's offset in the
 * cache row. Writes bf16 [seqs, heads * dim]. Returns -1 when out of memory. */
int decode_attention(const float *q, const void *cache, int cache_bf16, const int32_t *tables,
                      int64_t table_stride, const int32_t *seq_lens, int64_t seqs,
                      int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                      float scale, uint16_t *out) {
    int64_t longest = 1, kv = kv_heads * dim, group = heads / kv_heads;
    for (int64_t s = 0; s < seqs; s++)
        if (seq_lens[s] > longest) longest = seq_lens[s];
    float *scratch = malloc(sizeof(float) * (size_t)(group * longest + group * dim + dim));
    if (scratch == NULL) return -1;
    float *acc = scratch + group * longest, *row = acc + group * dim;
    size_t item = cache_bf16 ? sizeof(uint16_t) : sizeof(float);
    for (int64_t s = 0; s < seqs; s++) {
        for (int64_t h = 0; h < kv_heads; h++) {
            const char *head_cache = (const char *)cache + (size_t)(h * dim) * item;
            attend_group(q + (s * heads + h * group) * dim, head_cache, cache_bf16,
                         tables + s * table_stride, seq_lens[s], block_size, kv, dim, group,
                         scale, scratch, acc, row);
            uint16_t *o = out + (s * heads + h * group) * dim;
            for (int64_t i = 0; i < group * dim; i++) o[i] = f32_to_bf16(acc[i]);
        }
    }
    free(scratch);
    return 0;
}
