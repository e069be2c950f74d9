/* matmul.c -- C[m,n] (f32) = (A[m,k] . B) * 2^-(a_scale_exp + b_scale_exp) (+ bias)
 *
 * Compile with -DA_TYPE=<code> -DB_TYPE=<code> (IPU_F32/F16/F143/F152).
 * args = [a, b, c, m, k, n, flags, a_scale_exp, b_scale_exp, bias]
 *   B is [k,n] row-major, or [n,k] when flags&1 (its transpose is used).
 *   flags&2: accumulate, c = c + (scaled + bias); otherwise c = scaled + bias.
 *   flags&4: an addend, args = [.., bias, addend]: c = addend + (scaled + bias), addend the
 *   address of f32 addend[m,n] (a residual add folded into the product: bit-exact with
 *   the product followed by add.c). Not with flags&2.
 *   bias != 0: address of f32 bias[n], added once per row after scaling.
 * Each dot product accumulates in f32 over k in index order.
 * Returns 1 for unknown flag bits, 2 if the scratch memory cannot be allocated.
 *
 * With -DFP8_OUT (a cast folded into the product): args gain [.., out_type, out_scale_exp]
 * and c is FP8 of out_type (IPU_F143/IPU_F152): c = encode(scaled + bias, out_type,
 * out_scale_exp), bit-exact with the f32 product followed by cast.c.  flags&2 (accumulate),
 * flags&4 (addend) or another out_type returns 1.
 *
 * With -DGELU (a GELU folded into the product, before any cast): c = ipu_gelu(scaled + bias),
 * as gelu.c computes it (bit-exact with the product followed by gelu.c); flags&2 and
 * flags&4 return 1.
 *
 * How: A and B are decoded once into f32 scratch (host heap, never tile memory):
 * A as [m,k] rows, B as panels of MM_NR columns ([k][MM_NR] each, so the inner
 * loop reads it contiguously; columns past n are zero, computed and never
 * stored). Blocks of 4, 2 or 1 rows by MM_NR columns keep their accumulators in
 * vector registers: per step of k one product and one add per element, in index
 * order -- the same operations in the same order as one scalar loop per dot
 * product, so the results are those of that loop, bit for bit.
 */
#include <stdlib.h>

#include "ipu_kernel.h"

#if !defined(A_TYPE) || !defined(B_TYPE)
#error "matmul.c needs -DA_TYPE=<code> -DB_TYPE=<code>"
#endif
#if !IPU_VALID_TYPE(A_TYPE) || !IPU_VALID_TYPE(B_TYPE)
#error "matmul.c: unknown A_TYPE/B_TYPE"
#endif

#define MM_TRANS_B 1u
#define MM_ACCUMULATE 2u
#define MM_ADDEND 4u
#define MM_NR 8u /* columns of a block: two vectors */


/* acc<r><v> += a<r>[p] * b<v> for one step of k (a broadcast, b four columns). */
#define MM_STEP(r) do { \
        const float s_ = a##r[p]; \
        const ipu_f32x4 av_ = {s_, s_, s_, s_}; \
        acc##r##0 = acc##r##0 + av_ * b0; \
        acc##r##1 = acc##r##1 + av_ * b1; \
    } while (0)
#define MM_ZERO(r) ipu_f32x4 acc##r##0 = {0}, acc##r##1 = {0}
#define MM_SAVE(r) do { \
        memcpy(out[r], &acc##r##0, sizeof acc##r##0); \
        memcpy(out[r] + 4, &acc##r##1, sizeof acc##r##1); \
    } while (0)

/* The dot products of 1, 2 or 4 rows of A (rows a0.. of ad, k apart) with the MM_NR columns of
 * one B panel, into out[row][column]. */
static inline void mm_block4(const float *a0, const float *panel, size_t k, float out[][MM_NR])
{
    const float *a1 = a0 + k, *a2 = a1 + k, *a3 = a2 + k;
    MM_ZERO(0); MM_ZERO(1); MM_ZERO(2); MM_ZERO(3);
    for (size_t p = 0; p < k; p++) {
        ipu_f32x4 b0, b1;
        memcpy(&b0, panel + p * MM_NR, sizeof b0);
        memcpy(&b1, panel + p * MM_NR + 4, sizeof b1);
        MM_STEP(0); MM_STEP(1); MM_STEP(2); MM_STEP(3);
    }
    MM_SAVE(0); MM_SAVE(1); MM_SAVE(2); MM_SAVE(3);
}

static inline void mm_block2(const float *a0, const float *panel, size_t k, float out[][MM_NR])
{
    const float *a1 = a0 + k;
    MM_ZERO(0); MM_ZERO(1);
    for (size_t p = 0; p < k; p++) {
        ipu_f32x4 b0, b1;
        memcpy(&b0, panel + p * MM_NR, sizeof b0);
        memcpy(&b1, panel + p * MM_NR + 4, sizeof b1);
        MM_STEP(0); MM_STEP(1);
    }
    MM_SAVE(0); MM_SAVE(1);
}

static inline void mm_block1(const float *a0, const float *panel, size_t k, float out[][MM_NR])
{
    MM_ZERO(0);
    for (size_t p = 0; p < k; p++) {
        ipu_f32x4 b0, b1;
        memcpy(&b0, panel + p * MM_NR, sizeof b0);
        memcpy(&b1, panel + p * MM_NR + 4, sizeof b1);
        MM_STEP(0);
    }
    MM_SAVE(0);
}

IPU_VERTEX
{
    const uint8_t *a = mem + args[0], *b = mem + args[1];
    uint8_t *c = mem + args[2];
    const uint32_t m = args[3], k = args[4], n = args[5], flags = args[6];
    const int32_t scale = -((int32_t)args[7] + (int32_t)args[8]);
    const uint8_t *bias = args[9] ? mem + args[9] : 0;

    if (flags & ~(MM_TRANS_B | MM_ACCUMULATE | MM_ADDEND))
        IPU_FAIL(IPU_BAD_ARGS, "unknown flag bits");
#ifdef GELU
    if (flags & (MM_ACCUMULATE | MM_ADDEND))
        IPU_FAIL(IPU_BAD_ARGS, "accumulate or addend with a GELU folded in");
#endif
#ifdef FP8_OUT
    const int out_type = (int)args[10];
    const int32_t out_scale = (int32_t)args[11];
    if ((flags & (MM_ACCUMULATE | MM_ADDEND)) || !IPU_IS_FP8(out_type))
        IPU_FAIL(IPU_BAD_ARGS, "accumulating or adding into FP8, or out_type is not an FP8 type");
    IPU_REQUIRE_BUFFER(args[2], (uint64_t)m * n, 1, "c[m*n]");
#else
    if ((flags & MM_ACCUMULATE) && (flags & MM_ADDEND))
        IPU_FAIL(IPU_BAD_ARGS, "both accumulate and addend");
    const uint8_t *addend = (flags & MM_ADDEND) ? mem + args[10] : 0;
    IPU_REQUIRE_BUFFER(args[2], 4ull * m * n, 4, "c[m*n]");
    if (addend)
        IPU_REQUIRE_BUFFER(args[10], 4ull * m * n, 4, "addend[m*n]");
#endif
    IPU_REQUIRE_BUFFER(args[0], (uint64_t)m * k * IPU_TYPE_SIZE(A_TYPE), IPU_TYPE_SIZE(A_TYPE), "a[m*k]");
    IPU_REQUIRE_BUFFER(args[1], (uint64_t)k * n * IPU_TYPE_SIZE(B_TYPE), IPU_TYPE_SIZE(B_TYPE), "b[k*n]");
    if (bias)
        IPU_REQUIRE_BUFFER(args[9], 4ull * n, 4, "bias[n]");
    if (m == 0 || n == 0)
        return 0;
    const size_t np = ((size_t)n + MM_NR - 1) / MM_NR * MM_NR;
    float *ad = malloc(sizeof(float) * ((size_t)m + np) * k + 1);
    if (!ad)
        IPU_FAIL(IPU_NO_SCRATCH, "cannot allocate its f32 scratch");
    float *bp = ad + (size_t)m * k;

    ipu_decoder da, db_table;
    ipu_decoder_init(&da, A_TYPE);
    const ipu_decoder *db = &da;
    if (B_TYPE != A_TYPE) {
        ipu_decoder_init(&db_table, B_TYPE);
        db = &db_table;
    }
    for (size_t i = 0; i < (size_t)m * k; i++)
        ad[i] = ipu_decode(&da, a, i);
    /* B as panels: element (p, j) at bp[(j / MM_NR) * k * MM_NR + p * MM_NR + j % MM_NR],
     * columns past n zero; read in B's own order */
    const size_t full = n / MM_NR * MM_NR;
    memset(bp + full * k, 0, sizeof(float) * (np - full) * k);
    if (flags & MM_TRANS_B) {
        for (size_t j = 0; j < n; j++) {
            float *col = bp + j / MM_NR * MM_NR * k + j % MM_NR;
            for (size_t p = 0; p < k; p++)
                col[p * MM_NR] = ipu_decode(db, b, j * k + p);
        }
    } else {
        for (size_t p = 0; p < k; p++) {
            float *row = bp + p * MM_NR;
            size_t j = 0;
            for (; j < full; j += MM_NR) {
                float *dst = row + j * k;
                for (size_t t = 0; t < MM_NR; t++)
                    dst[t] = ipu_decode(db, b, p * n + j + t);
            }
            for (; j < n; j++)
                row[full * k + j - full] = ipu_decode(db, b, p * n + j);
        }
    }

    /* 2^scale as a float when it is one: then v * pow2 rounds exactly as ldexpf(v, scale) */
    const int exact = scale >= -126 && scale <= 127;
    const float pow2 = exact ? ipu_f32_from_bits((uint32_t)(scale + 127) << 23) : 0.0f;
    for (size_t j0 = 0; j0 < np; j0 += MM_NR) {
        const float *panel = bp + j0 * k;
        for (size_t i0 = 0; i0 < m;) {
            float out[4][MM_NR];
            size_t rows = m - i0 >= 4 ? 4 : m - i0 >= 2 ? 2 : 1;
            if (rows == 4)
                mm_block4(ad + i0 * k, panel, k, out);
            else if (rows == 2)
                mm_block2(ad + i0 * k, panel, k, out);
            else
                mm_block1(ad + i0 * k, panel, k, out);
            for (size_t r = 0; r < rows; r++) {
                for (size_t jj = 0; jj < MM_NR && j0 + jj < n; jj++) {
                    const size_t j = j0 + jj;
                    float v = exact ? out[r][jj] * pow2 : ldexpf(out[r][jj], scale);
                    if (bias)
                        v += ipu_ld_f32(bias + 4u * j);
#ifdef GELU
                    v = ipu_gelu(v);
#endif
#ifdef FP8_OUT
                    c[(i0 + r) * n + j] = ipu_fp8_encode(v, out_type, out_scale);
#else
                    uint8_t *cp = c + 4u * ((i0 + r) * n + j);
                    if (flags & MM_ACCUMULATE)
                        v = ipu_ld_f32(cp) + v;
                    else if (addend)
                        v = ipu_ld_f32(addend + 4u * ((i0 + r) * n + j)) + v;
                    ipu_st_f32(cp, v);
#endif
                }
            }
            i0 += rows;
        }
    }
    free(ad);
    return 0;
}
