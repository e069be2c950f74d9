/* rmsnorm.c -- f32 RMS normalisation over the last axis (ipubuild-rmsnorm plugin).
 *
 * args = [x, gamma, y, rows, cols, eps_bits]
 *   per row: ms = sum(x[j]^2) / cols (f32, sequential, in index order),
 *   y[j] = x[j] / sqrtf(ms + eps) * gamma[j].
 * Addresses are byte offsets from mem; data may be unaligned.  y may alias x.
 * Returns 1 if cols == 0, else 0.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* The ipubuild kernel ABI (copied from ipubuild/kernels/ipu_kernel.h): one exported symbol. */
#define IPU_VERTEX __attribute__((visibility("default"))) \
    int ipu_vertex(uint8_t *mem, const uint32_t *args)
IPU_VERTEX;

static inline float f32_from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline float ld_f32(const uint8_t *p) { float f; memcpy(&f, p, 4); return f; }
static inline void st_f32(uint8_t *p, float f) { memcpy(p, &f, 4); }

IPU_VERTEX
{
    const uint8_t *x = mem + args[0], *gamma = mem + args[1];
    uint8_t *y = mem + args[2];
    const uint32_t rows = args[3], cols = args[4];
    const float eps = f32_from_bits(args[5]);

    if (cols == 0)
        return 1;
    for (uint32_t r = 0; r < rows; r++) {
        const uint8_t *xr = x + 4u * (r * cols);
        uint8_t *yr = y + 4u * (r * cols);
        float sq = 0.0f;
        for (uint32_t j = 0; j < cols; j++) {
            float v = ld_f32(xr + 4u * j);
            sq += v * v;
        }
        const float denom = sqrtf(sq / (float)cols + eps);
        for (uint32_t j = 0; j < cols; j++)
            st_f32(yr + 4u * j, ld_f32(xr + 4u * j) / denom * ld_f32(gamma + 4u * j));
    }
    return 0;
}
