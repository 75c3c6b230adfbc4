/* The mean of one range of every source, in one call that Python makes without holding the GIL
 * (ckptavg/merging/native.py loads this through ctypes). Bit for bit what the torch path of
 * ckptavg/merging/kernel.py computes: the first source converted into the sum (times its weight),
 * every other one added in order (a uniform mean: plainly, then the sum divided once; a weighted
 * one: with a fused multiply-add, as torch's add_(x, alpha=w) does), and the result rounded to the
 * output's dtype (round to nearest even); no other contraction (-ffp-contract=off). native.py
 * checks these bits against torch's ops on this machine before it uses them.
 *
 * Each function returns 1 when an output element is not finite (NaN, Inf, or an overflow of the
 * output's dtype): the caller then reports it, so the bytes written do not matter then. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 512 /* elements whose sums stay in registers and L1 while every source is added */

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v3", "default"))) /* AVX2 + FMA */
#else
#define VECTOR_CLONES
#endif

static inline uint32_t float_bits(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return bits;
}

static inline float load_bf16(uint16_t element) {
    uint32_t bits = (uint32_t)element << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* Round to nearest even, write, and say whether the mean is not finite: NaN is caught before
 * rounding, since a NaN's payload can carry into the sign bit. */
static inline uint32_t store_bf16(float mean, uint16_t *target) {
    uint32_t bits = float_bits(mean);
    uint16_t rounded = (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
    *target = rounded;
    return ((bits & 0x7F800000u) == 0x7F800000u) | ((rounded & 0x7F80u) == 0x7F80u);
}

static inline double load_f32(float element) { return (double)element; }

static inline uint32_t store_f32(double mean, float *target) {
    float rounded = (float)mean;
    *target = rounded;
    return (float_bits(rounded) & 0x7F800000u) == 0x7F800000u;
}

/* NAME(sources, weights, count, n, divisor, out): the mean of n elements of each of count
 * sources, in the order given, with sums of type SUM: weighted when weights (summing to one) are
 * given, else uniform (the sum divided by divisor). Returns 1 when an output is not finite.
 * The first source times 1 is exact, so one loop serves both kinds. */
#define DEFINE_MEAN(NAME, ELEMENT, SUM, LOAD, STORE, FMA)                                            \
    VECTOR_CLONES                                                                                    \
    int NAME(const ELEMENT *const *sources, const SUM *weights, int count, int64_t n, SUM divisor,   \
             ELEMENT *out) {                                                                         \
        SUM sum[BLOCK];                                                                              \
        uint32_t bad = 0;                                                                            \
        for (int64_t start = 0; start < n; start += BLOCK) {                                         \
            int64_t m = n - start < BLOCK ? n - start : BLOCK;                                       \
            const ELEMENT *first = sources[0] + start;                                               \
            SUM scale = weights ? weights[0] : (SUM)1;                                               \
            for (int64_t i = 0; i < m; i++) sum[i] = LOAD(first[i]) * scale;                         \
            for (int s = 1; s < count; s++) {                                                        \
                const ELEMENT *source = sources[s] + start;                                          \
                if (weights) {                                                                       \
                    SUM weight = weights[s];                                                         \
                    for (int64_t i = 0; i < m; i++) sum[i] = FMA(LOAD(source[i]), weight, sum[i]);   \
                } else {                                                                             \
                    for (int64_t i = 0; i < m; i++) sum[i] += LOAD(source[i]);                       \
                }                                                                                    \
            }                                                                                        \
            ELEMENT *target = out + start;                                                           \
            if (weights) {                                                                           \
                for (int64_t i = 0; i < m; i++) bad |= STORE(sum[i], target + i);                    \
            } else {                                                                                 \
                for (int64_t i = 0; i < m; i++) bad |= STORE(sum[i] / divisor, target + i);          \
            }                                                                                        \
        }                                                                                            \
        return bad != 0;                                                                             \
    }

DEFINE_MEAN(ckptavg_mean_bf16, uint16_t, float, load_bf16, store_bf16, fmaf)
DEFINE_MEAN(ckptavg_mean_f32, float, double, load_f32, store_f32, fma)
