/* square.c -- y[i] = x[i] * x[i], f32 (the throw-away test plugin).  args = [x, y, n] */
#include <stdint.h>
#include <string.h>

#define IPU_VERTEX __attribute__((visibility("default"))) \
    int ipu_vertex(uint8_t *mem, const uint32_t *args)
IPU_VERTEX;

IPU_VERTEX
{
    const uint8_t *x = mem + args[0];
    uint8_t *y = mem + args[1];
    for (uint32_t i = 0; i < args[2]; i++) {
        float v;
        memcpy(&v, x + 4u * i, 4);
        v = v * v;
        memcpy(y + 4u * i, &v, 4);
    }
    return 0;
}
