/* ipu_kernel.h -- shared header for ipubuild tile kernels.
 *
 * Every kernel .so exports exactly one entry point (see IPU_VERTEX):
 *     int ipu_vertex(uint8_t *mem, const uint32_t *args);
 * All addresses in args are byte offsets from mem.  Floats in args are IEEE
 * bit patterns, scale exponents int32 two's complement.
 *
 * FP8 formats (Graphcore): F143 == float8_e4m3fnuz (bias 8, max 240),
 * F152 == float8_e5m2fnuz (bias 16, max 57344); NaN is code 0x80, no -0.
 * Casts to FP8 saturate (clip to +-max, NaN -> 0x80) then round to nearest
 * even; bit-exact with ipubuild/fp8.py.
 */
#ifndef IPU_KERNEL_H
#define IPU_KERNEL_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define IPU_F32 0
#define IPU_F16 1
#define IPU_F143 2
#define IPU_F152 3

#define IPU_IS_FP8(t) ((t) == IPU_F143 || (t) == IPU_F152)
#define IPU_VALID_TYPE(t) ((t) == IPU_F32 || (t) == IPU_F16 || IPU_IS_FP8(t))
#define IPU_TYPE_SIZE(t) ((t) == IPU_F32 ? 4u : (t) == IPU_F16 ? 2u : 1u)

#define IPU_EXPORT __attribute__((visibility("default")))

/* The single exported entry point of every kernel. */
#define IPU_VERTEX IPU_EXPORT int ipu_vertex(uint8_t *mem, const uint32_t *args)
IPU_VERTEX;

/* ---- preconditions and the checked build -------------------------------
 *
 * A vertex refuses arguments it cannot honour: IPU_FAIL(code, why) returns
 * code (1: invalid arguments, 2: no scratch memory, 3: a buffer outside the
 * tile's data memory, 4: a misaligned buffer) before it reads or writes tile
 * memory. IPU_REQUIRE_BUFFER checks one buffer: only in the checked build.
 *
 * The checked build (-DIPU_CHECKED=1; ipubuild compiles every variant so and
 * the ipumodel simulator runs it) also checks, before touching memory, that
 * every buffer a vertex reads or writes lies inside the tile's data memory
 * and is aligned to its element size, and it records why a vertex failed:
 * ipu_trap_reason() returns that text once (then NULL). The device sets two
 * globals when it loads the object: ipu_tile_bytes, the size of a tile's
 * memory, and ipu_tile_map, the address in each tile's memory of its data
 * map (u32 count, then count [lo, hi) address ranges: where the tile's data
 * may live; 0: no map, every address below ipu_tile_bytes is data). While
 * ipu_tile_bytes is 0 every buffer check fails. */
#define IPU_BAD_ARGS 1
#define IPU_NO_SCRATCH 2
#define IPU_OUT_OF_BOUNDS 3
#define IPU_MISALIGNED 4

#ifdef IPU_CHECKED
IPU_EXPORT uint32_t ipu_tile_bytes = 0;
IPU_EXPORT uint32_t ipu_tile_map = 0;
static _Thread_local const char *ipu_why;

IPU_EXPORT const char *ipu_trap_reason(void)
{
    const char *why = ipu_why;
    ipu_why = 0;
    return why;
}

static inline int ipu_fail(int code, const char *why)
{
    ipu_why = why;
    return code;
}

/* Whether [addr, addr + bytes) lies in one range of the tile's data map. */
static inline int ipu_in_data(const uint8_t *mem, uint64_t addr, uint64_t bytes)
{
    if (bytes > ipu_tile_bytes || addr > ipu_tile_bytes - bytes)
        return 0;
    if (ipu_tile_map == 0)
        return 1;
    uint32_t n, lo, hi;
    memcpy(&n, mem + ipu_tile_map, 4);
    for (uint32_t i = 0; i < n && i < 64u; i++) {
        memcpy(&lo, mem + ipu_tile_map + 4u + 8u * i, 4);
        memcpy(&hi, mem + ipu_tile_map + 8u + 8u * i, 4);
        if (lo <= addr && addr + bytes <= hi)
            return 1;
    }
    return 0;
}

#define IPU_FAIL(code, why) return ipu_fail((code), (why))
/* Buffer `what` of `bytes` bytes at tile address `addr` (a u32 argument),
 * aligned to `align` bytes; an empty buffer is never touched. */
#define IPU_REQUIRE_BUFFER(addr, bytes, align, what) do { \
        const uint64_t b_ = (bytes); \
        if (b_ && !ipu_in_data(mem, (addr), b_)) \
            IPU_FAIL(IPU_OUT_OF_BOUNDS, what " lies outside the tile's data memory"); \
        if (b_ && (addr) % (align)) \
            IPU_FAIL(IPU_MISALIGNED, what " is not aligned to its element size"); \
    } while (0)
#else
#define IPU_FAIL(code, why) return (code)
#define IPU_REQUIRE_BUFFER(addr, bytes, align, what) ((void)0)
#endif

/* ---- raw loads / stores (unaligned-safe) ------------------------------- */

static inline float ipu_f32_from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t ipu_bits_from_f32(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline float ipu_ld_f32(const uint8_t *p) { float f; memcpy(&f, p, 4); return f; }

/* The GELU (tanh approximation) every kernel that applies one computes, the same operations in
 * the same order: gelu.c, and matmul.c / reduce.c with -DGELU (a GELU folded in) */
static inline float ipu_gelu(float v)
{
    return 0.5f * v * (1.0f + tanhf(0.7978845608f * (v + 0.044715f * v * v * v)));
}
static inline void ipu_st_f32(uint8_t *p, float f) { memcpy(p, &f, 4); }
static inline uint16_t ipu_ld_u16(const uint8_t *p) { uint16_t u; memcpy(&u, p, 2); return u; }
static inline void ipu_st_u16(uint8_t *p, uint16_t u) { memcpy(p, &u, 2); }

/* ---- F16 <-> float ------------------------------------------------------ */

static inline float ipu_f16_to_float(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0x1f)
        return ipu_f32_from_bits(sign | 0x7f800000u | (m << 13));
    if (e == 0) {
        float v = (float)m * 0x1p-24f; /* exact */
        return sign ? -v : v;
    }
    return ipu_f32_from_bits(sign | ((e + 112u) << 23) | (m << 13));
}

/* Round sig >> shift to nearest even (shift in 1..63). */
static inline uint64_t ipu_rne_shift(uint64_t sig, unsigned shift)
{
    uint64_t r = sig >> shift;
    uint64_t rem = sig & ((1ull << shift) - 1u);
    uint64_t half = 1ull << (shift - 1);
    if (rem > half || (rem == half && (r & 1u)))
        r++;
    return r;
}

static inline uint16_t ipu_float_to_f16(float f)
{
    uint32_t u = ipu_bits_from_f32(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) /* NaN: quiet, keep top payload bits */
        return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x47800000u) /* >= 65536 (or inf) */
        return (uint16_t)(sign | 0x7c00u);
    if (a >= 0x38800000u) /* f16 normal range: rebias, round; carry may give inf */
        return (uint16_t)(sign | ipu_rne_shift(a - (112u << 23), 13));
    /* f16 subnormal: quantum 2^-24 */
    uint32_t e = a >> 23;
    if (e == 0)
        return sign; /* f32 subnormal, far below 2^-25 */
    unsigned shift = 126u - e; /* value = sig * 2^(e-150) */
    if (shift >= 25u)
        return sign;
    return (uint16_t)(sign | ipu_rne_shift((a & 0x7fffffu) | 0x800000u, shift));
}

/* ---- FP8 <-> float ------------------------------------------------------ */

#define IPU_FP8_MBITS(t) ((t) == IPU_F143 ? 3 : 2)
#define IPU_FP8_BIAS(t) ((t) == IPU_F143 ? 8 : 16)
#define IPU_FP8_MAX(t) ((t) == IPU_F143 ? 240.0 : 57344.0)

/* Unscaled value of an fp8 code (exact in float).  Code 0x80 gives the same
 * NaN bit pattern as ml_dtypes (0xFFC00000, negative quiet NaN). */
static inline float ipu_fp8_to_float(uint8_t code, int type)
{
    const int mbits = IPU_FP8_MBITS(type), bias = IPU_FP8_BIAS(type);
    if (code == 0x80u)
        return ipu_f32_from_bits(0xFFC00000u);
    uint32_t sign = (uint32_t)(code & 0x80u) << 24;
    uint32_t e = (code >> mbits) & (0x7fu >> mbits);
    uint32_t m = code & ((1u << mbits) - 1u);
    if (e == 0) {
        float v = (float)m * ipu_f32_from_bits((uint32_t)(127 + 1 - bias - mbits) << 23); /* exact */
        return sign ? -v : v;
    }
    return ipu_f32_from_bits(sign | ((e - (uint32_t)bias + 127u) << 23) | (m << (23 - mbits)));
}

/* Saturating, round-to-nearest-even cast of a double to an fp8 code. */
static inline uint8_t ipu_double_to_fp8(double x, int type)
{
    const int mbits = IPU_FP8_MBITS(type), bias = IPU_FP8_BIAS(type);
    const double max = IPU_FP8_MAX(type);
    if (isnan(x))
        return 0x80u;
    uint8_t sign = signbit(x) ? 0x80u : 0u;
    double a = fabs(x);
    if (a > max)
        a = max;
    uint64_t u;
    memcpy(&u, &a, 8);
    int E = (int)(u >> 52);
    if (E == 0)
        return 0; /* zero or double subnormal */
    int e = E - 1023;
    uint64_t sig = (u & ((1ull << 52) - 1u)) | (1ull << 52); /* a = sig * 2^(e-52) */
    int emin = 1 - bias;
    int eq = (e > emin ? e : emin); /* binade of the result quantum */
    int shift = eq - mbits - e + 52;  /* >= 52 - mbits */
    if (shift >= 54)
        return 0; /* below half the smallest subnormal */
    uint64_t r = ipu_rne_shift(sig, (unsigned)shift);
    uint32_t code = ((uint32_t)(eq + bias - 1) << mbits) + (uint32_t)r;
    if (code == 0)
        return 0; /* no negative zero */
    return (uint8_t)(sign | code);
}

/* Decode with scale: value(code) * 2^-scale_exp (one rounding to float). */
static inline float ipu_fp8_decode(uint8_t code, int type, int32_t scale_exp)
{
    return (float)ldexp((double)ipu_fp8_to_float(code, type), -scale_exp);
}

/* Encode with scale: saturating_cast(x * 2^scale_exp) (scaling exact in double).
 * Normal, zero, infinite and NaN x with |scale_exp| <= 1000 take a path on x's
 * bits that gives the same code as ipu_double_to_fp8(ldexp(x, scale_exp)): the
 * significand is x's 24 bits instead of the double's 53 (the 29 low zero bits
 * change no rounding) and the saturation test compares exponent and
 * significand with those of the format's max. Subnormal x and larger scales
 * go through the double. */
static inline uint8_t ipu_fp8_encode(float x, int type, int32_t scale_exp)
{
    const int mbits = IPU_FP8_MBITS(type), bias = IPU_FP8_BIAS(type);
    const uint32_t maxbits = ipu_bits_from_f32((float)IPU_FP8_MAX(type));
    const int emax = (int)(maxbits >> 23) - 127;
    const uint32_t sigmax = (maxbits & 0x7fffffu) | 0x800000u;
    const uint32_t u = ipu_bits_from_f32(x), a = u & 0x7fffffffu;
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);

    if (a > 0x7f800000u)
        return 0x80u; /* NaN */
    if (a == 0)
        return 0;
    if (a < 0x00800000u || scale_exp > 1000 || scale_exp < -1000)
        return ipu_double_to_fp8(ldexp((double)x, scale_exp), type);
    if (a == 0x7f800000u)
        return (uint8_t)(sign | 0x7fu);
    const int e = (int)(a >> 23) - 127 + scale_exp; /* |x| 2^s = sig * 2^(e-23) */
    const uint32_t sig = (a & 0x7fffffu) | 0x800000u;
    if (e > emax || (e == emax && sig >= sigmax))
        return (uint8_t)(sign | 0x7fu); /* saturate */
    const int emin = 1 - bias;
    const int eq = e > emin ? e : emin;
    const int shift = eq - mbits - e + 23; /* >= 23 - mbits */
    if (shift >= 25)
        return 0; /* below half the smallest subnormal */
    const uint32_t code = ((uint32_t)(eq + bias - 1) << mbits) + (uint32_t)ipu_rne_shift(sig, (unsigned)shift);
    return code == 0 ? 0 : (uint8_t)(sign | code);
}

/* Load element i of an array of the given type as an (unscaled) float. */
static inline float ipu_load_elem(const uint8_t *base, uint32_t i, int type)
{
    if (type == IPU_F32)
        return ipu_ld_f32(base + 4u * (uint64_t)i);
    if (type == IPU_F16)
        return ipu_f16_to_float(ipu_ld_u16(base + 2u * (uint64_t)i));
    return ipu_fp8_to_float(base[i], type);
}

/* ---- block decoding and vectors ----------------------------------------- */

/* Loads elements of one type as (unscaled) floats; fp8 through a table of the
 * 256 codes, so each element costs one lookup. */
typedef struct {
    int type;
    float fp8[256];
} ipu_decoder;

static inline void ipu_decoder_init(ipu_decoder *d, int type)
{
    d->type = type;
    if (IPU_IS_FP8(type))
        for (unsigned code = 0; code < 256u; code++)
            d->fp8[code] = ipu_fp8_to_float((uint8_t)code, type);
}

static inline float ipu_decode(const ipu_decoder *d, const uint8_t *base, size_t i)
{
    if (IPU_IS_FP8(d->type))
        return d->fp8[base[i]];
    return ipu_load_elem(base, (uint32_t)i, d->type);
}

/* Four f32 lanes (GCC/Clang vector extension): lane-wise IEEE operations, the
 * same roundings as the scalar ones. */
typedef float ipu_f32x4 __attribute__((vector_size(16)));

#endif /* IPU_KERNEL_H */
