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

/* fp16, on x86-64 CPUs with F16C (every one with AVX2): the same loop with the conversions done
 * by the F16C instructions, which are exact one way and round to nearest even the other, as
 * torch's are. Written with intrinsics because compilers do not vectorize fp16 conversions
 * written in C (1.2-1.6 GB/s, slower than torch's ops). Elsewhere fp16 keeps torch's ops:
 * ckptavg_f16_available() says which. */
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>

#define F16C_TARGET __attribute__((target("avx2,fma,f16c")))

F16C_TARGET static inline __m256 load8_f16(const uint16_t *element) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)element));
}

F16C_TARGET static inline float load_f16(uint16_t element) { return _cvtsh_ss(element); }

F16C_TARGET int ckptavg_mean_f16(const uint16_t *const *sources, const float *weights, int count, int64_t n,
                                 float divisor, uint16_t *out) {
    float sum[BLOCK];
    const __m128i exponent = _mm_set1_epi16(0x7C00);
    __m128i bad = _mm_setzero_si128();
    uint32_t bad_tail = 0;
    for (int64_t start = 0; start < n; start += BLOCK) {
        int64_t m = n - start < BLOCK ? n - start : BLOCK, whole = m & ~(int64_t)7, i;
        const uint16_t *first = sources[0] + start;
        float scale = weights ? weights[0] : 1.0f;
        for (i = 0; i < whole; i += 8) _mm256_storeu_ps(sum + i, _mm256_mul_ps(load8_f16(first + i), _mm256_set1_ps(scale)));
        for (; i < m; i++) sum[i] = load_f16(first[i]) * scale;
        for (int s = 1; s < count; s++) {
            const uint16_t *source = sources[s] + start;
            if (weights) {
                float weight = weights[s];
                __m256 w = _mm256_set1_ps(weight);
                for (i = 0; i < whole; i += 8)
                    _mm256_storeu_ps(sum + i, _mm256_fmadd_ps(load8_f16(source + i), w, _mm256_loadu_ps(sum + i)));
                for (; i < m; i++) sum[i] = fmaf(load_f16(source[i]), weight, sum[i]);
            } else {
                for (i = 0; i < whole; i += 8)
                    _mm256_storeu_ps(sum + i, _mm256_add_ps(_mm256_loadu_ps(sum + i), load8_f16(source + i)));
                for (; i < m; i++) sum[i] += load_f16(source[i]);
            }
        }
        uint16_t *target = out + start;
        for (i = 0; i < whole; i += 8) {
            __m256 mean = _mm256_loadu_ps(sum + i);
            if (!weights) mean = _mm256_div_ps(mean, _mm256_set1_ps(divisor));
            __m128i half = _mm256_cvtps_ph(mean, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            _mm_storeu_si128((__m128i *)(target + i), half);
            /* NaN, Inf and overflow all round to an all-ones exponent */
            bad = _mm_or_si128(bad, _mm_cmpeq_epi16(_mm_and_si128(half, exponent), exponent));
        }
        for (; i < m; i++) {
            uint16_t half = _cvtss_sh(weights ? sum[i] : sum[i] / divisor, _MM_FROUND_TO_NEAREST_INT);
            target[i] = half;
            bad_tail |= (half & 0x7C00u) == 0x7C00u;
        }
    }
    return bad_tail || !_mm_testz_si128(bad, bad);
}

int ckptavg_f16_available(void) {
    unsigned int eax, ebx, ecx, edx;
    __builtin_cpu_init();
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx & bit_F16C)) return 0;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#else
int ckptavg_f16_available(void) { return 0; }
#endif
