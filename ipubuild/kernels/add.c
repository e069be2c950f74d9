/* add.c -- f32 broadcast add.
 *
 * args = [a, b, c, rows, cols, b_rows]
 *   c[r,j] = a[r,j] + b[(b_rows == 1 ? 0 : r), j]; c may alias a.
 * Returns 1 unless b_rows is 1 or rows.
 */
#include "ipu_kernel.h"

IPU_VERTEX
{
    const uint8_t *a = mem + args[0], *b = mem + args[1];
    uint8_t *c = mem + args[2];
    const uint32_t rows = args[3], cols = args[4], b_rows = args[5];

    if (b_rows != 1 && b_rows != rows)
        IPU_FAIL(IPU_BAD_ARGS, "b_rows is neither 1 nor rows");
    IPU_REQUIRE_BUFFER(args[0], 4ull * rows * cols, 4, "a[rows*cols]");
    IPU_REQUIRE_BUFFER(args[1], 4ull * b_rows * cols, 4, "b[b_rows*cols]");
    IPU_REQUIRE_BUFFER(args[2], 4ull * rows * cols, 4, "c[rows*cols]");
    for (uint32_t r = 0; r < rows; r++) {
        const uint32_t br = (b_rows == 1) ? 0 : r;
        for (uint32_t j = 0; j < cols; j++) {
            float v = ipu_ld_f32(a + 4u * (r * cols + j)) + ipu_ld_f32(b + 4u * (br * cols + j));
            ipu_st_f32(c + 4u * (r * cols + j), v);
        }
    }
    return 0;
}
