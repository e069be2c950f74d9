/* block_counter.c -- counts the basic blocks a kernel executes (see ipubuild/kernel_profile.py).
 *
 * Compiled into a kernel's counted variant with -fsanitize-coverage=trace-pc: the compiler calls
 * __sanitizer_cov_trace_pc at the start of every basic block it emits, and this file counts
 * those calls. The count of a vertex call depends only on the compiled code and the data it
 * reads, so it is the same on every run. Nothing here is instrumented itself.
 *
 * Exported: int ipu_counted_vertex(uint8_t *mem, const uint32_t *args, uint64_t *blocks)
 *   runs ipu_vertex(mem, args), stores the blocks it executed in *blocks, returns its result;
 *   not reentrant: call it from one thread at a time (the measurement loads a copy of the object
 *   for each lane of vertices, and runs a lane as one task at a time).
 */
#include <stdint.h>

#if defined(__clang__)
#define IPU_NOT_COUNTED __attribute__((no_sanitize("coverage")))
#else
#define IPU_NOT_COUNTED __attribute__((no_sanitize_coverage))
#endif

int ipu_vertex(uint8_t *mem, const uint32_t *args);

/* A plain static, not thread-local: a thread-local in a shared object costs a __tls_get_addr
 * call per block (twice the measurement's time). Each lane of the measurement runs its own
 * copy of the object, one vertex at a time. */
static uint64_t ipu_blocks;

IPU_NOT_COUNTED __attribute__((visibility("hidden"))) void __sanitizer_cov_trace_pc(void)
{
    ipu_blocks++;
}

IPU_NOT_COUNTED __attribute__((visibility("default")))
int ipu_counted_vertex(uint8_t *mem, const uint32_t *args, uint64_t *blocks)
{
    ipu_blocks = 0;
    int rc = ipu_vertex(mem, args);
    *blocks = ipu_blocks;
    return rc;
}
