/* cast.c -- element-wise type conversion.
 *
 * Compile with -DSRC_TYPE=<code> -DDST_TYPE=<code>.
 * args = [src, dst, n, scale_exp]
 *   to fp8:   dst = saturating_cast(src * 2^scale_exp)  (NaN -> 0x80)
 *   from fp8: dst = decode(src) * 2^-scale_exp
 *   f16 <-> f32 conversions ignore the scale (round to nearest even).
 *
 * With -DROWS (a cast folded into a copy of rows, e.g. patchify):
 * args = [src, dst, rows, cols, scale_exp, src_stride, dst_stride]: row r converts cols
 * elements from src + r*src_stride to dst + r*dst_stride (strides in bytes), each as above.
 */
#include "ipu_kernel.h"

#if !defined(SRC_TYPE) || !defined(DST_TYPE)
#error "cast.c needs -DSRC_TYPE=<code> -DDST_TYPE=<code>"
#endif
#if !IPU_VALID_TYPE(SRC_TYPE) || !IPU_VALID_TYPE(DST_TYPE)
#error "cast.c: unknown SRC_TYPE/DST_TYPE"
#endif

static void convert(const uint8_t *src, uint8_t *dst, uint32_t n, int32_t scale)
{
    /* fp8 sources: the 256 decoded values, each computed as ipu_fp8_decode does */
    float table[IPU_IS_FP8(SRC_TYPE) ? 256 : 1];
    if (IPU_IS_FP8(SRC_TYPE))
        for (unsigned code = 0; code < 256u; code++)
            table[code] = ipu_fp8_decode((uint8_t)code, SRC_TYPE, scale);

    for (uint32_t i = 0; i < n; i++) {
        float v;
        if (IPU_IS_FP8(SRC_TYPE))
            v = table[src[i]];
        else
            v = ipu_load_elem(src, i, SRC_TYPE);

        if (DST_TYPE == IPU_F32)
            ipu_st_f32(dst + 4u * i, v);
        else if (DST_TYPE == IPU_F16)
            ipu_st_u16(dst + 2u * i, ipu_float_to_f16(v));
        else
            dst[i] = ipu_fp8_encode(v, DST_TYPE, scale);
    }
}

IPU_VERTEX
{
    const uint8_t *src = mem + args[0];
    uint8_t *dst = mem + args[1];
#ifdef ROWS
    const uint32_t rows = args[2], cols = args[3];
    const int32_t scale = (int32_t)args[4];
    for (uint32_t r = 0; r < rows; r++)
        convert(src + r * args[5], dst + r * args[6], cols, scale);
#else
    convert(src, dst, args[2], (int32_t)args[3]);
#endif
    return 0;
}
