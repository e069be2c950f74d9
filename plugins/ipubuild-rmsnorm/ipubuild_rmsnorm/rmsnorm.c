/* rmsnorm.c -- f32 RMS normalisation over the last axis (ipubuild-rmsnorm plugin).
 *
 * args = [x, gamma, y, rows, cols, eps_bits]
 *   per row: ms = sum(x[j]^2) / cols (f32, sequential, in index order),
 *   y[j] = x[j] / sqrtf(ms + eps) * gamma[j].
 * Addresses are byte offsets from mem.  y may alias x.
 * Returns IPU_BAD_ARGS (1) if cols == 0, else 0.  The checked build (-DIPU_CHECKED=1, the one
 * ipubuild compiles and the device runs) also refuses a buffer outside the tile's data memory (3)
 * or misaligned (4), before touching memory, and says why (ipu_trap_reason).
 */
#include "ipu_kernel.h"     /* installed with ipubuild: the ABI, IPU_FAIL, IPU_REQUIRE_BUFFER */

IPU_VERTEX
{
    const uint8_t *x = mem + args[0], *gamma = mem + args[1];
    uint8_t *y = mem + args[2];
    const uint32_t rows = args[3], cols = args[4];
    const float eps = ipu_f32_from_bits(args[5]);

    if (cols == 0)
        IPU_FAIL(IPU_BAD_ARGS, "cols is 0");
    IPU_REQUIRE_BUFFER(args[0], 4ull * rows * cols, 4, "x[rows*cols]");
    IPU_REQUIRE_BUFFER(args[1], 4ull * cols, 4, "gamma[cols]");
    IPU_REQUIRE_BUFFER(args[2], 4ull * rows * cols, 4, "y[rows*cols]");
    for (uint32_t r = 0; r < rows; r++) {
        const uint8_t *xr = x + 4u * (r * cols);
        uint8_t *yr = y + 4u * (r * cols);
        float sq = 0.0f;
        for (uint32_t j = 0; j < cols; j++) {
            float v = ipu_ld_f32(xr + 4u * j);
            sq += v * v;
        }
        const float denom = sqrtf(sq / (float)cols + eps);
        for (uint32_t j = 0; j < cols; j++)
            ipu_st_f32(yr + 4u * j, ipu_ld_f32(xr + 4u * j) / denom * ipu_ld_f32(gamma + 4u * j));
    }
    return 0;
}
