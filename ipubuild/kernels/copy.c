/* copy.c -- strided byte copy of rows.
 *
 * args = [src, dst, rows, row_bytes, src_stride, dst_stride]
 *   row r: memmove(dst + r*dst_stride, src + r*src_stride, row_bytes).
 */
#include "ipu_kernel.h"

IPU_VERTEX
{
    const uint32_t src = args[0], dst = args[1], rows = args[2];
    const uint32_t row_bytes = args[3], src_stride = args[4], dst_stride = args[5];

    IPU_REQUIRE_BUFFER(src, rows ? (uint64_t)(rows - 1) * src_stride + row_bytes : 0, 1, "src rows");
    IPU_REQUIRE_BUFFER(dst, rows ? (uint64_t)(rows - 1) * dst_stride + row_bytes : 0, 1, "dst rows");
    for (uint32_t r = 0; r < rows; r++)
        memmove(mem + dst + r * dst_stride, mem + src + r * src_stride, row_bytes);
    return 0;
}
