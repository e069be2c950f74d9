/* gelu.c -- f32 GELU, tanh approximation.
 *
 * args = [x, y, n]
 *   y = 0.5*x*(1 + tanhf(0.7978845608f*(x + 0.044715f*x*x*x))) (ipu_gelu); y may alias x.
 *
 * With -DFP8_OUT (a cast folded into the activation): args = [x, y, n, out_type,
 * out_scale_exp] and y is FP8 of out_type: y = encode(gelu, out_type, out_scale_exp),
 * bit-exact with the f32 result followed by cast.c; another out_type returns 1.
 */
#include "ipu_kernel.h"

IPU_VERTEX
{
    const uint8_t *x = mem + args[0];
    uint8_t *y = mem + args[1];
    const uint32_t n = args[2];
#ifdef FP8_OUT
    const int out_type = (int)args[3];
    const int32_t out_scale = (int32_t)args[4];
    if (!IPU_IS_FP8(out_type))
        IPU_FAIL(IPU_BAD_ARGS, "out_type is not an FP8 type");
    IPU_REQUIRE_BUFFER(args[1], n, 1, "y[n]");
#else
    IPU_REQUIRE_BUFFER(args[1], 4ull * n, 4, "y[n]");
#endif
    IPU_REQUIRE_BUFFER(args[0], 4ull * n, 4, "x[n]");

    for (uint32_t i = 0; i < n; i++) {
        float v = ipu_ld_f32(x + 4u * i);
        float g = ipu_gelu(v);
#ifdef FP8_OUT
        y[i] = ipu_fp8_encode(g, out_type, out_scale);
#else
        ipu_st_f32(y + 4u * i, g);
#endif
    }
    return 0;
}
