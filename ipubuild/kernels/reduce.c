/* reduce.c -- f32 element-wise sum of `count` arrays.
 *
 * args = [dst, n, count, src_0, ..., src_{count-1}]
 *   dst[i] = ((src_0[i] + src_1[i]) + ...) in order; dst may alias any src.
 * Returns 1 if count == 0.
 */
#include "ipu_kernel.h"

IPU_VERTEX
{
    uint8_t *dst = mem + args[0];
    const uint32_t n = args[1], count = args[2];
    const uint32_t *srcs = args + 3;

    if (count == 0)
        return 1;
    for (uint32_t i = 0; i < n; i++) {
        float acc = ipu_ld_f32(mem + srcs[0] + 4u * i);
        for (uint32_t s = 1; s < count; s++)
            acc += ipu_ld_f32(mem + srcs[s] + 4u * i);
        ipu_st_f32(dst + 4u * i, acc);
    }
    return 0;
}
