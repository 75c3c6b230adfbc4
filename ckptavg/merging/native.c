/* The mean of one range of every source, in one call that Python makes without holding the GIL
 * (ckptavg/merging/native.py loads this through ctypes).
 *
 * Uniform means (ckptavg_mean_*): bit for bit what the torch path of ckptavg/merging/kernel.py
 * computes: the first source converted into the sum, every other one added in order, the sum
 * divided once and rounded to the output's dtype (round to nearest even); no contraction
 * (-ffp-contract=off). Each returns 1 when an output element is not finite (NaN, Inf, or an
 * overflow of the output's dtype): the caller then reports it, so the bytes written do not matter.
 *
 * Weighted sums (ckptavg_weighted_*): the fp64 sum of the products, its one rounding to the
 * output's dtype, and for each element whether an error bound on that sum vouches for the
 * rounding (ckptavg.merging.kernel.WeightedSum recomputes the others exactly); for 16-bit outputs
 * an fp32 pass with a bound of its own first (see "the fp32 pass"). native.py checks both kinds
 * against torch's ops on this machine before it uses them. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 512 /* elements whose sums stay in registers and L1 while every source is added */

/* CKPTAVG_BASELINE (native.py: CKPTAVG_NATIVE_BASELINE=1): the baseline code alone, without the
 * AVX2 + FMA clones or the F16C loops, as a CPU without AVX2 runs it (fma() from libm), so that
 * the tests check it on machines that would pick the clones. (An AVX-512 clone, x86-64-v4, made
 * the loops slower on the AVX-512 VM they were measured on, the uniform one several times over.) */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(CKPTAVG_BASELINE)
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

/* NAME(sources, count, n, divisor, out): the mean of n elements of each of count sources, in the
 * order given, with sums of type SUM: the sum divided by divisor. Returns 1 when an output is not
 * finite. Each source is added by a function of its own (ADD): written inline, GCC compiled the
 * loop over the sources into one ~3.5x slower with 8 sources. */
#define DEFINE_MEAN(NAME, ELEMENT, SUM, LOAD, STORE)                                                 \
    VECTOR_CLONES static void NAME##_add(const ELEMENT *source, int64_t m, SUM *sum) {               \
        for (int64_t i = 0; i < m; i++) sum[i] += LOAD(source[i]);                                   \
    }                                                                                                \
    VECTOR_CLONES                                                                                    \
    int NAME(const ELEMENT *const *sources, int count, int64_t n, SUM divisor, ELEMENT *out) {       \
        SUM sum[BLOCK];                                                                              \
        uint32_t bad = 0;                                                                            \
        for (int64_t start = 0; start < n; start += BLOCK) {                                         \
            int64_t m = n - start < BLOCK ? n - start : BLOCK;                                       \
            const ELEMENT *first = sources[0] + start;                                               \
            for (int64_t i = 0; i < m; i++) sum[i] = LOAD(first[i]);                                 \
            for (int s = 1; s < count; s++) NAME##_add(sources[s] + start, m, sum);                  \
            ELEMENT *target = out + start;                                                           \
            for (int64_t i = 0; i < m; i++) bad |= STORE(sum[i] / divisor, target + i);              \
        }                                                                                            \
        return bad != 0;                                                                             \
    }

DEFINE_MEAN(ckptavg_mean_bf16, uint16_t, float, load_bf16, store_bf16)
DEFINE_MEAN(ckptavg_mean_f32, float, double, load_f32, store_f32)

/* -- weighted sums ---------------------------------------------------------------------------
 *
 * NAME(sources, weights, parts, count, n, bound, tail, exact, out, doubtful): out := the fp64 sum
 * of weights[s] * sources[s] (fused multiply-adds, in the order given) rounded once to the
 * output's dtype (through fp32 rounded to odd, which has 16 more bits than a 16-bit output: no
 * double rounding); where the bound does not vouch for out[i], settle() decides it exactly if it
 * can (parts: the weights split for exact products, or NULL), else doubtful[i] := 1 (the caller
 * takes rationals there); returns how many are left doubtful.
 *
 * The bound: each of the sum's n roundings errs by at most 2^-53 of its result (plus 2^-1075 below
 * the normal range), and every partial sum is at most sum|w| max|x| (1 + n 2^-53), so
 * |sum - exact| <= E = bound * max_s |x_s| + tail (the caller's figures, with margin). Where the
 * products are exact (exact != 0: weights of few enough bits) an element whose every addition was
 * exact has E = 0 (checked only for the elements the block's bound leaves in doubt: the fused
 * multiply-adds of exact products are the plain additions, so their sum is the same). out[i] is
 * then the correctly rounded exact sum when [sum - E, sum + E] holds no midpoint of the output's
 * grid around out[i]: E = 0, or |sum| + E < |out| + spacing above / 2 and
 * |sum| - E > |out| - spacing below / 2, each side computed in fp64 (exact: a midpoint is an fp64
 * number, and rounding is monotonic); a zero also needs |sum| > E, for its sign. A sum that is not
 * finite is vouched for: its output is not finite either, which the caller reports.
 *
 * Most blocks take a faster road (fast_block_*): one bound for the whole block, from the largest
 * magnitude in it, and the sums rounded from their own bits; only the elements that bound cannot
 * vouch for, or whose results are not normal numbers, are checked with their own bound as above
 * (the same results either way: each is the correctly rounded exact sum). */

/* fp64 to fp32 rounded to odd: exact values as they are, others to the neighbour whose last bit
 * is odd (a rounding that then rounds to any format of two or more bits fewer as the fp64 value
 * itself would: Boldo and Melquiond, "When double rounding is odd", 2005). */
static inline float to_odd(double sum) {
    float near = (float)sum;
    uint32_t bits = float_bits(near);
    uint32_t inexact = (double)near != sum, away = fabs((double)near) > fabs(sum);
    bits += (inexact & ~bits & 1u) * (1u - 2u * away); /* its magnitude one step up or down */
    memcpy(&near, &bits, sizeof near);
    return near;
}

/* The gaps around |value|, a value of the grid of `precision` bits whose normal values start at
 * 2^lowest: returns the gap to the next value away from zero; *toward := the gap to the next
 * toward zero (half as wide above a power of two, but not above the smallest normal value).
 * In 64-bit lanes throughout, so that the loops calling it vectorize. */
static inline double gaps(double value, int64_t precision, int64_t lowest, double *toward) {
    uint64_t bits;
    value = fabs(value);
    memcpy(&bits, &value, sizeof bits);
    int64_t exponent = (int64_t)(bits >> 52) - 1023;
    exponent = exponent < lowest ? lowest : exponent;
    uint64_t away_bits = (uint64_t)(exponent - precision + 1 + 1023) << 52;
    uint64_t finer = ((bits & 0xFFFFFFFFFFFFFull) == 0) & (exponent > lowest);
    uint64_t toward_bits = away_bits - (finer << 52);
    double away;
    memcpy(&away, &away_bits, sizeof away);
    memcpy(toward, &toward_bits, sizeof *toward);
    return away;
}

/* Whether the bound vouches for written, the rounding of sum to the grid (a zero only where the
 * bound vouches for the sign of sum too). */
static inline uint64_t vouched(double sum, double error, double written, int64_t precision, int64_t lowest) {
    double toward, away = gaps(written, precision, lowest, &toward), value = fabs(written), size = fabs(sum);
    uint64_t finite = sum - sum == 0;
    uint64_t inside = (size + error < value + away * 0.5) & (size - error > value - toward * 0.5);
    return !finite | (error == 0) | (inside & ((value != 0) | (size > error)));
}

/* The sign (-1, 0, 1) of the exact sum of parts[j] x[j / 2] - point, or 2 where undecided: TwoSum
 * of the products (each exact), their errors summed beside (Sum2); the sign is sure where those
 * error sums were exact, or where the result exceeds Sum2's bound (Ogita, Rump and Oishi 2005,
 * Prop. 4.5). kernel._sign_past is the same with torch's ops. */
static int exact_sign(const double *x, const double *parts, int count, double point) {
    double total = -point, compensation = 0, size = fabs(point);
    int exact = 1;
    for (int j = 0; j < 2 * count; j++) {
        double term = x[j / 2] * parts[j], added = total + term, back = added - total;
        double lost = (total - (added - back)) + (term - back); /* TwoSum: exactly total + term - added */
        double summed = compensation + lost;
        exact &= (summed - compensation == lost) & (summed - lost == compensation);
        size += fabs(term);
        total = added;
        compensation = summed;
    }
    double result = total + compensation, terms = 2.0 * count + 1, gamma = terms * 0x1p-53 / (1 - terms * 0x1p-53);
    if (!exact && !(fabs(result) * (1 - 0x1p-50) > size * (gamma * gamma * (1 + 0x1p-20)) + terms * 0x1p-1070))
        return 2;
    return (result > 0) - (result < 0);
}

/* Where the bound left written in doubt: the correctly rounded sum of parts[2s] x[s] +
 * parts[2s + 1] x[s] (the weights split so that each product is exact), or NaN where undecided
 * (then ckptavg.merging.kernel.WeightedSum takes rationals). Where the error is below half the
 * finer gap around written, the exact sum lies within one gap of it, on the side of sum, and the
 * exact sign of (exact sum - the midpoint on that side) decides; a zero takes the sign of the
 * exact sum (+0 where it is 0). */
static double settle(const double *x, const double *parts, int count, double sum, double error, double written,
                     int64_t precision, int64_t lowest) {
    double toward, away = gaps(written, precision, lowest, &toward);
    if (!(error < (away < toward ? away : toward) * 0.5) || sum - sum != 0) return NAN;
    int rising = sum >= written;
    double above = written >= 0 ? written + away : written + toward;
    double below = written > 0 ? written - toward : written - away;
    double neighbour = rising ? above : below;
    int sign = exact_sign(x, parts, count, (written + neighbour) * 0.5);
    if (sign == 2) return NAN;
    int odd = (int64_t)(fabs(written) / away) & 1; /* an integer below 2^53: its last bit */
    double value = ((rising ? sign > 0 : sign < 0) | ((sign == 0) & odd)) ? neighbour : written;
    if (value != 0) return value;
    sign = fabs(sum) > error ? (sum > 0) - (sum < 0) : exact_sign(x, parts, count, 0.0);
    return sign == 2 ? NAN : sign < 0 ? -0.0 : 0.0;
}

/* One case of add_products_*: the loop over a block with the TERMS of its sources (each one
 * element's product added to sum_i, of type SUM, by FMA). */
#define TERM(FMA, LOAD, x, j) sum_i = FMA(LOAD(x[i]), w[j], sum_i);
#define ADD_PRODUCTS(CASE, SUM, START, TERMS)                                                        \
    case CASE:                                                                                       \
        for (int64_t i = 0; i < m; i++) {                                                            \
            SUM sum_i = START;                                                                       \
            TERMS sum[i] = sum_i;                                                                    \
        }                                                                                            \
        break;

/* NAME: the loops over one block of one source (sums and weights of type SUM, fused by FMA), per
 * type of element that they read (bf16 and fp32 as stored; fp16 converted into a block first),
 * each element converted by LOAD. */
#define DEFINE_TERMS(NAME, ELEMENT, LOAD, SUM, FMA)                                                  \
    /* Up to four sources (count) in one pass over the sums, the same operations in the same         \
     * order (first: the sums start from -0, as fma(x, w, -0) is x * w rounded, -0 included). */     \
    VECTOR_CLONES static void NAME(const ELEMENT *const *x, const SUM *w, int count, int first, int64_t m, SUM *sum) { \
        const ELEMENT *a = x[0], *b = x[count > 1], *c = x[count > 2 ? 2 : 0], *d = x[count > 3 ? 3 : 0]; \
        switch (count + 4 * (first != 0)) {                                                          \
            ADD_PRODUCTS(4, SUM, sum[i], TERM(FMA, LOAD, a, 0) TERM(FMA, LOAD, b, 1) TERM(FMA, LOAD, c, 2) TERM(FMA, LOAD, d, 3)) \
            ADD_PRODUCTS(3, SUM, sum[i], TERM(FMA, LOAD, a, 0) TERM(FMA, LOAD, b, 1) TERM(FMA, LOAD, c, 2)) \
            ADD_PRODUCTS(2, SUM, sum[i], TERM(FMA, LOAD, a, 0) TERM(FMA, LOAD, b, 1))                 \
            ADD_PRODUCTS(1, SUM, sum[i], TERM(FMA, LOAD, a, 0))                                      \
            ADD_PRODUCTS(8, SUM, -0.0f, TERM(FMA, LOAD, a, 0) TERM(FMA, LOAD, b, 1) TERM(FMA, LOAD, c, 2) TERM(FMA, LOAD, d, 3)) \
            ADD_PRODUCTS(7, SUM, -0.0f, TERM(FMA, LOAD, a, 0) TERM(FMA, LOAD, b, 1) TERM(FMA, LOAD, c, 2)) \
            ADD_PRODUCTS(6, SUM, -0.0f, TERM(FMA, LOAD, a, 0) TERM(FMA, LOAD, b, 1))                  \
            ADD_PRODUCTS(5, SUM, -0.0f, TERM(FMA, LOAD, a, 0))                                       \
        }                                                                                            \
    }

/* Whether every addition of the sum of weights[s] * x[s] (products exact) was exact: s + t rounded
 * to u was iff u - s == t and u - t == s (when |s| >= |t|, u - s is exact (Sterbenz), so it differs
 * from t if u does from s + t; alike otherwise with u - t), which also holds below the normal
 * range. The sum is the fused loop's: with exact products, fma(x, w, s) is s + x * w rounded. */
static int additions_exact(const double *x, const double *weights, int count) {
    double sum = x[0] * weights[0];
    for (int s = 1; s < count; s++) {
        double term = x[s] * weights[s], next = sum + term;
        if (next - sum != term || next - term != sum) return 0;
        sum = next;
    }
    return 1;
}

/* The largest magnitude in a block of the sources, kept as the bits of the stored values (sign
 * cleared: for IEEE floats of one sign, their order is the integers'). */
#define DEFINE_MAGNITUDES(SUFFIX, BITS, MASK)                                                        \
    VECTOR_CLONES static BITS block_largest_##SUFFIX(const BITS *x, int64_t m, BITS top) {           \
        for (int64_t i = 0; i < m; i++) {                                                            \
            BITS size = x[i] & MASK;                                                                 \
            top = size > top ? size : top;                                                           \
        }                                                                                            \
        return top;                                                                                  \
    }

DEFINE_MAGNITUDES(b16, uint16_t, 0x7FFFu)
DEFINE_MAGNITUDES(b32, uint32_t, 0x7FFFFFFFu)

static inline double load_f64(double element) { return element; }

static inline float load_float(float element) { return element; }

DEFINE_TERMS(add_products_bf16, uint16_t, load_bf16, double, fma)
DEFINE_TERMS(add_products_f32, float, load_f32, double, fma)
DEFINE_TERMS(add_products_f64, double, load_f64, double, fma)
DEFINE_TERMS(add_products32_bf16, uint16_t, load_bf16, float, fmaf)
DEFINE_TERMS(add_products32_f32, float, load_float, float, fmaf)

/* The bound for a block's sums, error = bound * largest + tail, with margin for its own two
 * roundings (each within 2^-53 of its result). */
static inline double reach(double error) { return error * (1 + 0x1p-50); }

static inline double power_of_two(int64_t exponent) {
    uint64_t bits = (uint64_t)(exponent + 1023) << 52;
    double value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* The fast path of a block: out := each sum rounded to the output's grid, and doubtful := 1 where
 * one error bound for the whole block (e, from the largest magnitude in the block of any source:
 * see reach) does not vouch for it; returns whether any is. Branch-free, in 64-bit lanes, without
 * the rounding through fp32 to odd: it rounds the fp64 bits themselves to PRECISION bits (to
 * nearest even: the integer carry runs into the exponent as the value's does), which is the
 * output's rounding wherever the result is a normal number of the output's range. The exact sum
 * lies in [sum - e, sum + e]; with a = |sum| in [2^k, 2^(k+1)) and the grid's spacing there g,
 * the midpoint of a's cell of the grid, M (a's bits cut to PRECISION, and half a spacing), is the
 * only midpoint within g / 4 of a (the one below 2^k is g / 4 under it, the rest g / 2 or more
 * away), so where |a - M| > e (exact: M and a share a binade) and e < a 2^-(PRECISION + 2) <= g / 4
 * every value of the interval rounds as sum does; and where 2^LOWEST <= a < limit (the midpoint
 * between the largest finite value and the next power of two), that is to a normal, finite value.
 * A zero, subnormal, non-finite or overflowing result, or a sum too near a midpoint, is left in
 * doubt (for the caller's check of that element alone). Comparisons of fp64 values rather than
 * of rounded bit patterns (two roundings and unsigned 64-bit comparisons, which AVX2 has not):
 * fewer vector operations. */
/* DECIDE_BLOCK(NAME, REAL, UINT, FABS, MANTISSA, EXPONENT_BIAS, TARGET, PRECISION, LOWEST, HIGHEST,
 * BIAS): the decision above for sums of type REAL (fp64, or the fp32 pass's fp32: MANTISSA bits,
 * UINT its bits as an integer) writing TARGET of PRECISION bits. */
#define DECIDE_BLOCK(NAME, REAL, UINT, FABS, MANTISSA, EXPONENT_BIAS, TARGET, PRECISION, LOWEST, HIGHEST, BIAS) \
    VECTOR_CLONES static UINT NAME(const REAL *sum, REAL e, int64_t m, TARGET *out, uint8_t *doubtful) { \
        const int shift = MANTISSA - PRECISION, width = 8 * (int)sizeof(REAL) - MANTISSA - 1 + PRECISION; \
        const UINT half = ((UINT)1 << (shift - 1)) - 1, unbias = (UINT)(EXPONENT_BIAS - BIAS) << (PRECISION - 1); \
        const UINT cell = ~(((UINT)1 << shift) - 1), middle = (UINT)1 << (shift - 1);               \
        const REAL smallest = (REAL)power_of_two(LOWEST), narrow = e * (REAL)power_of_two(PRECISION + 2); \
        const REAL limit = (REAL)(power_of_two(HIGHEST + 1) - power_of_two(HIGHEST - PRECISION));   \
        UINT failed = 0;                                                                            \
        for (int64_t i = 0; i < m; i++) {                                                           \
            REAL size = FABS(sum[i]), midpoint;                                                     \
            UINT bits, size_bits, midpoint_bits;                                                    \
            memcpy(&bits, sum + i, sizeof bits);                                                    \
            memcpy(&size_bits, &size, sizeof size_bits);                                            \
            midpoint_bits = (size_bits & cell) | middle;                                            \
            memcpy(&midpoint, &midpoint_bits, sizeof midpoint);                                     \
            UINT good = (FABS(size - midpoint) > e) & (size > narrow) & (size >= smallest) & (size < limit); \
            UINT rounded = (bits + half + ((bits >> shift) & 1)) >> shift;                          \
            doubtful[i] = (uint8_t)!good;                                                           \
            failed |= !good;                                                                        \
            out[i] = (TARGET)((rounded >> width) << (8 * sizeof(TARGET) - 1) | ((rounded & (((UINT)1 << width) - 1)) - unbias)); \
        }                                                                                           \
        return failed;                                                                              \
    }

#define DEFINE_FAST(SUFFIX, TARGET, PRECISION, LOWEST, HIGHEST, BIAS) \
    DECIDE_BLOCK(fast_block_##SUFFIX, double, uint64_t, fabs, 53, 1023, TARGET, PRECISION, LOWEST, HIGHEST, BIAS)

DEFINE_FAST(bf16, uint16_t, 8, -126, 127, 127)
DEFINE_FAST(f32, uint32_t, 24, -126, 127, 127)
DEFINE_FAST(f16, uint16_t, 11, -14, 15, 15)

/* fast_block_* for the fp32 pass's sums (sums32_*), in 32-bit lanes (eight to an AVX2
 * vector): the same decision and the same argument, with the fp32 sums and a bound e rounded up to
 * fp32 (so that e, and narrow = e 2^(PRECISION + 2), are at least the real bound's), and the
 * rounding of the fp32 bits to PRECISION bits. |size - midpoint| is exact in fp32 as in fp64 (one
 * binade); limit and smallest are fp32 numbers. */
#define DEFINE_FAST32(SUFFIX, PRECISION, LOWEST, HIGHEST, BIAS) \
    DECIDE_BLOCK(fast32_##SUFFIX, float, uint32_t, fabsf, 24, 127, uint16_t, PRECISION, LOWEST, HIGHEST, BIAS)

DEFINE_FAST32(bf16, 8, -126, 127, 127)
DEFINE_FAST32(f16, 11, -14, 15, 15)

/* -- the fp32 pass (16-bit outputs) ----------------------------------------------------------
 *
 * fp64 fused multiply-adds run at 4 lanes and are compute-bound; fp32 ones run at 8. For bf16 and
 * fp16 outputs, which have 8 and 11 bits, each block is first summed in fp32: s := fmaf(x_k, v_k,
 * s) for k = 1..n in order from s = -0, with v_k = RN32(w_k) (x_k, a bf16 or fp16 input, is exact
 * in fp32, and so is each product inside fmaf: sums32_*), and fast32_* decides each element as
 * fast_block does, from the fp32 sum and a bound e on its distance to the exact sum
 * S = sum_k w_k x_k. The elements left in doubt take the fp64 path below, element by element (the
 * fp64 sum the fused loop would have made, bit for bit, then the same checks), so every output is
 * the one the fp64 path writes: the correctly rounded S, or doubtful.
 *
 * The bound, with u = 2^-24, eta = 2^-150 (a rounding to fp32 errs by at most u of its result, or
 * eta where that is below 2^-126: at most u |result| + eta either way), X = max_k |x_k| (the
 * block's largest magnitude) and W = sum_k |w_k|, for n <= 4096 sources (FP32_SOURCES):
 *  1. weights: |v_k - w_k| <= u |w_k| + eta, so |sum_k v_k x_k - S| <= (u W + n eta) X, and
 *     V = sum_k |v_k| <= (1 + u) W + n eta.
 *  2. sums: s_k = v_k x_k + s_(k-1) + e_k exactly, with |e_k| <= u |v_k x_k + s_(k-1)| + eta, so
 *     s_n = sum_k v_k x_k + sum_k e_k. With E_k = sum_(j<=k) |e_j|, |s_(k-1)| <= V X + E_(k-1)
 *     (the partial sums of |v_j x_j| are at most V X), so E_k <= (1 + u) E_(k-1) + u V X + eta, and
 *     E_n <= (u V X + eta) ((1 + u)^n - 1) / u <= (u V X + eta) n (1 + u)^(n-1), where
 *     (1 + u)^(n-1) <= exp(2^-12) < 1 + 2^-11.
 *  3. together: |s_n - S| <= X [u W + n eta + n (1 + 2^-11) u ((1 + u) W + n eta)] + n (1 + 2^-11) eta
 *     <= X [(n + 1) u W (1 + 2^-11)(1 + u) + n eta (1 + n u (1 + 2^-11))] + n (1 + 2^-11) eta
 *     <= X [(n + 1) u W + 2 n eta] (1 + 2^-10) + 2 n eta (1 + 2^-10) = scale32 X + tail32,
 *     whose computation in fp64 (a few roundings of 2^-53 each, and reach's) stays under the
 *     margin of 2^-10 left over (1 + 2^-11)(1 + u) < 1 + 2^-10.
 * A weight or a sum beyond fp32's range makes the sum infinite or NaN, which fast32 leaves in
 * doubt, as a NaN bound (a NaN in the block) leaves every element. */
#define FP32_SOURCES 4096

/* sums32_SUFFIX(sources, start, w32, count, m, sum): the fp32 sums of one block (PREPARE32: a
 * block of one source as TERMS_ELEMENT, which add_products32_TERMS32 reads). */
#define DEFINE_SUMS32(SUFFIX, ELEMENT, PREPARE32, TERMS32, TERMS_ELEMENT)                            \
    static void sums32_##SUFFIX(const ELEMENT *const *sources, int64_t start, const float *w32, int count, int64_t m, \
                                float *sum) {                                                        \
        float x[4][BLOCK];                                                                           \
        for (int s = 0; s < count; s += 4) {                                                         \
            const TERMS_ELEMENT *group[4];                                                           \
            int k = count - s < 4 ? count - s : 4;                                                   \
            for (int j = 0; j < k; j++) group[j] = PREPARE32(sources[s + j] + start, m, x[j]);       \
            add_products32_##TERMS32(group, w32 + s, k, s == 0, m, sum);                             \
        }                                                                                            \
    }

/* For the weighted loops without an fp32 pass (fp32 outputs: no bits to spare); never called. */
#define NO_FP32_PASS(...) 0

/* e rounded up to fp32 (NaN stays NaN) */
static inline float up32(double e) {
    float rounded = (float)e;
    return (double)rounded < e ? nextafterf(rounded, INFINITY) : rounded;
}

/* How many elements the weighted loops have summed in fp64 (each of a block without the fp32
 * pass; those the fp32 pass left in doubt otherwise), for the tests: what the fp32 pass vouches for
 * is the rest. Counted once per call. */
static int64_t fp64_elements;

int64_t ckptavg_fp64_elements(void) { return __atomic_load_n(&fp64_elements, __ATOMIC_RELAXED); }

/* The fused loop's fp64 sum of one element (add_products_* for one element: the same fused
 * multiply-adds in the same order, so the same bits); cloned, for the FMA instruction where the
 * CPU has one rather than a call of libm's fma() per source. */
VECTOR_CLONES static double element_sum(const double *x, const double *weights, int count) {
    double sum = -0.0;
    for (int s = 0; s < count; s++) sum = fma(x[s], weights[s], sum);
    return sum;
}

/* The first i' >= i below m with flags[i'] != 0, else m: eight flags at a time (few are set). */
static inline int64_t next_flag(const uint8_t *flags, int64_t i, int64_t m) {
    for (uint64_t eight; i + 8 <= m; i += 8) {
        memcpy(&eight, flags + i, sizeof eight);
        if (eight) break;
    }
    while (i < m && !flags[i]) i++;
    return i;
}

/* PREPARE(source, m, x): the block of one source that the SUFFIX loops read; BITS and WIDTH: the
 * stored values as integers, for the largest magnitude in a block (block_largest_WIDTH: on the
 * stored bits, several to a vector lane where an fp64 maximum would take one); LOAD(element): one
 * element as fp64; WRITE(value, target): one value of the grid written; FAST and FAST_TARGET:
 * fast_block_FAST writing FAST_TARGET; TERMS_ELEMENT: what PREPARE returns; FP32, SUMS32 and FAST32:
 * whether the blocks go through the fp32 pass first, and its sums32_* and fast32_*. The elements that fast_block
 * (or the fp32 pass) leaves in doubt are checked one by one with their own bound (the largest
 * magnitude of their own inputs, 0 where the sum is exact). */
#define DEFINE_WEIGHTED(NAME, ELEMENT, PRECISION, LOWEST, PREPARE, SUFFIX, BITS, WIDTH, LOAD, WRITE, FAST, \
                        FAST_TARGET, TERMS_ELEMENT, FP32, SUMS32, FAST32)                                     \
    int64_t NAME(const ELEMENT *const *sources, const double *weights, const double *parts, int count, int64_t n, \
                 double bound, double tail, int exact, ELEMENT *out, uint8_t *doubtful) {            \
        double sum[BLOCK], x[4][BLOCK], values[count], total = 0;                                    \
        float sum32[BLOCK], w32[count];                                                              \
        int64_t flagged = 0, summed = 0;                                                             \
        for (int s = 0; s < count; s++) {                                                            \
            w32[s] = (float)weights[s];                                                              \
            total += fabs(weights[s]);                                                               \
        }                                                                                            \
        const int fp32_pass = FP32 && count <= FP32_SOURCES;                                         \
        const double scale32 = ((count + 1) * total * 0x1p-24 + count * 0x1p-149) * (1 + 0x1p-10);   \
        const double tail32 = count * 0x1p-149 * (1 + 0x1p-10);                                      \
        for (int64_t start = 0; start < n; start += BLOCK) {                                         \
            int64_t m = n - start < BLOCK ? n - start : BLOCK;                                       \
            BITS largest = 0;                                                                        \
            ELEMENT element;                                                                         \
            if (fp32_pass)                                                                           \
                SUMS32(sources, start, w32, count, m, sum32);                                        \
            else                                                                                     \
                for (int s = 0; s < count; s += 4) {                                                 \
                    const TERMS_ELEMENT *group[4];                                                   \
                    int k = count - s < 4 ? count - s : 4;                                           \
                    for (int j = 0; j < k; j++) group[j] = PREPARE(sources[s + j] + start, m, x[j]); \
                    add_products_##SUFFIX(group, weights + s, k, s == 0, m, sum);                    \
                }                                                                                    \
            for (int s = 0; s < count; s++)                                                          \
                largest = block_largest_##WIDTH((const BITS *)sources[s] + start, m, largest);       \
            memcpy(&element, &largest, sizeof element);                                              \
            double big = LOAD(element); /* NaN where a source holds a NaN: then every sum is checked */ \
            if (fp32_pass) {                                                                         \
                if (!FAST32(sum32, up32(reach(scale32 * big + tail32)), m, (uint16_t *)out + start, doubtful + start)) \
                    continue;                                                                        \
            } else {                                                                                 \
                summed += m;                                                                         \
                if (!fast_block_##FAST(sum, reach(bound * big + tail), m, (FAST_TARGET *)out + start, doubtful + start)) \
                    continue;                                                                        \
            }                                                                                        \
            for (int64_t i = next_flag(doubtful + start, 0, m); i < m; i = next_flag(doubtful + start, i + 1, m)) { \
                double top = 0, error, written;                                                      \
                for (int s = 0; s < count; s++) {                                                    \
                    values[s] = LOAD(sources[s][start + i]);                                         \
                    top = fabs(values[s]) > top ? fabs(values[s]) : top;                             \
                }                                                                                    \
                if (fp32_pass) {                                                                     \
                    sum[i] = element_sum(values, weights, count);                                    \
                    summed++;                                                                        \
                }                                                                                    \
                error = bound * top + tail;                                                          \
                WRITE(sum[i], out + start + i);                                                      \
                written = LOAD(out[start + i]);                                                      \
                /* 0 where every addition was exact, or every input zero (their sum is exact too) */ \
                if (top == 0 || (exact && additions_exact(values, weights, count))) error = 0;      \
                if (vouched(sum[i], error, written, PRECISION, LOWEST)) {                            \
                    doubtful[start + i] = 0;                                                         \
                    continue;                                                                        \
                }                                                                                    \
                double value = parts ? settle(values, parts, count, sum[i], error, written, PRECISION, LOWEST) : NAN; \
                if (value == value) {                                                                \
                    WRITE(value, out + start + i);                                                   \
                    doubtful[start + i] = 0;                                                         \
                } else                                                                               \
                    flagged++;                                                                       \
            }                                                                                        \
        }                                                                                            \
        __atomic_fetch_add(&fp64_elements, summed, __ATOMIC_RELAXED);                                \
        return flagged;                                                                              \
    }

static inline void write_bf16(double value, uint16_t *target) { store_bf16(to_odd(value), target); }

static inline void write_f32(double value, float *target) { *target = (float)value; }

#define AS_STORED(source, m, block) ((void)(block), (source))

DEFINE_SUMS32(bf16, uint16_t, AS_STORED, bf16, uint16_t)
DEFINE_WEIGHTED(ckptavg_weighted_bf16, uint16_t, 8, -126, AS_STORED, bf16, uint16_t, b16, load_bf16, write_bf16, bf16,
                uint16_t, uint16_t, 1, sums32_bf16, fast32_bf16)
DEFINE_WEIGHTED(ckptavg_weighted_f32, float, 24, -126, AS_STORED, f32, uint32_t, b32, load_f32, write_f32, f32, uint32_t,
                float, 0, NO_FP32_PASS, NO_FP32_PASS)

/* fp16, on x86-64 CPUs with F16C (every one with AVX2): the same loop with the conversions done
 * by the F16C instructions, which are exact one way and round to nearest even the other, as
 * torch's are. Written with intrinsics because compilers do not vectorize fp16 conversions
 * written in C (1.2-1.6 GB/s, slower than torch's ops). Elsewhere fp16 keeps torch's ops:
 * ckptavg_f16_available() says which. */
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__) && !defined(CKPTAVG_BASELINE)
#include <cpuid.h>
#include <immintrin.h>

#define F16C_TARGET __attribute__((target("avx2,fma,f16c")))

F16C_TARGET static inline __m256 load8_f16(const uint16_t *element) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)element));
}

F16C_TARGET static inline float load_f16(uint16_t element) { return _cvtsh_ss(element); }

F16C_TARGET int ckptavg_mean_f16(const uint16_t *const *sources, int count, int64_t n, float divisor, uint16_t *out) {
    float sum[BLOCK];
    const __m128i exponent = _mm_set1_epi16(0x7C00);
    const __m256 divisors = _mm256_set1_ps(divisor);
    __m128i bad = _mm_setzero_si128();
    uint32_t bad_tail = 0;
    for (int64_t start = 0; start < n; start += BLOCK) {
        int64_t m = n - start < BLOCK ? n - start : BLOCK, whole = m & ~(int64_t)7, i;
        const uint16_t *first = sources[0] + start;
        for (i = 0; i < whole; i += 8) _mm256_storeu_ps(sum + i, load8_f16(first + i));
        for (; i < m; i++) sum[i] = load_f16(first[i]);
        for (int s = 1; s < count; s++) {
            const uint16_t *source = sources[s] + start;
            for (i = 0; i < whole; i += 8)
                _mm256_storeu_ps(sum + i, _mm256_add_ps(_mm256_loadu_ps(sum + i), load8_f16(source + i)));
            for (; i < m; i++) sum[i] += load_f16(source[i]);
        }
        uint16_t *target = out + start;
        for (i = 0; i < whole; i += 8) {
            __m256 mean = _mm256_div_ps(_mm256_loadu_ps(sum + i), divisors);
            __m128i half = _mm256_cvtps_ph(mean, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            _mm_storeu_si128((__m128i *)(target + i), half);
            /* NaN, Inf and overflow all round to an all-ones exponent */
            bad = _mm_or_si128(bad, _mm_cmpeq_epi16(_mm_and_si128(half, exponent), exponent));
        }
        for (; i < m; i++) {
            uint16_t half = _cvtss_sh(sum[i] / divisor, _MM_FROUND_TO_NEAREST_INT);
            target[i] = half;
            bad_tail |= (half & 0x7C00u) == 0x7C00u;
        }
    }
    return bad_tail || !_mm_testz_si128(bad, bad);
}

/* The weighted loop's conversions for fp16, eight elements at a time with F16C. */
F16C_TARGET static const double *load_block_f16(const uint16_t *source, int64_t m, double *x) {
    int64_t i = 0;
    for (; i + 8 <= m; i += 8) {
        __m256 v = load8_f16(source + i);
        _mm256_storeu_pd(x + i, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
        _mm256_storeu_pd(x + i + 4, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
    }
    for (; i < m; i++) x[i] = load_f16(source[i]);
    return x;
}

F16C_TARGET static inline void write_f16(double value, uint16_t *target) {
    *target = _cvtss_sh(to_odd(value), _MM_FROUND_TO_NEAREST_INT);
}

/* The fp32 pass's conversions for fp16 (exact), eight elements at a time. */
F16C_TARGET static const float *load_block32_f16(const uint16_t *source, int64_t m, float *x) {
    int64_t i = 0;
    for (; i + 8 <= m; i += 8) _mm256_storeu_ps(x + i, load8_f16(source + i));
    for (; i < m; i++) x[i] = load_f16(source[i]);
    return x;
}

F16C_TARGET DEFINE_SUMS32(f16, uint16_t, load_block32_f16, f32, float)
F16C_TARGET DEFINE_WEIGHTED(ckptavg_weighted_f16, uint16_t, 11, -14, load_block_f16, f64, uint16_t, b16, load_f16, write_f16,
                            f16, uint16_t, double, 1, sums32_f16, fast32_f16)

int ckptavg_f16_available(void) {
    unsigned int eax, ebx, ecx, edx;
    __builtin_cpu_init();
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx & bit_F16C)) return 0;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#else
int ckptavg_f16_available(void) { return 0; }
#endif
