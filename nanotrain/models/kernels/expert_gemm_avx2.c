/* SwiGLU experts' GEMMs for one CPU thread (AVX2 + FMA, fp32), see expert_gemm_cpu.py.
 *
 * Why not batched BLAS: with many small experts (e.g. 128 experts x 32 rows each) every
 * expert's 32 KB weight block is read from DRAM, and BLAS packs each block in a separate
 * small GEMM, which never reaches the memory bandwidth. Here each GEMM reads its weight rows
 * directly (no packing of weights) and, while it computes expert e, prefetches expert e+1's
 * weight block into L2, so the weights stream while the arithmetic runs.
 *
 * Every expert is computed on its own, in the same order at any number of experts, so an
 * expert's result does not depend on how many experts share the call (ep layouts agree).
 */
#include <immintrin.h>
#include <stdlib.h>

typedef long I64;

#define UNROLL _Pragma("GCC unroll 8")
#define TILE_ROWS 6 /* 6 x 16 outputs: 12 accumulators + 2 B vectors + 1 broadcast */

/* out tile [R, 8*NV] = A[R, K] @ B[K, 8*NV]: A element (m, k) at a[m*sam + k*sak]; B rows at
 * b + k*ldb; the result goes to c (m, n) at c[m*scm + n*scn] (scn == 1: vector stores; else
 * element by element), added to what is there when acc. Issues one prefetch of
 * pf[*pf_off] per k while *pf_off < pf_end, so the next expert's weights arrive in L2. */
#define DEFINE_TILE(R, NV)                                                                  \
    static void tile_##R##_##NV(I64 k_len, const float *a, I64 sam, I64 sak, const float *b, \
                                I64 ldb, float *c, I64 scm, I64 scn, int acc, const char *pf, \
                                I64 *pf_off, I64 pf_end) {                                   \
        __m256 s[R][NV];                                                                    \
        UNROLL for (int i = 0; i < R; i++) UNROLL for (int j = 0; j < NV; j++) s[i][j] =    \
            _mm256_setzero_ps();                                                            \
        I64 po = *pf_off;                                                                   \
        for (I64 k = 0; k < k_len; k++) {                                                   \
            __m256 bv[NV];                                                                  \
            UNROLL for (int j = 0; j < NV; j++) bv[j] = _mm256_loadu_ps(b + k * ldb + 8 * j); \
            UNROLL for (int i = 0; i < R; i++) {                                            \
                __m256 av = _mm256_broadcast_ss(a + i * sam + k * sak);                     \
                UNROLL for (int j = 0; j < NV; j++) s[i][j] = _mm256_fmadd_ps(av, bv[j], s[i][j]); \
            }                                                                               \
            if (po < pf_end) {                                                              \
                _mm_prefetch(pf + po, _MM_HINT_T1);                                         \
                po += 64;                                                                   \
            }                                                                               \
        }                                                                                   \
        *pf_off = po;                                                                       \
        if (scn == 1) {                                                                     \
            UNROLL for (int i = 0; i < R; i++) UNROLL for (int j = 0; j < NV; j++) {        \
                float *p = c + i * scm + 8 * j;                                             \
                _mm256_storeu_ps(p, acc ? _mm256_add_ps(_mm256_loadu_ps(p), s[i][j]) : s[i][j]); \
            }                                                                               \
        } else {                                                                            \
            float t[R][8 * NV];                                                             \
            UNROLL for (int i = 0; i < R; i++) UNROLL for (int j = 0; j < NV; j++)          \
                _mm256_storeu_ps(&t[i][8 * j], s[i][j]);                                    \
            for (int n = 0; n < 8 * NV; n++) UNROLL for (int i = 0; i < R; i++) {           \
                float *p = c + i * scm + n * scn;                                           \
                *p = acc ? *p + t[i][n] : t[i][n];                                          \
            }                                                                               \
        }                                                                                   \
    }

DEFINE_TILE(1, 1) DEFINE_TILE(2, 1) DEFINE_TILE(3, 1) DEFINE_TILE(4, 1) DEFINE_TILE(5, 1)
DEFINE_TILE(6, 1) DEFINE_TILE(1, 2) DEFINE_TILE(2, 2) DEFINE_TILE(3, 2) DEFINE_TILE(4, 2)
DEFINE_TILE(5, 2) DEFINE_TILE(6, 2)

typedef void (*tile_fn)(I64, const float *, I64, I64, const float *, I64, float *, I64, I64, int,
                        const char *, I64 *, I64);
static const tile_fn TILES_8[7] = {0, tile_1_1, tile_2_1, tile_3_1, tile_4_1, tile_5_1, tile_6_1};
static const tile_fn TILES_16[7] = {0, tile_1_2, tile_2_2, tile_3_2, tile_4_2, tile_5_2, tile_6_2};

/* c[M, N] (+)= A[M, K] @ B[K, N] for any M, N, K >= 1.
 * A element (m, k) at a[m*sam + k*sak]. B: b_t == 0: element (k, n) at b[k*ldb + n];
 * b_t == 1: at b[n*ldb + k] (B given transposed; each 16-column panel is packed first).
 * c element (m, n) at c[m*scm + n*scn], with scn == 1 or scm == 1. panel: K*16 floats.
 * pf / pf_len: bytes to prefetch into L2 over the GEMM (the next expert's weights), or 0. */
static void gemm(I64 m_len, I64 n_len, I64 k_len, const float *a, I64 sam, I64 sak,
                 const float *b, I64 ldb, int b_t, float *c, I64 scm, I64 scn, int acc,
                 const char *pf, I64 pf_len, float *panel) {
    I64 pf_off = 0, pf_end = pf ? pf_len : 0;
    for (I64 n = 0; n < n_len; n += 16) {
        I64 width = n_len - n < 16 ? n_len - n : 16;
        int nv = width > 8 ? 2 : 1, padded = 8 * nv;
        const tile_fn *tiles = nv == 2 ? TILES_16 : TILES_8;
        const float *bp = b + (b_t ? n * ldb : n);
        I64 lb = ldb;
        if (b_t || width < padded) { /* pack [K, padded], zero past width */
            for (I64 k = 0; k < k_len; k++)
                for (int j = 0; j < padded; j++)
                    panel[k * padded + j] =
                        j >= width ? 0.0f : (b_t ? b[(n + j) * ldb + k] : b[k * ldb + n + j]);
            bp = panel;
            lb = padded;
        }
        for (I64 m = 0; m < m_len; m += TILE_ROWS) {
            int rows = m_len - m < TILE_ROWS ? (int)(m_len - m) : TILE_ROWS;
            if (width == padded) {
                tiles[rows](k_len, a + m * sam, sam, sak, bp, lb, c + m * scm + n * scn, scm, scn,
                            acc, pf, &pf_off, pf_end);
            } else { /* a partial last panel: compute padded, keep the first `width` columns */
                float t[TILE_ROWS * 16];
                tiles[rows](k_len, a + m * sam, sam, sak, bp, lb, t, padded, 1, 0, pf, &pf_off,
                            pf_end);
                for (int i = 0; i < rows; i++)
                    for (I64 j = 0; j < width; j++) {
                        float *p = c + (m + i) * scm + (n + j) * scn;
                        *p = acc ? *p + t[i * padded + j] : t[i * padded + j];
                    }
            }
        }
    }
}

#define NEXT_BLOCK(w, block) (e + 1 < n_exp ? (const char *)((w) + (e + 1) * (block)) : 0)

/* Forward of gate and up: g, u [E, C, I] = x [E, C, H] @ W^T per expert, W = gate, up
 * [E, I, H]. Computed as W_e @ x_e^T (the weights are the broadcast operand, read row by
 * row) and stored transposed into g, u. Returns 0, or 1 when out of memory. */
int expert_gate_up_forward(I64 n_exp, I64 rows, I64 hidden, I64 inter, const float *x,
                           const float *gate, const float *up, float *g, float *u) {
    float *panel = malloc(sizeof(float) * 16 * hidden);
    if (!panel) return 1;
    I64 wb = inter * hidden;
    for (I64 e = 0; e < n_exp; e++) {
        const float *xe = x + e * rows * hidden;
        gemm(inter, rows, hidden, gate + e * wb, hidden, 1, xe, hidden, 1, g + e * rows * inter, 1,
             inter, 0, NEXT_BLOCK(gate, wb), 4 * wb, panel);
        gemm(inter, rows, hidden, up + e * wb, hidden, 1, xe, hidden, 1, u + e * rows * inter, 1,
             inter, 0, NEXT_BLOCK(up, wb), 4 * wb, panel);
    }
    free(panel);
    return 0;
}

/* Forward of down: y [E, C, H] = a [E, C, I] @ down^T per expert, down [E, H, I]. */
int expert_down_forward(I64 n_exp, I64 rows, I64 hidden, I64 inter, const float *act,
                        const float *down, float *y) {
    float *panel = malloc(sizeof(float) * 16 * inter);
    if (!panel) return 1;
    I64 wb = hidden * inter;
    for (I64 e = 0; e < n_exp; e++)
        gemm(hidden, rows, inter, down + e * wb, inter, 1, act + e * rows * inter, inter, 1,
             y + e * rows * hidden, 1, hidden, 0, NEXT_BLOCK(down, wb), 4 * wb, panel);
    free(panel);
    return 0;
}

/* Backward of down: d_act [E, C, I] = dy @ down; d_down [E, H, I] = dy^T @ act. */
int expert_down_backward(I64 n_exp, I64 rows, I64 hidden, I64 inter, const float *dy,
                         const float *act, const float *down, float *d_down, float *d_act) {
    float *panel = malloc(sizeof(float) * 16 * (hidden > rows ? hidden : rows));
    if (!panel) return 1;
    I64 wb = hidden * inter;
    for (I64 e = 0; e < n_exp; e++) {
        const float *dye = dy + e * rows * hidden;
        gemm(rows, inter, hidden, dye, hidden, 1, down + e * wb, inter, 0, d_act + e * rows * inter,
             inter, 1, 0, NEXT_BLOCK(down, wb), 4 * wb, panel);
        gemm(hidden, inter, rows, dye, 1, hidden, act + e * rows * inter, inter, 0, d_down + e * wb,
             inter, 1, 0, 0, 0, panel);
    }
    free(panel);
    return 0;
}

/* Backward of gate and up: dx [E, C, H] = dg @ gate + du @ up; d_gate, d_up [E, I, H] =
 * dg^T @ x, du^T @ x. */
int expert_gate_up_backward(I64 n_exp, I64 rows, I64 hidden, I64 inter, const float *dg,
                            const float *du, const float *x, const float *gate, const float *up,
                            float *d_gate, float *d_up, float *dx) {
    float *panel = malloc(sizeof(float) * 16 * (inter > rows ? inter : rows));
    if (!panel) return 1;
    I64 wb = inter * hidden;
    for (I64 e = 0; e < n_exp; e++) {
        const float *dge = dg + e * rows * inter, *due = du + e * rows * inter;
        const float *xe = x + e * rows * hidden;
        float *dxe = dx + e * rows * hidden;
        gemm(rows, hidden, inter, dge, inter, 1, gate + e * wb, hidden, 0, dxe, hidden, 1, 0,
             NEXT_BLOCK(gate, wb), 4 * wb, panel);
        gemm(rows, hidden, inter, due, inter, 1, up + e * wb, hidden, 0, dxe, hidden, 1, 1,
             NEXT_BLOCK(up, wb), 4 * wb, panel);
        gemm(inter, hidden, rows, dge, 1, inter, xe, hidden, 0, d_gate + e * wb, hidden, 1, 0, 0,
             0, panel);
        gemm(inter, hidden, rows, due, 1, inter, xe, hidden, 0, d_up + e * wb, hidden, 1, 0, 0, 0,
             panel);
    }
    free(panel);
    return 0;
}
