/* layernorm.c -- f32 layer normalisation over the last axis.
 *
 * args = [x, gamma, beta, y, rows, cols, eps_bits]
 *   per row: mean, population variance (two-pass),
 *   y = (x - mean) / sqrtf(var + eps) * gamma[j] + beta[j].
 * y may alias x.  Returns 1 if cols == 0.
 *
 * With -DFP8_OUT (a cast folded into the normalisation): args gain [.., out_type,
 * out_scale_exp] and y is FP8 of out_type: y = encode(value, out_type, out_scale_exp),
 * bit-exact with the f32 result followed by cast.c; another out_type returns 1.
 */
#include "ipu_kernel.h"

IPU_VERTEX
{
    const uint8_t *x = mem + args[0], *gamma = mem + args[1], *beta = mem + args[2];
    uint8_t *y = mem + args[3];
    const uint32_t rows = args[4], cols = args[5];
    const float eps = ipu_f32_from_bits(args[6]);

    if (cols == 0)
        IPU_FAIL(IPU_BAD_ARGS, "cols is 0");
#ifdef FP8_OUT
    const int out_type = (int)args[7];
    const int32_t out_scale = (int32_t)args[8];
    if (!IPU_IS_FP8(out_type))
        IPU_FAIL(IPU_BAD_ARGS, "out_type is not an FP8 type");
    IPU_REQUIRE_BUFFER(args[3], (uint64_t)rows * cols, 1, "y[rows*cols]");
#else
    IPU_REQUIRE_BUFFER(args[3], 4ull * rows * cols, 4, "y[rows*cols]");
#endif
    IPU_REQUIRE_BUFFER(args[0], 4ull * rows * cols, 4, "x[rows*cols]");
    IPU_REQUIRE_BUFFER(args[1], 4ull * cols, 4, "gamma[cols]");
    IPU_REQUIRE_BUFFER(args[2], 4ull * cols, 4, "beta[cols]");
    for (uint32_t r = 0; r < rows; r++) {
        const uint8_t *xr = x + 4u * (r * cols);
#ifdef FP8_OUT
        uint8_t *yr = y + r * cols;
#else
        uint8_t *yr = y + 4u * (r * cols);
#endif
        float sum = 0.0f;
        for (uint32_t j = 0; j < cols; j++)
            sum += ipu_ld_f32(xr + 4u * j);
        const float mean = sum / (float)cols;
        float sq = 0.0f;
        for (uint32_t j = 0; j < cols; j++) {
            float d = ipu_ld_f32(xr + 4u * j) - mean;
            sq += d * d;
        }
        const float denom = sqrtf(sq / (float)cols + eps);
        for (uint32_t j = 0; j < cols; j++) {
            float v = (ipu_ld_f32(xr + 4u * j) - mean) / denom;
            v = v * ipu_ld_f32(gamma + 4u * j) + ipu_ld_f32(beta + 4u * j);
#ifdef FP8_OUT
            yr[j] = ipu_fp8_encode(v, out_type, out_scale);
#else
            ipu_st_f32(yr + 4u * j, v);
#endif
        }
    }
    return 0;
}
