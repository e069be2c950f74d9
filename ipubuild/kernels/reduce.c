/* reduce.c -- f32 element-wise sum of `count` arrays.
 *
 * args = [dst, n, count, src_0, ..., src_{count-1}]
 *   dst[i] = ((src_0[i] + src_1[i]) + ...) in order; dst may alias any src.
 * Returns 1 if count == 0.
 *
 * With -DFP8_OUT (a cast folded into the sum): args = [dst, n, count, out_type,
 * out_scale_exp, src_0, ...] and dst[i] = encode(sum, out_type, out_scale_exp) (FP8 codes),
 * bit-exact with the f32 sum followed by cast.c; another out_type returns 1.
 *
 * With -DGELU (a GELU folded into the sum, before any cast): dst[i] = ipu_gelu(sum), as
 * gelu.c computes it, bit-exact with the sum followed by gelu.c.
 */
#include "ipu_kernel.h"

IPU_VERTEX
{
    uint8_t *dst = mem + args[0];
    const uint32_t n = args[1], count = args[2];
#ifdef FP8_OUT
    const int out_type = (int)args[3];
    const int32_t out_scale = (int32_t)args[4];
    const uint32_t *srcs = args + 5;
    if (!IPU_IS_FP8(out_type))
        IPU_FAIL(IPU_BAD_ARGS, "out_type is not an FP8 type");
    IPU_REQUIRE_BUFFER(args[0], n, 1, "dst[n]");
#else
    const uint32_t *srcs = args + 3;
    IPU_REQUIRE_BUFFER(args[0], 4ull * n, 4, "dst[n]");
#endif

    if (count == 0)
        IPU_FAIL(IPU_BAD_ARGS, "count is 0");
#ifdef IPU_CHECKED
    for (uint32_t s = 0; s < count; s++)
        IPU_REQUIRE_BUFFER(srcs[s], 4ull * n, 4, "a src[n]");
#endif
    for (uint32_t i = 0; i < n; i++) {
        float acc = ipu_ld_f32(mem + srcs[0] + 4u * i);
        for (uint32_t s = 1; s < count; s++)
            acc += ipu_ld_f32(mem + srcs[s] + 4u * i);
#ifdef GELU
        acc = ipu_gelu(acc);
#endif
#ifdef FP8_OUT
        dst[i] = ipu_fp8_encode(acc, out_type, out_scale);
#else
        ipu_st_f32(dst + 4u * i, acc);
#endif
    }
    return 0;
}
