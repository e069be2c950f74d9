/* softmax.c -- f32 row-wise softmax.
 *
 * args = [x, y, rows, cols, scale_bits]
 *   per row: z = scale * x; y = expf(z - max(z)) / sum(expf(z - max(z))),
 *   sum accumulated in index order.  y may alias x.  Returns 1 if cols == 0.
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
    IPU_REQUIRE_BUFFER(args[1], 4ull * rows * cols, 4, "y[rows*cols]");
    for (uint32_t r = 0; r < rows; r++) {
        const uint8_t *xr = x + 4u * (r * cols);
        uint8_t *yr = y + 4u * (r * cols);
        float mx = scale * ipu_ld_f32(xr);
        for (uint32_t j = 1; j < cols; j++) {
            float z = scale * ipu_ld_f32(xr + 4u * j);
            if (z > mx)
                mx = z;
        }
        float sum = 0.0f;
        for (uint32_t j = 0; j < cols; j++) {
            float e = expf(scale * ipu_ld_f32(xr + 4u * j) - mx);
            ipu_st_f32(yr + 4u * j, e);
            sum += e;
        }
        for (uint32_t j = 0; j < cols; j++)
            ipu_st_f32(yr + 4u * j, ipu_ld_f32(yr + 4u * j) / sum);
    }
    return 0;
}
