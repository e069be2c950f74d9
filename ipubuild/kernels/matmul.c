/* matmul.c -- C[m,n] (f32) = (A[m,k] . B) * 2^-(a_scale_exp + b_scale_exp) (+ bias)
 *
 * Compile with -DA_TYPE=<code> -DB_TYPE=<code> (IPU_F32/F16/F143/F152).
 * args = [a, b, c, m, k, n, flags, a_scale_exp, b_scale_exp, bias]
 *   B is [k,n] row-major, or [n,k] when flags&1 (its transpose is used).
 *   flags&2: accumulate, c = c + (scaled + bias); otherwise c = scaled + bias.
 *   bias != 0: address of f32 bias[n], added once per row after scaling.
 * Each dot product accumulates in f32 over k in index order.
 * Returns 1 for unknown flag bits.
 *
 * With -DFP8_OUT (a cast folded into the product): args gain [.., out_type, out_scale_exp]
 * and c is FP8 of out_type (IPU_F143/IPU_F152): c = encode(scaled + bias, out_type,
 * out_scale_exp), bit-exact with the f32 product followed by cast.c.  flags&2 (accumulate)
 * or another out_type returns 1.
 */
#include "ipu_kernel.h"

#if !defined(A_TYPE) || !defined(B_TYPE)
#error "matmul.c needs -DA_TYPE=<code> -DB_TYPE=<code>"
#endif
#if !IPU_VALID_TYPE(A_TYPE) || !IPU_VALID_TYPE(B_TYPE)
#error "matmul.c: unknown A_TYPE/B_TYPE"
#endif

#define MM_TRANS_B 1u
#define MM_ACCUMULATE 2u

IPU_VERTEX
{
    const uint8_t *a = mem + args[0], *b = mem + args[1];
    uint8_t *c = mem + args[2];
    const uint32_t m = args[3], k = args[4], n = args[5], flags = args[6];
    const int32_t scale = -((int32_t)args[7] + (int32_t)args[8]);
    const uint8_t *bias = args[9] ? mem + args[9] : 0;

    if (flags & ~(MM_TRANS_B | MM_ACCUMULATE))
        return 1;
#ifdef FP8_OUT
    const int out_type = (int)args[10];
    const int32_t out_scale = (int32_t)args[11];
    if ((flags & MM_ACCUMULATE) || !IPU_IS_FP8(out_type))
        return 1;
#endif
    for (uint32_t i = 0; i < m; i++) {
        for (uint32_t j = 0; j < n; j++) {
            float acc = 0.0f;
            for (uint32_t p = 0; p < k; p++) {
                uint32_t bi = (flags & MM_TRANS_B) ? j * k + p : p * n + j;
                acc += ipu_load_elem(a, i * k + p, A_TYPE) * ipu_load_elem(b, bi, B_TYPE);
            }
            float r = ldexpf(acc, scale);
            if (bias)
                r += ipu_ld_f32(bias + 4u * j);
#ifdef FP8_OUT
            c[i * n + j] = ipu_fp8_encode(r, out_type, out_scale);
#else
            uint8_t *cp = c + 4u * (i * n + j);
            if (flags & MM_ACCUMULATE)
                r = ipu_ld_f32(cp) + r;
            ipu_st_f32(cp, r);
#endif
        }
    }
    return 0;
}
