/* SwiGLU experts' GEMMs for one CPU thread (AVX2 + FMA, fp32), see expert_gemm_cpu.py.
 *
 * Why not batched BLAS: with many small experts (e.g. 128 experts x 32 rows each) every
 * expert's 32 KB weight block is read from DRAM, and BLAS packs each block in a separate
 * small GEMM, which never reaches the memory bandwidth. Here each GEMM reads its weight rows
 * directly (no packing of weights) and, while it computes expert e, prefetches expert e+1's
 * weight block into L2, so the weights stream while the arithmetic runs. Weight gradient
 * stacks larger than the caches are written with streaming stores (no read of the old lines).
 *
 * Every expert is computed on its own, in the same order at any number of experts, so an
 * expert's result does not depend on how many experts share the call (ep layouts agree).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

typedef long I64;

#define UNROLL _Pragma("GCC unroll 8")
#define TILE_ROWS 6 /* 6 x 16 outputs: 12 accumulators + 2 B vectors + 1 broadcast */

/* how a tile writes its result */
enum { STORE = 0, ADD = 1, STREAM = 2 /* non-temporal; c 32-byte aligned, scn == 1 */ };

/* out tile [R, 8*NV] = A[R, K] @ B[K, 8*NV]: A element (m, k) at a[m*sam + k*sak]; B rows at
 * b + k*ldb; the result goes to c (m, n) at c[m*scm + n*scn] (scn == 1: vector stores; else
 * element by element), by `mode` (STORE, ADD or STREAM). Issues one prefetch of
 * pf[*pf_off] per k while *pf_off < pf_end, so the next expert's weights arrive in L2. */
#define DEFINE_TILE(R, NV)                                                                  \
    static void tile_##R##_##NV(I64 k_len, const float *a, I64 sam, I64 sak, const float *b, \
                                I64 ldb, float *c, I64 scm, I64 scn, int mode, const char *pf, \
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
        if (mode == STREAM) {                                                               \
            UNROLL for (int i = 0; i < R; i++) UNROLL for (int j = 0; j < NV; j++)          \
                _mm256_stream_ps(c + i * scm + 8 * j, s[i][j]);                             \
        } else if (scn == 1) {                                                              \
            UNROLL for (int i = 0; i < R; i++) UNROLL for (int j = 0; j < NV; j++) {        \
                float *p = c + i * scm + 8 * j;                                             \
                _mm256_storeu_ps(p, mode == ADD ? _mm256_add_ps(_mm256_loadu_ps(p), s[i][j])  \
                                                : s[i][j]);                                 \
            }                                                                               \
        } else {                                                                            \
            float t[R][8 * NV];                                                             \
            UNROLL for (int i = 0; i < R; i++) UNROLL for (int j = 0; j < NV; j++)          \
                _mm256_storeu_ps(&t[i][8 * j], s[i][j]);                                    \
            for (int n = 0; n < 8 * NV; n++) UNROLL for (int i = 0; i < R; i++) {           \
                float *p = c + i * scm + n * scn;                                           \
                *p = mode == ADD ? *p + t[i][n] : t[i][n];                                  \
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

/* The 16-column panel n.. of B, [K, padded] with row stride *lb: B itself where its rows
 * can be read in place, else packed into `panel` (K * 16 floats), zero past `width`.
 * b_t == 0: element (k, n) at b[k*ldb + n]; b_t == 1: at b[n*ldb + k] (B given transposed). */
static const float *b_panel(I64 n, I64 width, int padded, I64 k_len, const float *b, I64 ldb,
                            int b_t, float *panel, I64 *lb) {
    if (!b_t && width == padded) {
        *lb = ldb;
        return b + n;
    }
    for (I64 k = 0; k < k_len; k++)
        for (int j = 0; j < padded; j++)
            panel[k * padded + j] =
                j >= width ? 0.0f : (b_t ? b[(n + j) * ldb + k] : b[k * ldb + n + j]);
    *lb = padded;
    return panel;
}

/* c[M, width] (+)= A[M, K] @ panel[K, width], A element (m, k) at a[m*sam + k*sak], c element
 * (m, j) at c[m*scm + j*scn] (scn == 1 or scm == 1), written by `mode`; prefetching as the
 * tiles do. */
static void panel_gemm(I64 m_len, I64 k_len, const float *a, I64 sam, I64 sak, const float *bp,
                       I64 lb, I64 width, int padded, float *c, I64 scm, I64 scn, int mode,
                       const char *pf, I64 *pf_off, I64 pf_end) {
    const tile_fn *tiles = padded == 16 ? TILES_16 : TILES_8;
    for (I64 m = 0; m < m_len; m += TILE_ROWS) {
        int rows = m_len - m < TILE_ROWS ? (int)(m_len - m) : TILE_ROWS;
        if (width == padded) {
            tiles[rows](k_len, a + m * sam, sam, sak, bp, lb, c + m * scm, scm, scn, mode, pf,
                        pf_off, pf_end);
        } else { /* a partial last panel: compute padded, keep the first `width` columns */
            float t[TILE_ROWS * 16];
            tiles[rows](k_len, a + m * sam, sam, sak, bp, lb, t, padded, 1, STORE, pf, pf_off,
                        pf_end);
            for (int i = 0; i < rows; i++)
                for (I64 j = 0; j < width; j++) {
                    float *p = c + (m + i) * scm + j * scn;
                    *p = mode == ADD ? *p + t[i * padded + j] : t[i * padded + j];
                }
        }
    }
}

/* c[M, N] (+)= A[M, K] @ B[K, N] for any M, N, K >= 1 (B as in `b_panel`, A and c as in
 * `panel_gemm`). pf / pf_len: bytes to prefetch into L2 over the GEMM (the next expert's
 * weights), or 0. panel: K * 16 floats. */
static void gemm(I64 m_len, I64 n_len, I64 k_len, const float *a, I64 sam, I64 sak,
                 const float *b, I64 ldb, int b_t, float *c, I64 scm, I64 scn, int mode,
                 const char *pf, I64 pf_len, float *panel) {
    I64 pf_off = 0, pf_end = pf ? pf_len : 0;
    for (I64 n = 0; n < n_len; n += 16) {
        I64 width = n_len - n < 16 ? n_len - n : 16, lb;
        int padded = width > 8 ? 16 : 8;
        const float *bp = b_panel(n, width, padded, k_len, b, ldb, b_t, panel, &lb);
        panel_gemm(m_len, k_len, a, sam, sak, bp, lb, width, padded, c + n * scn, scm, scn, mode,
                   pf, &pf_off, pf_end);
    }
}

/* How to write a weight-gradient stack of `numel` floats with rows of `row` floats: streaming
 * stores when it is larger than the caches keep for long (over 2 MiB; the optimizer reads
 * it much later) and every tile row starts 32-byte aligned, else plain stores. */
static int gradient_mode(const float *grad, I64 row, I64 numel) {
    int aligned = (uintptr_t)grad % 32 == 0 && row % 8 == 0;
    return aligned && numel * 4 > (2 << 20) ? STREAM : STORE;
}

#define NEXT_BLOCK(w, block) (e + 1 < n_exp ? (const char *)((w) + (e + 1) * (block)) : 0)

/* x_e @ w_e^T for one expert, x_e [rows, in], w_e [out, in] -> out_e [rows, out]. Both
 * layouts need one operand transposed into 16-column panels; pack the one whose panel serves
 * more tiles: with few rows (rows <= out), panels of x_e^T serve out/6 tiles of weight rows
 * (and the tile results are stored transposed); with many, panels of w_e^T serve rows/6
 * tiles of x_e (vector stores). */
static void linear_forward(I64 rows, I64 in, I64 out, const float *x_e, const float *w_e,
                           float *out_e, const char *pf, I64 pf_len, float *panel) {
    if (rows <= out)
        gemm(out, rows, in, w_e, in, 1, x_e, in, 1, out_e, 1, out, STORE, pf, pf_len, panel);
    else
        gemm(rows, out, in, x_e, in, 1, w_e, in, 1, out_e, out, 1, STORE, pf, pf_len, panel);
}

/* Forward of gate and up: g, u [E, C, I] = x [E, C, H] @ W^T per expert, W = gate, up
 * [E, I, H] (see `linear_forward`; with few rows each panel of x_e^T is packed once for
 * both). Returns 0, or 1 when out of memory. */
int expert_gate_up_forward(I64 n_exp, I64 rows, I64 hidden, I64 inter, const float *x,
                           const float *gate, const float *up, float *g, float *u) {
    float *panel = malloc(sizeof(float) * 16 * hidden);
    if (!panel) return 1;
    I64 wb = inter * hidden;
    for (I64 e = 0; e < n_exp; e++) {
        const float *xe = x + e * rows * hidden;
        const char *pf_gate = NEXT_BLOCK(gate, wb), *pf_up = NEXT_BLOCK(up, wb);
        float *ge = g + e * rows * inter, *ue = u + e * rows * inter;
        if (rows > inter) {
            linear_forward(rows, hidden, inter, xe, gate + e * wb, ge, pf_gate, 4 * wb, panel);
            linear_forward(rows, hidden, inter, xe, up + e * wb, ue, pf_up, 4 * wb, panel);
            continue;
        }
        I64 off_gate = 0, off_up = 0, pf_end = pf_gate ? 4 * wb : 0;
        for (I64 n = 0; n < rows; n += 16) {
            I64 width = rows - n < 16 ? rows - n : 16, lb;
            int padded = width > 8 ? 16 : 8;
            const float *bp = b_panel(n, width, padded, hidden, xe, hidden, 1, panel, &lb);
            panel_gemm(inter, hidden, gate + e * wb, hidden, 1, bp, lb, width, padded,
                       ge + n * inter, 1, inter, STORE, pf_gate, &off_gate, pf_end);
            panel_gemm(inter, hidden, up + e * wb, hidden, 1, bp, lb, width, padded,
                       ue + n * inter, 1, inter, STORE, pf_up, &off_up, pf_end);
        }
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
        linear_forward(rows, inter, hidden, act + e * rows * inter, down + e * wb,
                       y + e * rows * hidden, NEXT_BLOCK(down, wb), 4 * wb, panel);
    free(panel);
    return 0;
}

/* Backward of down: d_act [E, C, I] = dy @ down; d_down [E, H, I] = dy^T @ act. */
int expert_down_backward(I64 n_exp, I64 rows, I64 hidden, I64 inter, const float *dy,
                         const float *act, const float *down, float *d_down, float *d_act) {
    float *panel = malloc(sizeof(float) * 16 * (hidden > rows ? hidden : rows));
    if (!panel) return 1;
    I64 wb = hidden * inter;
    int grad_mode = gradient_mode(d_down, inter, n_exp * wb);
    for (I64 e = 0; e < n_exp; e++) {
        const float *dye = dy + e * rows * hidden;
        gemm(rows, inter, hidden, dye, hidden, 1, down + e * wb, inter, 0, d_act + e * rows * inter,
             inter, 1, STORE, NEXT_BLOCK(down, wb), 4 * wb, panel);
        gemm(hidden, inter, rows, dye, 1, hidden, act + e * rows * inter, inter, 0, d_down + e * wb,
             inter, 1, grad_mode, 0, 0, panel);
    }
    _mm_sfence(); /* streaming stores are visible before the caller reads the gradient */
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
    int gate_mode = gradient_mode(d_gate, hidden, n_exp * wb);
    int up_mode = gradient_mode(d_up, hidden, n_exp * wb);
    for (I64 e = 0; e < n_exp; e++) {
        const float *dge = dg + e * rows * inter, *due = du + e * rows * inter;
        const float *xe = x + e * rows * hidden;
        float *dxe = dx + e * rows * hidden;
        gemm(rows, hidden, inter, dge, inter, 1, gate + e * wb, hidden, 0, dxe, hidden, 1, STORE,
             NEXT_BLOCK(gate, wb), 4 * wb, panel);
        gemm(rows, hidden, inter, due, inter, 1, up + e * wb, hidden, 0, dxe, hidden, 1, ADD,
             NEXT_BLOCK(up, wb), 4 * wb, panel);
        gemm(inter, hidden, rows, dge, 1, inter, xe, hidden, 0, d_gate + e * wb, hidden, 1,
             gate_mode, 0, 0, panel);
        gemm(inter, hidden, rows, due, 1, inter, xe, hidden, 0, d_up + e * wb, hidden, 1, up_mode,
             0, 0, panel);
    }
    _mm_sfence();
    free(panel);
    return 0;
}
