/* gelu.c -- f32 GELU, tanh approximation.
 *
 * args = [x, y, n]
 *   y = 0.5*x*(1 + tanhf(0.7978845608f*(x + 0.044715f*x*x*x))); y may alias x.
 */
#include "ipu_kernel.h"

IPU_VERTEX
{
    const uint8_t *x = mem + args[0];
    uint8_t *y = mem + args[1];
    const uint32_t n = args[2];

    for (uint32_t i = 0; i < n; i++) {
        float v = ipu_ld_f32(x + 4u * i);
        float g = 0.5f * v * (1.0f + tanhf(0.7978845608f * (v + 0.044715f * v * v * v)));
        ipu_st_f32(y + 4u * i, g);
    }
    return 0;
}
