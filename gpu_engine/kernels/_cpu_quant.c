/* Matrix products over quantized weights on the CPU, fp32 activations and fp32 arithmetic (AVX2 + FMA).
 *
 * Weights stay in their GGUF form; every weight the kernel multiplies is exactly the fp32 value the
 * GGUF dequantizer gives, so only the order of the fp32 sums differs from a dense fp32 matmul:
 *   q4 (Q4_1): per row, groups of 32 along K, each a 20-byte block as GGUF stores it: the fp16 scale d,
 *              the fp16 minimum m, then 16 bytes of 4-bit codes (byte j: element j in the low nibble,
 *              element j + 16 in the high one): w = d * q + m. Per group, x . w = d * (x . q) + m * sum(x).
 *   q8 (Q8_0): int8 codes [N, K] with an fp32 scale per group of 32: w = d * q.
 * y [M, N] = x [M, K] @ W.T, or y += that with `accumulate` (a residual add for free).
 *
 * Decode (a few rows of x): row tiles of x (up to 8) share each decoded group of weights, and several weight
 * rows are in flight at once so that the FMA chains overlap; the weights PREFETCH_BYTES ahead are prefetched
 * (they stream from memory once per step: the hardware prefetcher alone left half the bandwidth unused), but
 * never past the thread's chunk of rows, whose start is prefetched when it is taken.
 * Prefill (more than GEMM_ROWS rows, q4): the panel product below. `threads` > 1 splits the weight rows over
 * a small pool of workers (the caller's thread is one of them) that take chunks of rows as they come free,
 * spin briefly between jobs and then sleep on a futex.
 *
 * With `int8_x` the input of a decode product is first quantized to int8 per group of 32 and the group dots
 * are integer (maddubs), llama.cpp's arithmetic: faster, and no longer exact (--cpu-weights int8act).
 *
 * Also: q4_dequant (the whole weight as fp32, for references), a layer's small ops (rms_norm,
 * rope_write_kv, attend_decode: see kernels/cpu_fused.py), decode_stack (a decode step's every layer in
 * one call: its attention, by query heads, and its SiLU, by items, are split over the same pool), and
 * `available()`: whether this CPU has AVX2, FMA and F16C (the only code path there is). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <math.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define GROUP 32
#define MAX_THREADS 8
#define MR_MAX 8
#define Q4_BLOCK 20      /* bytes of a Q4_1 block: fp16 d, fp16 m, 16 bytes of codes */
#define MAX_K 65536      /* the q4 tile keeps a row tile's minima on its stack: 4 * K / 32 floats at most */
#define PREFETCH_BYTES 4096 /* measured: 1, 2 and 8 KB, and 8 tiles ahead (past the chunk), were slower */
#define TARGET __attribute__((target("avx2,fma,f16c")))

typedef struct Job Job;
/* A job of other work than a product (kind 7): items [begin, end) of it, on the pool thread `worker` (0: the
 * caller's), whose scratch is its own. */
typedef void (*TaskFn)(const Job *, int64_t begin, int64_t end, int worker);

struct Job {
  float *y;
  const float *x;
  const uint8_t *codes; /* q4: the blocks [N, K / 32] (20 bytes each); q8: the codes [N, K] */
  const float *d;       /* q8: the scales [N, K / 32] */
  const float *xsum; /* [M, G] sums of x per group (q4 only) */
  int64_t M, N, K;
  int accumulate, kind; /* kind 4: q4, 8: q8; 5, 9: the same with int8 activations; 6: q4, many rows */
  const int8_t *xq;     /* kinds 5, 9: x as int8 codes [M, K] with one scale per group, xd [M, G] */
  const float *xd;
  TaskFn task;          /* kind 7: N items, `chunk` at a time (0: as a product's rows), over `args` */
  const void *args;
  int64_t chunk;
};

/* ------------------------------------------------------------------ kernels */

TARGET static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/* The 32 codes of a Q4_1 block's 16 bytes as fp32, in element order: each half of the bytes widened to 32-bit
 * lanes straight from memory (bytes 0-7 hold elements 0-7 and 16-23, bytes 8-15 elements 8-15 and 24-31), then
 * the nibbles split in the lanes: two widening loads instead of one load and four cross-lane widenings. */
TARGET static inline void decode_q4(const uint8_t *p, __m256 q[4]) {
  const __m256i mask = _mm256_set1_epi32(0x0F);
  __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
  __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)));
  q[0] = _mm256_cvtepi32_ps(_mm256_and_si256(a, mask));
  q[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b, mask));
  q[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4));
  q[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}

/* A Q4_1 block's fp16 scale and minimum, both converted at once: (d, m, 0, 0). */
TARGET static inline __m128 scale_min_q4(const uint8_t *p) {
  int32_t dm;
  memcpy(&dm, p, sizeof dm);
  return _mm_cvtph_ps(_mm_cvtsi32_si128(dm));
}

TARGET static inline float half_at(const uint8_t *p) {
  uint16_t h;
  memcpy(&h, p, sizeof h);
  return _cvtsh_ss(h);
}

TARGET static inline void decode_q8(const uint8_t *p, __m256 q[4]) {
  for (int i = 0; i < 4; i++)
    q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * i))));
}

/* NR weight rows from n0 against MR rows of x from m0: the fully unrolled tile (KIND, MR, NR constants).
 * Per group and pair (row of W, row of x): t = q . x over the 32 lanes, acc += d * t (+ m * sum x, q4). */
TARGET static inline __attribute__((always_inline)) void tile(const Job *j, int64_t m0, int64_t n0, const int KIND,
                                                              const int MR, const int NR, const uint8_t *pf_end) {
  const int64_t K = j->K, G = K / GROUP;
  const int gbytes = KIND == 4 ? Q4_BLOCK : 32;
  const uint8_t *codes = j->codes + n0 * G * gbytes;
  const float *x = j->x + m0 * K, *d = KIND == 4 ? NULL : j->d + n0 * G;
  float m[KIND == 4 ? NR * G : 1]; /* q4: the rows' minima as fp32, for the sum(x) term after the groups */
  __m256 acc[NR][MR];
  for (int r = 0; r < NR; r++)
    for (int i = 0; i < MR; i++) acc[r][i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; g++) {
    const float *xg = x + g * GROUP;
    for (int r = 0; r < NR; r++) {
      __m256 q[4];
      const uint8_t *p = codes + (r * G + g) * gbytes;
      const uint8_t *ahead = p + PREFETCH_BYTES;
      _mm_prefetch((const char *)(ahead < pf_end ? ahead : p), _MM_HINT_T0);
      __m256 dg;
      if (KIND == 4) {
        decode_q4(p + 4, q);
        const __m128 dm = scale_min_q4(p);
        dg = _mm256_broadcastss_ps(dm);
        m[r * G + g] = _mm_cvtss_f32(_mm_movehdup_ps(dm));
      } else {
        decode_q8(p, q);
        _mm_prefetch((const char *)(d + PREFETCH_BYTES / 32 + r * G + g), _MM_HINT_T0);
        dg = _mm256_broadcast_ss(d + r * G + g);
      }
      for (int i = 0; i < MR; i++) { /* x from L1: the registers hold the accumulators and the codes */
        const float *xi = xg + i * K;
        __m256 t = _mm256_mul_ps(q[0], _mm256_loadu_ps(xi));
        t = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xi + 8), t);
        t = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xi + 16), t);
        t = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xi + 24), t);
        acc[r][i] = _mm256_fmadd_ps(t, dg, acc[r][i]);
      }
    }
  }
  if (KIND == 4) /* + sum over groups of m * sum(x), eight groups at a time */
    for (int r = 0; r < NR; r++)
      for (int i = 0; i < MR; i++) {
        const float *xs = j->xsum + (m0 + i) * G;
        int64_t g = 0;
        for (; g + 8 <= G; g += 8)
          acc[r][i] = _mm256_fmadd_ps(_mm256_loadu_ps(m + r * G + g), _mm256_loadu_ps(xs + g), acc[r][i]);
        for (; g < G; g++) {
          __m256 one = _mm256_set_ps(0, 0, 0, 0, 0, 0, 0, m[r * G + g] * xs[g]);
          acc[r][i] = _mm256_add_ps(acc[r][i], one);
        }
      }
  float *y = j->y + m0 * j->N + n0;
  for (int r = 0; r < NR; r++)
    for (int i = 0; i < MR; i++) {
      float s = hsum(acc[r][i]);
      y[i * j->N + r] = j->accumulate ? y[i * j->N + r] + s : s;
    }
}

/* The int8-activation tile (kinds 5, 9): x quantized per group of 32 (code * xd), the integer dot of a group
 * with maddubs (unsigned codes times signed ones, pairs summed in int16 without saturation: 2 * 15 * 127 and
 * 2 * 127 * 127 fit), then fp32: acc += (d * xd) * dot, and for q4 + m * sum(x) as in the fp32 tile. */
TARGET static inline __m256i codes_u8_q4(const uint8_t *p) {
  const __m128i mask = _mm_set1_epi8(0x0F);
  __m128i v = _mm_loadu_si128((const __m128i *)p);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), mask), _mm_and_si128(v, mask));
}

TARGET static inline __attribute__((always_inline)) void tile_i8(const Job *j, int64_t m0, int64_t n0, const int KIND,
                                                                 const int MR, const int NR, const uint8_t *pf_end) {
  const int64_t K = j->K, G = K / GROUP;
  const int gbytes = KIND == 5 ? Q4_BLOCK : 32;
  const uint8_t *codes = j->codes + n0 * G * gbytes;
  const int8_t *x = j->xq + m0 * K;
  const float *d = KIND == 5 ? NULL : j->d + n0 * G, *xd = j->xd + m0 * G;
  float m[KIND == 5 ? NR * G : 1];
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[NR][MR];
  for (int r = 0; r < NR; r++)
    for (int i = 0; i < MR; i++) acc[r][i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; g++) {
    for (int r = 0; r < NR; r++) {
      const uint8_t *p = codes + (r * G + g) * gbytes;
      const uint8_t *ahead = p + PREFETCH_BYTES;
      _mm_prefetch((const char *)(ahead < pf_end ? ahead : p), _MM_HINT_T0);
      __m256i w = KIND == 5 ? codes_u8_q4(p + 4) : _mm256_loadu_si256((const __m256i *)p);
      __m256i wa = KIND == 5 ? w : _mm256_sign_epi8(w, w);
      float dg;
      if (KIND == 5) {
        dg = half_at(p);
        m[r * G + g] = half_at(p + 2);
      } else {
        _mm_prefetch((const char *)(d + PREFETCH_BYTES / 32 + r * G + g), _MM_HINT_T0);
        dg = d[r * G + g];
      }
      for (int i = 0; i < MR; i++) {
        __m256i xv = _mm256_loadu_si256((const __m256i *)(x + i * K + g * GROUP));
        if (KIND == 9) xv = _mm256_sign_epi8(xv, w);
        __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(wa, xv), ones);
        acc[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dg * xd[i * G + g]), acc[r][i]);
      }
    }
  }
  float *y = j->y + m0 * j->N + n0;
  for (int r = 0; r < NR; r++)
    for (int i = 0; i < MR; i++) {
      if (KIND == 5) {
        const float *xs = j->xsum + (m0 + i) * G;
        int64_t g = 0;
        for (; g + 8 <= G; g += 8)
          acc[r][i] = _mm256_fmadd_ps(_mm256_loadu_ps(m + r * G + g), _mm256_loadu_ps(xs + g), acc[r][i]);
        for (; g < G; g++)
          acc[r][i] = _mm256_add_ps(acc[r][i], _mm256_set_ps(0, 0, 0, 0, 0, 0, 0, m[r * G + g] * xs[g]));
      }
      float sum = hsum(acc[r][i]);
      y[i * j->N + r] = j->accumulate ? y[i * j->N + r] + sum : sum;
    }
}

/* The start of a chunk's weight rows [n_begin, n_end) prefetched (the tiles prefetch PREFETCH_BYTES ahead of
 * themselves from there on, but not past the chunk: the rows after it are another thread's); returns its end. */
static inline const uint8_t *chunk_prefetch(const Job *j, int64_t n_begin, int64_t n_end, int gbytes) {
  const int64_t row = j->K / GROUP * gbytes;
  const uint8_t *begin = j->codes + n_begin * row, *end = j->codes + n_end * row;
  for (const uint8_t *p = begin; p < end && p < begin + PREFETCH_BYTES; p += 64) _mm_prefetch((const char *)p, _MM_HINT_T0);
  return end;
}

/* Tile shapes: at most 8 accumulators, 4 weight rows in flight when x has 1 or 2 rows, 2 up to 4, else 1; and 8
 * for the fp32 q8 product of one row (the LM head of a one-sequence step: its cheaper decode leaves registers
 * for more rows in flight, measured 10-15% faster; the q4 tile was slower so). A row's sums are the same in
 * any tile shape. */
#define TILES(KIND, MR) \
  TARGET static void rows_##KIND##_##MR(const Job *j, int64_t m0, int64_t n_begin, int64_t n_end) { \
    enum { NR = (KIND) == 8 && (MR) == 1 ? 8 : (MR) <= 2 ? 4 : (MR) <= 4 ? 2 : 1 }; \
    const uint8_t *pf_end = chunk_prefetch(j, n_begin, n_end, (KIND) == 4 || (KIND) == 5 ? Q4_BLOCK : 32); \
    int64_t n = n_begin; \
    for (; n + NR <= n_end; n += NR) tile(j, m0, n, KIND, MR, NR, pf_end); \
    for (; n < n_end; n++) tile(j, m0, n, KIND, MR, 1, pf_end); \
  }
#define TILES_I8(KIND, MR) \
  TARGET static void rows_##KIND##_##MR(const Job *j, int64_t m0, int64_t n_begin, int64_t n_end) { \
    enum { NR = (MR) <= 2 ? 4 : (MR) <= 4 ? 2 : 1 }; \
    const uint8_t *pf_end = chunk_prefetch(j, n_begin, n_end, (KIND) == 4 || (KIND) == 5 ? Q4_BLOCK : 32); \
    int64_t n = n_begin; \
    for (; n + NR <= n_end; n += NR) tile_i8(j, m0, n, KIND, MR, NR, pf_end); \
    for (; n < n_end; n++) tile_i8(j, m0, n, KIND, MR, 1, pf_end); \
  }
#define KIND_TILES_I8(KIND) TILES_I8(KIND, 1) TILES_I8(KIND, 2) TILES_I8(KIND, 3) TILES_I8(KIND, 4) \
  TILES_I8(KIND, 5) TILES_I8(KIND, 6) TILES_I8(KIND, 7) TILES_I8(KIND, 8)
KIND_TILES_I8(5)
KIND_TILES_I8(9)
#define KIND_TILES(KIND) TILES(KIND, 1) TILES(KIND, 2) TILES(KIND, 3) TILES(KIND, 4) TILES(KIND, 5) TILES(KIND, 6) \
  TILES(KIND, 7) TILES(KIND, 8)
KIND_TILES(4)
KIND_TILES(8)

typedef void (*RowsFn)(const Job *, int64_t, int64_t, int64_t);
static const RowsFn rows_q4[MR_MAX] = {rows_4_1, rows_4_2, rows_4_3, rows_4_4, rows_4_5, rows_4_6, rows_4_7, rows_4_8};
static const RowsFn rows_q8[MR_MAX] = {rows_8_1, rows_8_2, rows_8_3, rows_8_4, rows_8_5, rows_8_6, rows_8_7, rows_8_8};
static const RowsFn rows_q4i8[MR_MAX] = {rows_5_1, rows_5_2, rows_5_3, rows_5_4, rows_5_5, rows_5_6, rows_5_7,
                                          rows_5_8};
static const RowsFn rows_q8i8[MR_MAX] = {rows_9_1, rows_9_2, rows_9_3, rows_9_4, rows_9_5, rows_9_6, rows_9_7,
                                          rows_9_8};

/* ------------------------------------------------------------------ the many-row product (prefill)
 *
 * Above GEMM_ROWS rows of x (kind 6) the weight rows are taken four at a time: dequantized into a panel of fp32
 * rows (each value exactly GGUF's), then dotted with x three rows at a time: twelve accumulators of eight
 * lanes along K, summed across their lanes at the end. Each weight is decoded once per call however many rows
 * x has, and the FMAs run at the core's rate (the BLAS reached two thirds of it on these shapes). */
#define GEMM_ROWS 5 /* measured: from 6 rows of x the panel product is the faster, f32 or int8 tiles */
#define PANEL 4
#define TILE_M 3

static _Thread_local float *panel_buf;
static _Thread_local int64_t panel_cap;

TARGET static void dequant_rows(float *out, const uint8_t *blocks, int64_t N, int64_t K);

/* Rows [m0, m0 + mr) of y (mr <= 3) for the panel's weight rows [n0, n0 + nr) (nr <= 4; rows of the panel past
 * nr, and of x past mr, repeat its first and are dropped). */
TARGET static void gemm_tile(const Job *j, const float *panel, int64_t m0, int64_t mr, int64_t n0, int64_t nr) {
  const int64_t K = j->K;
  const float *x0 = j->x + m0 * K, *x1 = mr > 1 ? x0 + K : x0, *x2 = mr > 2 ? x0 + 2 * K : x0;
  const float *w0 = panel, *w1 = nr > 1 ? w0 + K : w0, *w2 = nr > 2 ? w0 + 2 * K : w0, *w3 = nr > 3 ? w0 + 3 * K : w0;
  __m256 c[TILE_M][PANEL];
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c03 = c00, c10 = c00, c11 = c00, c12 = c00, c13 = c00,
         c20 = c00, c21 = c00, c22 = c00, c23 = c00;
  for (int64_t k = 0; k < K; k += 8) {
    const __m256 a0 = _mm256_loadu_ps(x0 + k), a1 = _mm256_loadu_ps(x1 + k), a2 = _mm256_loadu_ps(x2 + k);
    __m256 b = _mm256_loadu_ps(w0 + k);
    c00 = _mm256_fmadd_ps(a0, b, c00), c10 = _mm256_fmadd_ps(a1, b, c10), c20 = _mm256_fmadd_ps(a2, b, c20);
    b = _mm256_loadu_ps(w1 + k);
    c01 = _mm256_fmadd_ps(a0, b, c01), c11 = _mm256_fmadd_ps(a1, b, c11), c21 = _mm256_fmadd_ps(a2, b, c21);
    b = _mm256_loadu_ps(w2 + k);
    c02 = _mm256_fmadd_ps(a0, b, c02), c12 = _mm256_fmadd_ps(a1, b, c12), c22 = _mm256_fmadd_ps(a2, b, c22);
    b = _mm256_loadu_ps(w3 + k);
    c03 = _mm256_fmadd_ps(a0, b, c03), c13 = _mm256_fmadd_ps(a1, b, c13), c23 = _mm256_fmadd_ps(a2, b, c23);
  }
  c[0][0] = c00, c[0][1] = c01, c[0][2] = c02, c[0][3] = c03, c[1][0] = c10, c[1][1] = c11, c[1][2] = c12;
  c[1][3] = c13, c[2][0] = c20, c[2][1] = c21, c[2][2] = c22, c[2][3] = c23;
  for (int64_t i = 0; i < mr; i++) {
    float *y = j->y + (m0 + i) * j->N + n0;
    for (int64_t r = 0; r < nr; r++) y[r] = j->accumulate ? y[r] + hsum(c[i][r]) : hsum(c[i][r]);
  }
}

/* Weight rows [n_begin, n_end) against every row of x. */
static void gemm_rows(const Job *j, int64_t n_begin, int64_t n_end) {
  if (panel_cap < j->K * PANEL) {
    free(panel_buf);
    panel_buf = aligned_alloc(64, sizeof(float) * (size_t)(j->K * PANEL));
    panel_cap = panel_buf == NULL ? 0 : j->K * PANEL;
    if (panel_buf == NULL) abort(); /* a few hundred KB at most: nothing sensible is left to do without it */
  }
  const int64_t G = j->K / GROUP;
  /* x in blocks of rows that stay in L2 (256 KB) while every panel passes them; a panel is dequantized again
   * for each block (a few percent of the block's FMAs) */
  int64_t mblock = (65536 / j->K) / TILE_M * TILE_M;
  if (mblock < TILE_M) mblock = TILE_M;
  for (int64_t mb = 0; mb < j->M; mb += mblock) {
    const int64_t m_end = j->M - mb < mblock ? j->M : mb + mblock;
    for (int64_t n0 = n_begin; n0 < n_end; n0 += PANEL) {
      int64_t nr = n_end - n0 < PANEL ? n_end - n0 : PANEL;
      dequant_rows(panel_buf, j->codes + n0 * G * Q4_BLOCK, nr, j->K);
      for (int64_t m0 = mb; m0 < m_end; m0 += TILE_M)
        gemm_tile(j, panel_buf, m0, m_end - m0 < TILE_M ? m_end - m0 : TILE_M, n0, nr);
    }
  }
}

static _Thread_local int pool_index; /* 0: the caller's thread; a worker's from 1 */

static void run_rows(const Job *j, int64_t n_begin, int64_t n_end) {
  if (j->kind == 7) {
    j->task(j, n_begin, n_end, pool_index);
    return;
  }
  if (j->kind == 6) {
    gemm_rows(j, n_begin, n_end);
    return;
  }
  for (int64_t m0 = 0; m0 < j->M; m0 += MR_MAX) {
    int64_t mr = j->M - m0 < MR_MAX ? j->M - m0 : MR_MAX;
    const RowsFn *fns = j->kind == 4 ? rows_q4 : j->kind == 8 ? rows_q8 : j->kind == 5 ? rows_q4i8 : rows_q8i8;
    fns[mr - 1](j, m0, n_begin, n_end);
  }
}

/* ------------------------------------------------------------------ the worker pool */

/* The pool: the caller publishes a job and takes chunks of its weight rows like any worker; a worker that the
 * OS has descheduled (a busy core) holds the caller up by the chunk it is in, at most: one it has not started
 * when the rows run out is never waited for. `work` packs the job's generation (high half) and its next free
 * row (low half), so a late worker cannot take rows of a job that has ended. Each worker spins a while for
 * the next job (the next linear of a step comes within microseconds), then sleeps on a futex, so an idle
 * engine leaves the core to the frontend. */
#define SPIN_ROUNDS 4000

typedef struct {
  pthread_t tid;
  atomic_int sleeping;
} Worker;

static Worker workers[MAX_THREADS];
static int num_workers = 0; /* started, besides the caller's thread */
static atomic_uint go;      /* the generation of the newest job */
static const Job *_Atomic current;
static atomic_llong current_chunk;
static atomic_ullong work;
static atomic_int busy; /* threads that may be inside a chunk */
static unsigned generation; /* of the caller's jobs, from 1 (0 marks a closed job in `work`) */

static void futex_wait(atomic_uint *addr, unsigned expected) {
  syscall(SYS_futex, addr, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
}

static void futex_wake_all(atomic_uint *addr) {
  syscall(SYS_futex, addr, FUTEX_WAKE_PRIVATE, MAX_THREADS, NULL, NULL, 0);
}

static void take_chunks(unsigned gen, const Job *j, int64_t chunk) {
  for (;;) {
    atomic_fetch_add(&busy, 1);
    unsigned long long w = atomic_load(&work);
    do {
      if ((unsigned)(w >> 32) != gen || (int64_t)(w & 0xFFFFFFFFu) >= j->N) {
        atomic_fetch_sub(&busy, 1);
        return;
      }
    } while (!atomic_compare_exchange_weak(&work, &w, w + (unsigned long long)chunk));
    int64_t b = (int64_t)(w & 0xFFFFFFFFu);
    run_rows(j, b, b + chunk < j->N ? b + chunk : j->N);
    atomic_fetch_sub(&busy, 1);
  }
}

static unsigned wait_for_job(Worker *w, unsigned seen) {
  for (;;) {
    for (int i = 0; i < SPIN_ROUNDS; i++) {
      unsigned g = atomic_load_explicit(&go, memory_order_acquire);
      if (g != seen) return g;
      _mm_pause();
    }
    atomic_store(&w->sleeping, 1);
    if (atomic_load(&go) == seen) futex_wait(&go, seen);
    atomic_store(&w->sleeping, 0);
  }
}

static void *worker_main(void *arg) {
  Worker *w = (Worker *)arg;
  unsigned seen = 0;
  pool_index = 1 + (int)(w - workers);
  for (;;) {
    seen = wait_for_job(w, seen);
    take_chunks(seen, atomic_load(&current), atomic_load(&current_chunk));
  }
  return NULL;
}

static int ensure_workers(int wanted) {
  while (num_workers < wanted) {
    Worker *w = &workers[num_workers];
    atomic_store(&w->sleeping, 0);
    if (pthread_create(&w->tid, NULL, worker_main, w) != 0) return -1;
    pthread_detach(w->tid);
    num_workers++;
  }
  return 0;
}

/* Workers that the OS keeps descheduled (another tenant on the cores) make the caller wait for their chunks a
 * time slice at a time: a job whose caller waited more than a quarter of it for the workers is late, and after
 * LATE_JOBS late jobs in a row the next SOLO_JOBS jobs run on the caller alone (about thirty decode steps of a
 * small model), then the workers are tried again. On a quiet machine no job is late. */
#define LATE_JOBS 8
#define SOLO_JOBS 4096
static int late_streak, solo_left, solo_spells;

static void note_lateness(int64_t start, int64_t waited_from, int64_t end) {
  late_streak = (end - waited_from) * 4 > end - start ? late_streak + 1 : 0;
  if (late_streak >= LATE_JOBS) {
    solo_left = SOLO_JOBS;
    late_streak = 0;
    solo_spells++;
  }
}

static int64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void run_job(const Job *j, int threads) {
  const int big = j->kind == 7 ? j->N > j->chunk : j->N >= 64; /* worth splitting */
  if (threads <= 1 || !big || solo_left > 0) {
    solo_left -= solo_left > 0 && threads > 1 && big;
    run_rows(j, 0, j->N);
    return;
  }
  const int64_t start = now_ns();
  int64_t chunk = (j->N / (8 * threads) + 3) / 4 * 4; /* about 8 chunks per thread, whole tiles of 4 rows */
  if (chunk < 16) chunk = 16;
  if (j->kind == 7) chunk = j->chunk;
  unsigned g = ++generation ? generation : ++generation;
  atomic_store(&current, j);
  atomic_store(&current_chunk, chunk);
  atomic_store(&work, (unsigned long long)g << 32);
  atomic_store(&go, g);
  for (int i = 0; i < threads - 1 && i < num_workers; i++)
    if (atomic_load(&workers[i].sleeping)) {
      futex_wake_all(&go);
      break;
    }
  take_chunks(g, j, chunk);
  /* Close the job before the last wait: a worker arriving later sees generation 0 and never reads *j (which
   * lives in the caller's frame); one already inside a chunk is waited for. */
  atomic_store(&work, 0);
  const int64_t waited_from = now_ns();
  while (atomic_load(&busy) > 0) _mm_pause();
  const int64_t end = now_ns();
  if (j->kind != 7) note_lateness(start, waited_from, end); /* a task of a few items often waits for its last */
}

/* pool_state(): (late jobs in a row, jobs left to run on the caller alone, times it went to the caller alone),
 * for tests and benchmarks. */
static PyObject *pool_state(PyObject *self, PyObject *unused) {
  return Py_BuildValue("(iii)", late_streak, solo_left, solo_spells);
}

/* ------------------------------------------------------------------ Python entry points */

static int parse_ints(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, int64_t *out, const char *name) {
  if (nargs != want) {
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", name, want, nargs);
    return -1;
  }
  for (Py_ssize_t i = 0; i < nargs; i++) {
    out[i] = PyLong_AsLongLong(args[i]);
    if (out[i] == -1 && PyErr_Occurred()) return -1;
  }
  return 0;
}

static int check_shape(int64_t M, int64_t N, int64_t K, int64_t threads) {
  if (M < 1 || N < 1 || K < GROUP || K > MAX_K || K % GROUP || threads < 1 || threads > MAX_THREADS) {
    PyErr_Format(PyExc_ValueError, "bad shape M=%lld N=%lld K=%lld (K a multiple of 32, at most 65536) or "
                 "threads=%lld (1..8)",
                 (long long)M, (long long)N, (long long)K, (long long)threads);
    return -1;
  }
  if (ensure_workers((int)threads - 1) != 0) {
    PyErr_SetString(PyExc_OSError, "cannot start a worker thread");
    return -1;
  }
  return 0;
}

TARGET static void group_sums(const float *x, int64_t M, int64_t K, float *xsum) {
  for (int64_t i = 0; i < M * (K / GROUP); i++) {
    const float *p = x + i * GROUP;
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)),
                             _mm256_add_ps(_mm256_loadu_ps(p + 16), _mm256_loadu_ps(p + 24)));
    xsum[i] = hsum(s);
  }
}

/* x as int8 per group of 32: xd = max|x| / 127, code = round(x / xd) (0 for an all-zero group). */
static int quantize_x(Job *j, int8_t **xq, float **xd) {
  int64_t n = j->M * j->K, G = j->K / GROUP;
  *xq = PyMem_RawMalloc((size_t)n);
  *xd = PyMem_RawMalloc(sizeof(float) * (size_t)(j->M * G));
  if (*xq == NULL || *xd == NULL) {
    PyMem_RawFree(*xq);
    PyMem_RawFree(*xd);
    return -1;
  }
  for (int64_t gi = 0; gi < j->M * G; gi++) {
    const float *p = j->x + gi * GROUP;
    float mx = 0.0f;
    for (int i = 0; i < GROUP; i++) mx = fabsf(p[i]) > mx ? fabsf(p[i]) : mx;
    float scale = mx / 127.0f, inv = mx > 0.0f ? 127.0f / mx : 0.0f;
    (*xd)[gi] = scale;
    for (int i = 0; i < GROUP; i++) (*xq)[gi * GROUP + i] = (int8_t)lrintf(p[i] * inv);
  }
  j->xq = *xq;
  j->xd = *xd;
  return 0;
}

#define STACK_SUMS 4096

/* q4_matmul(y, x, blocks, M, N, K, accumulate, threads, int8_x): pointers as ints (tensor.data_ptr());
 * int8_x: x quantized to int8 per group of 32 first (llama.cpp's arithmetic for Q4_1 weights, not exact). */
/* y (+)= x @ W.T over Q4_1 blocks (shapes checked by the caller): 0, or -1 when out of memory. */
static int q4_product(float *y, const float *x, const uint8_t *blocks, int64_t M, int64_t N, int64_t K,
                      int accumulate, int threads, int int8_x) {
  if (M > GEMM_ROWS) { /* many rows: the panel product, in fp32 whatever int8_x says */
    Job g = {y, x, blocks, NULL, NULL, M, N, K, accumulate, 6, NULL, NULL};
    run_job(&g, threads);
    return 0;
  }
  float stack_sums[STACK_SUMS];
  float *xsum = M * (K / GROUP) <= STACK_SUMS ? stack_sums : PyMem_RawMalloc(sizeof(float) * M * (K / GROUP));
  if (xsum == NULL) return -1;
  int8_t *xq = NULL;
  float *xd = NULL;
  Job j = {y, x, blocks, NULL, xsum, M, N, K, accumulate, int8_x ? 5 : 4, NULL, NULL};
  group_sums(x, M, K, xsum);
  int rc = int8_x ? quantize_x(&j, &xq, &xd) : 0;
  if (rc == 0) run_job(&j, threads); /* the GIL stays held: one caller at a time owns the pool */
  if (xsum != stack_sums) PyMem_RawFree(xsum);
  PyMem_RawFree(xq);
  PyMem_RawFree(xd);
  return rc;
}

static PyObject *q4_matmul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  int64_t a[9];
  if (parse_ints(args, nargs, 9, a, "q4_matmul") || check_shape(a[3], a[4], a[5], a[7])) return NULL;
  if (q4_product((float *)a[0], (const float *)a[1], (const uint8_t *)a[2], a[3], a[4], a[5], (int)a[6], (int)a[7],
                 (int)a[8]) != 0)
    return PyErr_NoMemory();
  Py_RETURN_NONE;
}

/* y (+)= x @ W.T over Q8_0 codes and fp32 scales (shapes checked by the caller): 0, or -1 when out of memory. */
static int q8_product(float *y, const float *x, const uint8_t *codes, const float *d, int64_t M, int64_t N,
                      int64_t K, int accumulate, int threads, int int8_x) {
  int8_t *xq = NULL;
  float *xd = NULL;
  Job j = {y, x, codes, d, NULL, M, N, K, accumulate, int8_x ? 9 : 8, NULL, NULL};
  if (int8_x && quantize_x(&j, &xq, &xd) != 0) return -1;
  run_job(&j, threads);
  PyMem_RawFree(xq);
  PyMem_RawFree(xd);
  return 0;
}

/* q8_matmul(y, x, codes, d, M, N, K, accumulate, threads, int8_x) */
static PyObject *q8_matmul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  int64_t a[10];
  if (parse_ints(args, nargs, 10, a, "q8_matmul") || check_shape(a[4], a[5], a[6], a[8])) return NULL;
  if (q8_product((float *)a[0], (const float *)a[1], (const uint8_t *)a[2], (const float *)a[3], a[4], a[5], a[6],
                 (int)a[7], (int)a[8], (int)a[9]) != 0)
    return PyErr_NoMemory();
  Py_RETURN_NONE;
}

TARGET static void dequant_rows(float *out, const uint8_t *blocks, int64_t N, int64_t K) {
  int64_t G = K / GROUP;
  for (int64_t n = 0; n < N; n++)
    for (int64_t g = 0; g < G; g++) {
      __m256 q[4];
      const uint8_t *p = blocks + (n * G + g) * Q4_BLOCK;
      decode_q4(p + 4, q);
      const __m128 dm = scale_min_q4(p);
      const __m256 dg = _mm256_broadcastss_ps(dm), mg = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
      for (int c = 0; c < 4; c++) _mm256_storeu_ps(out + n * K + g * GROUP + 8 * c, _mm256_fmadd_ps(q[c], dg, mg));
    }
}

/* q4_dequant(out, blocks, N, K): the weight as fp32 [N, K], each value fl(d * q + m) as GGUF's. */
static PyObject *q4_dequant(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  int64_t a[4];
  if (parse_ints(args, nargs, 4, a, "q4_dequant") || check_shape(1, a[2], a[3], 1)) return NULL;
  Py_BEGIN_ALLOW_THREADS
  dequant_rows((float *)a[0], (const uint8_t *)a[1], a[2], a[3]);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

/* q8_dequant(out, blocks, N, K): GGUF Q8_0 blocks (fp16 scale d, 32 int8 codes: 34 bytes) [N, K / 32] as fp32
 * [N, K], each value fl(d * q) as GGUF's (the loader's, for the file's Q8_0 tensors). */
TARGET static void q8_dequant_rows(float *out, const uint8_t *blocks, int64_t N, int64_t K) {
  for (int64_t i = 0; i < N * (K / GROUP); i++) {
    const uint8_t *p = blocks + i * 34;
    __m256 q[4], dg = _mm256_set1_ps(half_at(p));
    decode_q8(p + 2, q);
    for (int c = 0; c < 4; c++) _mm256_storeu_ps(out + i * GROUP + 8 * c, _mm256_mul_ps(q[c], dg));
  }
}

static PyObject *q8_dequant(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  int64_t a[4];
  if (parse_ints(args, nargs, 4, a, "q8_dequant") || check_shape(1, a[2], a[3], 1)) return NULL;
  Py_BEGIN_ALLOW_THREADS
  q8_dequant_rows((float *)a[0], (const uint8_t *)a[1], a[2], a[3]);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ the small ops of a layer, fused */

/* rms_norm(out, x, w, T, N, eps): out = w * (x * (1 / sqrt(mean(x^2) + eps))) per row, fp32. */
static void rms_rows(float *out, const float *x, const float *w, int64_t T, int64_t N, float eps) {
  for (int64_t t = 0; t < T; t++) {
    const float *xr = x + t * N;
    float *o = out + t * N;
    float ss = 0.0f;
    for (int64_t i = 0; i < N; i++) ss += xr[i] * xr[i];
    float r = 1.0f / sqrtf(ss / (float)N + eps);
    for (int64_t i = 0; i < N; i++) o[i] = w[i] * (xr[i] * r);
  }
}

static PyObject *rms_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  int64_t a[5];
  if (nargs != 6 || parse_ints(args, 5, 5, a, "rms_norm")) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "rms_norm takes 6 arguments");
    return NULL;
  }
  double eps = PyFloat_AsDouble(args[5]);
  if (eps == -1.0 && PyErr_Occurred()) return NULL;
  rms_rows((float *)a[0], (const float *)a[1], (const float *)a[2], a[3], a[4], (float)eps);
  Py_RETURN_NONE;
}

/* rope_write_kv(qkv, cos, sin, k_cache, v_cache, slots, T, H, Hkv, D, row):
 * rotates the q and k heads of each packed row of qkv [T, row] in place (half-split pairs, cos/sin [T, D])
 * and stores the rotated k and the v heads at their cache slots as fp16 (round to nearest even). */
TARGET static void rope_rows(float *qkv, const float *cos, const float *sin, uint16_t *kc, uint16_t *vc,
                             const int64_t *slots, int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t row) {
  const int64_t half = D / 2;
  for (int64_t t = 0; t < T; t++) {
    float *r = qkv + t * row;
    const float *c = cos + t * D, *s = sin + t * D;
    for (int64_t h = 0; h < H + Hkv; h++) {
      float *x = r + h * D;
      for (int64_t i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        float lo = a * c[i] - b * s[i];
        float hi = b * c[i + half] + a * s[i + half];
        x[i] = lo;
        x[i + half] = hi;
      }
    }
    uint16_t *kd = kc + slots[t] * Hkv * D, *vd = vc + slots[t] * Hkv * D;
    const float *k = r + H * D, *v = r + (H + Hkv) * D;
    for (int64_t i = 0; i < Hkv * D; i += 8) {
      _mm_storeu_si128((__m128i *)(kd + i), _mm256_cvtps_ph(_mm256_loadu_ps(k + i), _MM_FROUND_TO_NEAREST_INT));
      _mm_storeu_si128((__m128i *)(vd + i), _mm256_cvtps_ph(_mm256_loadu_ps(v + i), _MM_FROUND_TO_NEAREST_INT));
    }
  }
}

static PyObject *rope_write_kv(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  int64_t a[11];
  if (parse_ints(args, nargs, 11, a, "rope_write_kv")) return NULL;
  if (a[9] % 16 || a[9] < 16) {
    PyErr_SetString(PyExc_ValueError, "rope_write_kv: head_dim must be a multiple of 16");
    return NULL;
  }
  rope_rows((float *)a[0], (const float *)a[1], (const float *)a[2], (uint16_t *)a[3], (uint16_t *)a[4],
            (const int64_t *)a[5], a[6], a[7], a[8], a[9], a[10]);
  Py_RETURN_NONE;
}

TARGET static inline __m256 load_ph(const uint16_t *p) {
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* out[0, 8 * n) = sum over p of probs[p] * v_p[0, 8 * n) (fp32, p ascending, from 0), n <= 8 accumulators of eight
 * lanes held in registers across the positions. */
TARGET static inline __attribute__((always_inline)) void weigh_values(float *out, const float *probs,
                                                                      const uint16_t *vc, const int32_t *table,
                                                                      int64_t start, int64_t ctx, int64_t bs,
                                                                      int64_t row, const int n) {
  __m256 acc[8];
  for (int c = 0; c < n; c++) acc[c] = _mm256_setzero_ps();
  for (int64_t p = start; p < ctx;) { /* a block's positions at a time: one division per block */
    const int64_t off = p % bs, here = bs - off < ctx - p ? bs - off : ctx - p;
    const uint16_t *v = vc + ((int64_t)table[p / bs] * bs + off) * row;
    for (int64_t e = 0; e < here; e++, p++, v += row) {
      const __m256 w = _mm256_set1_ps(probs[p - start]);
      for (int c = 0; c < n; c++) acc[c] = _mm256_fmadd_ps(w, load_ph(v + 8 * c), acc[c]);
    }
  }
  for (int c = 0; c < n; c++) _mm256_storeu_ps(out + 8 * c, acc[c]);
}

/* scores[0, n) = (q . k_e) * scale for the n cache rows k_e = k + e * row (D a multiple of 8). */
TARGET static inline __attribute__((always_inline)) void score_rows(float *scores, const float *q, const uint16_t *k,
                                                                    int64_t n, int64_t row, const int64_t D,
                                                                    float scale) {
  for (int64_t e = 0; e < n; e++, k += row) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < D; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load_ph(k + i), acc);
    scores[e] = hsum(acc) * scale;
  }
}

/* One query head's decode attention over cache positions [start, ctx) of its KV head (k, v: the caches at that
 * head's offset, positions `row` apart): scores (fp32 dot, one eight-lane accumulator summed across its lanes,
 * times scale), softmax (the maximum subtracted, expf, the sum in position order), then the weighted values.
 * The positions are walked a cache block at a time. */
TARGET static void attend_head(float *out, const float *q, const uint16_t *kc, const uint16_t *vc,
                               const int32_t *table, int64_t start, int64_t ctx, int64_t D, int64_t bs, int64_t row,
                               float scale, float *scores) {
  const int64_t L = ctx - start;
  for (int64_t p = start; p < ctx;) {
    const int64_t off = p % bs, here = bs - off < ctx - p ? bs - off : ctx - p;
    const uint16_t *k = kc + ((int64_t)table[p / bs] * bs + off) * row;
    if (D == 64) /* the common head size, its loop unrolled */
      score_rows(scores + (p - start), q, k, here, row, 64, scale);
    else
      score_rows(scores + (p - start), q, k, here, row, D, scale);
    p += here;
  }
  float mx = -INFINITY, sum = 0.0f;
  for (int64_t i = 0; i < L; i++) mx = scores[i] > mx ? scores[i] : mx;
  for (int64_t i = 0; i < L; i++) {
    scores[i] = expf(scores[i] - mx);
    sum += scores[i];
  }
  const float inv = 1.0f / sum;
  for (int64_t i = 0; i < L; i++) scores[i] *= inv;
  int64_t i = 0;
  for (; i + 64 <= D; i += 64) weigh_values(out + i, scores, vc + i, table, start, ctx, bs, row, 8);
  for (; i < D; i += 8) weigh_values(out + i, scores, vc + i, table, start, ctx, bs, row, 1);
}

typedef struct {
  float *out;
  const float *q;
  const uint16_t *kc, *vc;
  const int32_t *tables, *ctx_lens;
  int64_t H, Hkv, D, bs, width, q_row, window, longest;
  float scale;
  float *scores; /* [pool threads, longest]: each thread's own row */
} AttendArgs;

/* Query heads [begin, end) of the step (item b * H + h: sequence b's head h), as a pool task. */
static void attend_task(const Job *j, int64_t begin, int64_t end, int worker) {
  const AttendArgs *a = (const AttendArgs *)j->args;
  const int64_t G = a->H / a->Hkv, row = a->Hkv * a->D;
  for (int64_t t = begin; t < end; t++) {
    const int64_t b = t / a->H, h = t % a->H, hk = h / G, ctx = a->ctx_lens[b];
    const int64_t start = a->window > 0 && ctx > a->window ? ctx - a->window : 0;
    attend_head(a->out + b * a->H * a->D + h * a->D, a->q + b * a->q_row + h * a->D, a->kc + hk * a->D,
                a->vc + hk * a->D, a->tables + b * a->width, start, ctx, a->D, a->bs, row, a->scale,
                a->scores + worker * a->longest);
  }
}

/* Every sequence's decode attention (see attend_decode), its query heads split over `threads` of the pool (each
 * head's arithmetic is the same on any thread): 0, or -1 when out of memory. */
static int attend_rows(float *out, const float *q, const uint16_t *kc, const uint16_t *vc, const int32_t *tables,
                       const int32_t *ctx_lens, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t bs,
                       int64_t width, int64_t q_row, int64_t window, float scale, int threads) {
  int64_t longest = 1;
  for (int64_t b = 0; b < B; b++) longest = ctx_lens[b] > longest ? ctx_lens[b] : longest;
  AttendArgs a = {out, q, kc, vc, tables, ctx_lens, H, Hkv, D, bs, width, q_row, window, longest, scale, NULL};
  a.scores = PyMem_RawMalloc(sizeof(float) * (size_t)(longest * (num_workers + 1))); /* any started worker helps */
  if (a.scores == NULL) return -1;
  Job j = {.N = B * H, .kind = 7, .task = attend_task, .args = &a, .chunk = 1};
  run_job(&j, threads);
  PyMem_RawFree(a.scores);
  return 0;
}

/* attend_decode(out, q, k_cache, v_cache, tables, ctx_lens, B, H, Hkv, D, block_size, width, q_row, window, scale):
 * one query per sequence (at position ctx - 1) over its cached keys (the last `window` with window > 0);
 * q rows of q_row floats (the heads first), out [B, H * D]; the fp16 cache [blocks, block_size, Hkv, D]. */
static PyObject *attend_decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  int64_t a[14];
  if (nargs != 15 || parse_ints(args, 14, 14, a, "attend_decode")) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "attend_decode takes 15 arguments");
    return NULL;
  }
  double scale = PyFloat_AsDouble(args[14]);
  if (scale == -1.0 && PyErr_Occurred()) return NULL;
  int64_t H = a[7], Hkv = a[8], D = a[9], bs = a[10];
  if (D % 8 || H % Hkv || bs < 1) {
    PyErr_SetString(PyExc_ValueError, "attend_decode: head_dim a multiple of 8 and heads a multiple of KV heads");
    return NULL;
  }
  if (attend_rows((float *)a[0], (const float *)a[1], (const uint16_t *)a[2], (const uint16_t *)a[3],
                  (const int32_t *)a[4], (const int32_t *)a[5], a[6], H, Hkv, D, bs, a[11], a[12], a[13],
                  (float)scale, 1) != 0)
    return PyErr_NoMemory();
  Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ a decode step's whole layer stack */

/* silu(gate) * up per row of gu [B, 2I] ([gate | up]) into out [B, I]: silu(g) = g / (1 + exp(-g)) rounded to
 * fp32, then the product, as torch's silu and mul compute them (exp within an ulp of torch's). */
static void silu_mul_task(const Job *j, int64_t begin, int64_t end, int worker) {
  const int64_t I = j->K; /* items: b * I + i */
  for (int64_t t = begin; t < end; t++) {
    const int64_t b = t / I, i = t % I;
    float g = j->x[b * 2 * I + i], act = g / (1.0f + expf(-g));
    j->y[t] = act * j->x[b * 2 * I + I + i];
  }
}

/* The same over `threads` of the pool (a few hundred items at a time: expf is the cost). */
static void silu_mul_rows(float *out, const float *gu, int64_t B, int64_t I, int threads) {
  Job j = {.y = out, .x = gu, .N = B * I, .K = I, .kind = 7, .task = silu_mul_task, .chunk = 256};
  run_job(&j, threads);
}

enum { P_ATTN_NORM, P_QKV, P_O, P_MLP_NORM, P_GATE_UP, P_DOWN, P_K_CACHE, P_V_CACHE, P_FIELDS };

typedef struct {
  int64_t L, B, H, I, heads, kv_heads, D, width, block_size, window, threads, int8_x;
  float eps, scale;
} StackShape;

/* The layers of a decode step, each: x += o(attend(rope(qkv(norm(x))))), x += down(silu_mul(gate_up(norm(x)))),
 * over the plan's pointers (a layer's row of P_FIELDS). 0, or -1 when out of memory. */
static int run_stack(float *x, const int64_t *plan, const StackShape *s, const float *cos, const float *sin,
                     const int64_t *slots, const int32_t *tables, const int32_t *ctx_lens) {
  const int64_t B = s->B, H = s->H, I = s->I, D = s->D, row = (s->heads + 2 * s->kv_heads) * D;
  float *h = PyMem_RawMalloc(sizeof(float) * B * (H + row + s->heads * D + 3 * I));
  if (h == NULL) return -1;
  float *qkv = h + B * H, *att = qkv + B * row, *gu = att + B * s->heads * D, *act = gu + B * 2 * I;
  /* each product or attention that fails (out of memory) ends the stack at once: nothing after it runs, so
   * no K or V row computed from a half-made step reaches the cache */
  int rc = 0;
  for (int64_t l = 0; l < s->L; l++) {
    const int64_t *p = plan + l * P_FIELDS;
    uint16_t *kc = (uint16_t *)p[P_K_CACHE], *vc = (uint16_t *)p[P_V_CACHE];
    rms_rows(h, x, (const float *)p[P_ATTN_NORM], B, H, s->eps);
    if ((rc = q4_product(qkv, h, (const uint8_t *)p[P_QKV], B, row, H, 0, (int)s->threads, (int)s->int8_x))) break;
    rope_rows(qkv, cos, sin, kc, vc, slots, B, s->heads, s->kv_heads, D, row);
    if ((rc = attend_rows(att, qkv, kc, vc, tables, ctx_lens, B, s->heads, s->kv_heads, D, s->block_size, s->width,
                          row, s->window, s->scale, (int)s->threads)))
      break;
    if ((rc = q4_product(x, att, (const uint8_t *)p[P_O], B, H, s->heads * D, 1, (int)s->threads, (int)s->int8_x)))
      break;
    rms_rows(h, x, (const float *)p[P_MLP_NORM], B, H, s->eps);
    if ((rc = q4_product(gu, h, (const uint8_t *)p[P_GATE_UP], B, 2 * I, H, 0, (int)s->threads, (int)s->int8_x)))
      break;
    silu_mul_rows(act, gu, B, I, (int)s->threads);
    if ((rc = q4_product(x, act, (const uint8_t *)p[P_DOWN], B, H, I, 1, (int)s->threads, (int)s->int8_x))) break;
  }
  PyMem_RawFree(h);
  return rc;
}

/* decode_stack(x, plan, L, B, H, I, heads, kv_heads, D, cos, sin, slots, tables, ctx_lens, width, block_size,
 *              window, threads, int8_x, eps, scale): x [B, H] float32 (the residual stream, updated in place),
 * plan int64 [L, 8] of pointers (attn norm, qkv, o, mlp norm, gate_up, down: Q4_1 blocks and fp32 norms; the
 * layer's fp16 K and V caches), cos/sin [B, D], slots int64 [B], tables int32 [B, width], ctx_lens int32 [B]. */
static PyObject *decode_stack(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  int64_t a[19];
  if (nargs != 21 || parse_ints(args, 19, 19, a, "decode_stack")) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "decode_stack takes 21 arguments");
    return NULL;
  }
  double eps = PyFloat_AsDouble(args[19]), scale = PyFloat_AsDouble(args[20]);
  if (PyErr_Occurred()) return NULL;
  StackShape s = {a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[14], a[15], a[16], a[17], a[18], (float)eps,
                  (float)scale};
  int64_t row = (s.heads + 2 * s.kv_heads) * s.D;
  if (s.L < 1 || s.D % 16 || s.D < 16 || s.kv_heads < 1 || s.heads % s.kv_heads || s.block_size < 1 ||
      check_shape(s.B, row, s.H, s.threads) || check_shape(s.B, s.H, s.heads * s.D, s.threads) ||
      check_shape(s.B, 2 * s.I, s.H, s.threads) || check_shape(s.B, s.H, s.I, s.threads)) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "decode_stack: bad shape");
    return NULL;
  }
  if (run_stack((float *)a[0], (const int64_t *)a[1], &s, (const float *)a[9], (const float *)a[10],
                (const int64_t *)a[11], (const int32_t *)a[12], (const int32_t *)a[13]) != 0)
    return PyErr_NoMemory();
  Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ the token table's rows */

/* embed_rows(out, ids, T, codes, scales, V, H): out [T, H] float32 = codes[id] * scales[id] per group of 32 (the
 * int8 code as fp32 times its group's fp32 scale: one rounding, GroupInt8Embedding's arithmetic), ids int64 [T];
 * False (nothing written) where an id is outside [0, V). */
TARGET static PyObject *embed_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  int64_t a[7];
  if (parse_ints(args, nargs, 7, a, "embed_rows")) return NULL;
  const int64_t *ids = (const int64_t *)a[1];
  const int64_t T = a[2], V = a[5], H = a[6];
  if (H % GROUP || H < GROUP) {
    PyErr_SetString(PyExc_ValueError, "embed_rows: the hidden size must be a multiple of 32");
    return NULL;
  }
  for (int64_t t = 0; t < T; t++)
    if (ids[t] < 0 || ids[t] >= V) Py_RETURN_FALSE;
  float *out = (float *)a[0];
  const int8_t *codes = (const int8_t *)a[3];
  const float *scales = (const float *)a[4];
  for (int64_t t = 0; t < T; t++) {
    const int8_t *c = codes + ids[t] * H;
    const float *sc = scales + ids[t] * (H / GROUP);
    for (int64_t i = 0; i < H; i += 8) {
      const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(c + i))));
      _mm256_storeu_ps(out + t * H + i, _mm256_mul_ps(q, _mm256_broadcast_ss(sc + i / GROUP)));
    }
  }
  Py_RETURN_TRUE;
}

/* ------------------------------------------------------------------ a greedy step's head */

/* The index of the largest of v[0, n), the lowest where several are equal; the first NaN where there is one
 * (torch.argmax's answer: a NaN is the maximum). */
TARGET static int64_t argmax_row(const float *v, int64_t n) {
  __m256 mx = _mm256_set1_ps(-INFINITY), unord = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 a = _mm256_loadu_ps(v + i);
    mx = _mm256_max_ps(mx, a);
    unord = _mm256_or_ps(unord, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  }
  float lanes[8], best = -INFINITY;
  _mm256_storeu_ps(lanes, mx);
  for (int l = 0; l < 8; l++) best = lanes[l] > best ? lanes[l] : best;
  int nan = _mm256_movemask_ps(unord) != 0;
  for (; i < n; i++) {
    nan |= v[i] != v[i];
    best = v[i] > best ? v[i] : best;
  }
  for (i = 0; i < n; i++)
    if (nan ? v[i] != v[i] : v[i] == best) return i;
  return 0;
}

/* greedy_head(tokens, x, rows, R, norm, codes, scales, V, H, eps, threads, int8_x, logits): for each of R rows of
 * x [*, H] (rows: int64 [R] of their indices, or 0 for rows 0 .. R-1), the final RMSNorm (rms_rows), the tied
 * Q8_0 head's logits over [V, H] codes and [V, H / 32] scales (the q8 product Q8Head makes, into the float32
 * scratch `logits` [R, V]), and their argmax into tokens int64 [R]: a greedy step's tail, the same arithmetic
 * as norm, q8_matmul and torch.argmax one after another. */
static PyObject *greedy_head(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  int64_t a[12];
  if (nargs != 13 || parse_ints(args, 9, 9, a, "greedy_head") || parse_ints(args + 10, 3, 3, a + 9, "greedy_head")) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "greedy_head takes 13 arguments");
    return NULL;
  }
  double eps = PyFloat_AsDouble(args[9]);
  if (eps == -1.0 && PyErr_Occurred()) return NULL;
  const int64_t R = a[3], V = a[7], H = a[8];
  if (check_shape(R, V, H, a[9])) return NULL;
  int64_t *tokens = (int64_t *)a[0];
  const float *x = (const float *)a[1];
  const int64_t *rows = (const int64_t *)a[2];
  float *logits = (float *)a[11];
  float *h = PyMem_RawMalloc(sizeof(float) * (size_t)(R * H));
  if (h == NULL) return PyErr_NoMemory();
  for (int64_t r = 0; r < R; r++)
    rms_rows(h + r * H, x + (rows ? rows[r] : r) * H, (const float *)a[4], 1, H, (float)eps);
  int rc = q8_product(logits, h, (const uint8_t *)a[5], (const float *)a[6], R, V, H, 0, (int)a[9], (int)a[10]);
  PyMem_RawFree(h);
  if (rc != 0) return PyErr_NoMemory();
  for (int64_t r = 0; r < R; r++) tokens[r] = argmax_row(logits + r * V, V);
  Py_RETURN_NONE;
}

static PyObject *available(PyObject *self, PyObject *unused) {
  __builtin_cpu_init();
  return PyBool_FromLong(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c"));
}

static PyMethodDef methods[] = {
    {"q4_matmul", (PyCFunction)(void (*)(void))q4_matmul, METH_FASTCALL,
     "q4_matmul(y, x, blocks, M, N, K, accumulate, threads, int8_x): y (+)= x @ W.T, W in Q4_1 blocks"},
    {"q8_matmul", (PyCFunction)(void (*)(void))q8_matmul, METH_FASTCALL,
     "q8_matmul(y, x, codes, d, M, N, K, accumulate, threads, int8_x): y (+)= x @ W.T, W in Q8_0 groups"},
    {"q4_dequant", (PyCFunction)(void (*)(void))q4_dequant, METH_FASTCALL,
     "q4_dequant(out, blocks, N, K): the Q4_1 weight as fp32 [N, K]"},
    {"q8_dequant", (PyCFunction)(void (*)(void))q8_dequant, METH_FASTCALL,
     "q8_dequant(out, blocks, N, K): GGUF Q8_0 blocks as fp32 [N, K]"},
    {"rms_norm", (PyCFunction)(void (*)(void))rms_norm, METH_FASTCALL,
     "rms_norm(out, x, w, T, N, eps): out = w * (x / sqrt(mean(x^2) + eps)) per row"},
    {"rope_write_kv", (PyCFunction)(void (*)(void))rope_write_kv, METH_FASTCALL,
     "rope_write_kv(qkv, cos, sin, k_cache, v_cache, slots, T, H, Hkv, D, row): RoPE in place, K/V to the cache"},
    {"attend_decode", (PyCFunction)(void (*)(void))attend_decode, METH_FASTCALL,
     "attend_decode(out, q, k_cache, v_cache, tables, ctx_lens, B, H, Hkv, D, block_size, width, q_row, window, "
     "scale)"},
    {"decode_stack", (PyCFunction)(void (*)(void))decode_stack, METH_FASTCALL,
     "decode_stack(x, plan, L, B, H, I, heads, kv_heads, D, cos, sin, slots, tables, ctx_lens, width, block_size, "
     "window, threads, int8_x, eps, scale): a decode step's layers, x updated in place"},
    {"embed_rows", (PyCFunction)(void (*)(void))embed_rows, METH_FASTCALL,
     "embed_rows(out, ids, T, codes, scales, V, H): the int8 table's rows as float32; False for an id out of range"},
    {"greedy_head", (PyCFunction)(void (*)(void))greedy_head, METH_FASTCALL,
     "greedy_head(tokens, x, rows, R, norm, codes, scales, V, H, eps, threads, int8_x, logits): final norm, tied "
     "Q8_0 head and argmax of a greedy step's rows"},
    {"pool_state", pool_state, METH_NOARGS, "pool_state(): (late jobs in a row, jobs left on the caller alone, spells on the caller alone)"},
    {"available", available, METH_NOARGS, "whether this CPU runs these kernels (AVX2, FMA, F16C)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_quant", "Quantized-weight CPU matmuls.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__cpu_quant(void) {
  PyObject *mod = PyModule_Create(&module);
  if (mod != NULL && PyModule_AddIntConstant(mod, "GEMM_ROWS", GEMM_ROWS) != 0) Py_CLEAR(mod);
  return mod;
}
