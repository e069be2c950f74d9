/* softmax.c -- f32 row-wise softmax.
 *
 * args = [x, y, rows, cols, scale_bits]
 *   per row: z = scale * x; y = expf(z - max(z)) / sum(expf(z - max(z))),
 *   sum accumulated in index order.  y may alias x.  Returns 1 if cols == 0.
 *
 * With -DFP8_OUT (a cast folded into the softmax): args = [x, y, rows, cols, scale_bits,
 * out_type, out_scale_exp, e] and y is FP8 of out_type: y = encode(e / sum, out_type,
 * out_scale_exp), bit-exact with the f32 result followed by cast.c; e is f32 scratch of
 * rows*cols (the exponentials, which y cannot hold), and may alias x; another out_type
 * returns 1.
 */
#include "ipu_kernel.h"

IPU_VERTEX
{
    const uint8_t *x = mem + args[0];
    uint8_t *y = mem + args[1];
    const uint32_t rows = args[2], cols = args[3];
    const float scale = ipu_f32_from_bits(args[4]);

    if (cols == 0)
        IPU_FAIL(IPU_BAD_ARGS, "cols is 0");
    IPU_REQUIRE_BUFFER(args[0], 4ull * rows * cols, 4, "x[rows*cols]");
#ifdef FP8_OUT
    const int out_type = (int)args[5];
    const int32_t out_scale = (int32_t)args[6];
    if (!IPU_IS_FP8(out_type))
        IPU_FAIL(IPU_BAD_ARGS, "out_type is not an FP8 type");
    IPU_REQUIRE_BUFFER(args[1], (uint64_t)rows * cols, 1, "y[rows*cols]");
    IPU_REQUIRE_BUFFER(args[7], 4ull * rows * cols, 4, "e[rows*cols]");
    uint8_t *scratch = mem + args[7];
#else
    IPU_REQUIRE_BUFFER(args[1], 4ull * rows * cols, 4, "y[rows*cols]");
#endif
    for (uint32_t r = 0; r < rows; r++) {
        const uint8_t *xr = x + 4u * (r * cols);
        float mx = scale * ipu_ld_f32(xr);
        for (uint32_t j = 1; j < cols; j++) {
            float z = scale * ipu_ld_f32(xr + 4u * j);
            if (z > mx)
                mx = z;
        }
        float sum = 0.0f;
#ifdef FP8_OUT
        uint8_t *er = scratch + 4u * (r * cols);
#else
        uint8_t *er = y + 4u * (r * cols);
#endif
        for (uint32_t j = 0; j < cols; j++) {
            float e = expf(scale * ipu_ld_f32(xr + 4u * j) - mx);
            ipu_st_f32(er + 4u * j, e);
            sum += e;
        }
        for (uint32_t j = 0; j < cols; j++) {
#ifdef FP8_OUT
            y[r * cols + j] = ipu_fp8_encode(ipu_ld_f32(er + 4u * j) / sum, out_type, out_scale);
#else
            ipu_st_f32(er + 4u * j, ipu_ld_f32(er + 4u * j) / sum);
#endif
        }
    }
    return 0;
}
