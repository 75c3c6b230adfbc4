/* The uniform mean of one range of every source, in one call that Python makes without holding
 * the GIL (ckptavg/merging/native.py loads this through ctypes). Bit for bit what the torch
 * path of ckptavg/merging/kernel.py computes: the first source converted into the sum, every
 * other one added in order, the sum divided once and rounded to the output's dtype (round to
 * nearest even), no contraction into fused multiply-adds (-ffp-contract=off).
 *
 * Each function returns 1 when an output element is not finite (NaN, Inf, or an overflow of the
 * output's dtype): the caller then reports it, so the bytes written do not matter then. */
#include <stdint.h>
#include <string.h>

#define BLOCK 512 /* elements whose sums stay in registers and L1 while every source is added */

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define VECTOR_CLONES
#endif

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static inline uint16_t float_to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

static inline uint32_t float_bits(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return bits;
}

VECTOR_CLONES
int ckptavg_mean_bf16(const uint16_t *const *sources, int count, int64_t n, float divisor, uint16_t *out) {
    float sum[BLOCK];
    uint32_t bad = 0;
    for (int64_t start = 0; start < n; start += BLOCK) {
        int64_t m = n - start < BLOCK ? n - start : BLOCK;
        const uint16_t *first = sources[0] + start;
        for (int64_t i = 0; i < m; i++) sum[i] = bf16_to_float(first[i]);
        for (int s = 1; s < count; s++) {
            const uint16_t *source = sources[s] + start;
            for (int64_t i = 0; i < m; i++) sum[i] += bf16_to_float(source[i]);
        }
        uint16_t *target = out + start;
        for (int64_t i = 0; i < m; i++) {
            float mean = sum[i] / divisor;
            uint16_t rounded = float_to_bf16(mean);
            /* NaN is caught before rounding: a NaN's payload can carry into the sign bit. */
            bad |= ((float_bits(mean) & 0x7F800000u) == 0x7F800000u) | ((rounded & 0x7F80u) == 0x7F80u);
            target[i] = rounded;
        }
    }
    return bad != 0;
}

VECTOR_CLONES
int ckptavg_mean_f32(const float *const *sources, int count, int64_t n, double divisor, float *out) {
    double sum[BLOCK];
    uint32_t bad = 0;
    for (int64_t start = 0; start < n; start += BLOCK) {
        int64_t m = n - start < BLOCK ? n - start : BLOCK;
        const float *first = sources[0] + start;
        for (int64_t i = 0; i < m; i++) sum[i] = (double)first[i];
        for (int s = 1; s < count; s++) {
            const float *source = sources[s] + start;
            for (int64_t i = 0; i < m; i++) sum[i] += (double)source[i];
        }
        float *target = out + start;
        for (int64_t i = 0; i < m; i++) {
            float mean = (float)(sum[i] / divisor);
            bad |= (float_bits(mean) & 0x7F800000u) == 0x7F800000u;
            target[i] = mean;
        }
    }
    return bad != 0;
}
