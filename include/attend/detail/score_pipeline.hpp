// SPDX-License-Identifier: MIT
#pragma once
/// The score pipeline of the tiled kernels, forward and backward: the one place that turns a tile of dot products
/// into the scores the softmax sees, and the one online-softmax state that streams those scores. A new score
/// modifier (soft-capping, a user's score function) goes into score_pipeline::finish_tile, and its derivative
/// into the one place the backward turns dP into dS (tiled_backward.hpp, score_gradient); nothing else in the
/// kernels needs to change.
///
/// The reference kernels (reference_kernel.hpp, reference_backward.hpp) do not use this file: they are the oracle
/// the tiled kernels are tested against, so they stay written out on their own.
///
/// Storage and accumulation. Inputs and outputs are stored in a storage type; everything here (scores,
/// probabilities, running max and sum, accumulators) is in the accumulation type accumulator_t<Storage> (tensor.hpp):
/// float for float, Eigen::half and Eigen::bfloat16 storage, double for double.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include "../score_bias.hpp"
#include "../shape.hpp"
#include "kernel_interface.hpp"
#include "mask_nodes.hpp"
#include "memory.hpp"
#include "micro_kernel.hpp"
#include "widen.hpp"

namespace attend::detail {

/// A contiguous run of scores as an Eigen array, for Eigen's vectorized reductions.
template <class T>
Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>> row_array(T* x, index_t n) {
    return Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>>(x, n);
}
template <class T>
Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>> row_array(const T* x, index_t n) {
    return Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>(x, n);
}

/// The largest of x[0, n), n >= 1, by std::max's rule for NaN (a NaN already in the running maximum stays, one met
/// later is passed over): four packets of running maxima side by side, reduced in registers, the last elements one
/// by one. Eigen's maxCoeff took an unaligned row's head element by element through memory, which was half of the
/// online softmax's own time in an fp32 prefill (perf annotate).
template <class T>
T max_of(const T* x, index_t n) {
    using namespace Eigen::internal;
    using packet = typename packet_traits<T>::type;
    constexpr index_t lanes = packet_traits<T>::size;
    T m = x[0];
    index_t j = 0;
    if (n >= lanes) {
        packet a = ploadu<packet>(x), b = a, c = a, d = a;
        for (j = lanes; j + 4 * lanes <= n; j += 4 * lanes) {
            a = pmax(a, ploadu<packet>(x + j));
            b = pmax(b, ploadu<packet>(x + j + lanes));
            c = pmax(c, ploadu<packet>(x + j + 2 * lanes));
            d = pmax(d, ploadu<packet>(x + j + 3 * lanes));
        }
        for (; j + lanes <= n; j += lanes) a = pmax(a, ploadu<packet>(x + j));
        m = predux_max(pmax(pmax(a, b), pmax(c, d)));
    }
    for (; j < n; ++j) m = std::max(m, x[j]);
    return m;
}

/// exp of a packet of float, for the softmax: its arguments are a score minus its row's maximum or lse, so at
/// most a rounding above 0. x is clamped to [ln FLT_MIN, ln FLT_MAX] (from above only on AVX-512) and reduced as
/// x = n ln 2 / s + r, |r| <= ln 2 / 2s (Cody-Waite: ln 2 / s in two parts, n times the first exact);
/// exp(x) = 2^k 2^(j / s) exp(r) for n = s k + j (k in [-126, 128]; +inf for 128).
/// - AVX-512 (s = 16): 2^(j / 16) from a 16-entry table in a register (one permute), exp(r) - 1 as r + r^2 / 2 +
///   r^3 / 6 (|r| <= 0.022), and 2^(j / 16) exp(r) as one multiply-add: seven multiply-adds or multiplies a packet
///   against the polynomial's eleven, about a fifth less time (Zen 5). Times 2^k by scalef, whose mask also
///   zeroes the results below ln FLT_MIN, in five instructions fewer a packet than the exponent field's multiply
///   and an and-not: 0.97 to 0.98 of a non-causal prefill's time (Zen 5, alternated). The same bits for every float
///   argument but those from 88.7012 to ln FLT_MAX, whose exp the exponent field made +inf (k = 128) and scalef
///   gives finite and correctly rounded (a check over all 2^32 floats).
/// - Elsewhere (s = 1): Cephes' degree-7 polynomial for exp(r) (the one Eigen's float exp uses), times 2^k written
///   into an exponent field directly.
/// Eigen's pexp scales by a general ldexp instead (four multiplies and eight integer operations for any m), which
/// was half of its cost. Within 2 ulp of exp from ln FLT_MIN to 88.37 (micro_kernel_test, half a million floats
/// through that range and every float near its ends), +inf only above it (where exp is within a factor of 1.25 of
/// FLT_MAX; on AVX-512 only past ln FLT_MAX, where exp overflows), exactly 0 below ln FLT_MIN (no subnormal
/// results: a result at k = -126 is at least 2^-126) and for -inf, exactly 1 at 0, NaN kept. (The integer packet's
/// vector attributes are not part of the types it is a template argument of, which GCC warns about, as in
/// transpose_square.)
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wignored-attributes"
#endif
/// NotAboveHighest: the caller knows no argument exceeds ln FLT_MAX (a softmax's scores minus their own row's
/// maximum are at most 0), so the upper clamp, which changes only arguments above it, is left out: the same bits with
/// one vector instruction fewer of the packet's 14 (AVX-512).
template <bool NotAboveHighest = false>
class packet_exp {
public:
    using value = Eigen::internal::packet_traits<float>::type;

    value operator()(const value& x) const {
        using namespace Eigen::internal;
#if defined(EIGEN_VECTORIZE_AVX512)
        // Below ln FLT_MIN and -inf: 0 through the last instruction's zero-masking (NaN compares unordered: kept).
        // Only the upper clamp: what the lower one kept finite is zeroed anyway.
        const __mmask16 kept = _mm512_cmp_ps_mask(x, pset1<value>(lowest), _CMP_NLT_UQ);
        if constexpr (NotAboveHighest) return by_table(x, kept);
        return by_table(_mm512_min_ps(pset1<value>(highest), x), kept);  // min returns x, its second operand, for NaN
#else
        value xc = pmax(x, pset1<value>(lowest));  // std::max order: NaN kept
        if constexpr (!NotAboveHighest) xc = pmin(xc, pset1<value>(highest));
        return pandnot(by_polynomial(xc), pcmp_lt(x, pset1<value>(lowest)));  // below ln FLT_MIN and -inf: 0
#endif
    }

private:
    static constexpr float lowest = -87.3365402f;  // ln FLT_MIN, rounded up: exp of it is at least FLT_MIN
    static constexpr float highest = 88.7228394f;  // ln FLT_MAX: 2^k is at most 2^128, which is +inf

    /// t = offset + x / ln 2 rounded to a multiple of 1 / s, for offset = 1.5 * 2^23 / s (t's ulp is 1 / s): t - offset
    /// is n / s = k + j / s, and t's low mantissa bits hold n.
    static value rounded(const value& x, float offset) {
        return Eigen::internal::pmadd(x, Eigen::internal::pset1<value>(1.44269502f),
                                      Eigen::internal::pset1<value>(offset));
    }

#if defined(EIGEN_VECTORIZE_AVX512)
    /// s = 16: t - magic16 is scalef's operand as it is (k + j / 16, whose floor is k), and t's low 4 bits are j.
    /// Where n itself was rounded (magic 1.5 * 2^23, x times 16 / ln 2) it took a multiply by 1 / 16 more; every
    /// float's exp has the bits it had then (checked over all 2^32 floats).
    static constexpr float magic16 = 786432.0f;

    static value by_table(const value& xc, __mmask16 kept) {
        using namespace Eigen::internal;
        const value t = rounded(xc, magic16);
        const value m = psub(t, pset1<value>(magic16));  // n / 16
        // ln 2 in two parts, the first of 12 bits: m has at most 12 bits too, so m times it is exact. The products
        // are those of n and ln 2 / 16's parts, so r has the bits it had with n.
        value r = pmadd(m, pset1<value>(-0.693115234375f), xc);
        r = pmadd(m, pset1<value>(-3.19461833e-5f), r);
        const value q = pmul(pmadd(pmadd(r, pset1<value>(1.0f / 6.0f), pset1<value>(0.5f)), r, pset1<value>(1.0f)), r);
        // 2^(j / 16), j = t's low 4 bits, which the permute reads from each lane's index.
        const value powers = _mm512_setr_ps(1.0f, 1.04427373f, 1.09050775f, 1.13878858f, 1.18920708f, 1.24185777f,
                                            1.29683959f, 1.35425556f, 1.41421354f, 1.47682619f, 1.54221082f,
                                            1.61049032f, 1.68179286f, 1.75625217f, 1.83400810f, 1.91520655f);
        const value fraction = _mm512_permutexvar_ps(_mm512_castps_si512(t), powers);
        // times 2^k, k = floor(n / 16): scalef multiplies by 2 to the floor of its second operand (one instruction
        // for an exponent field's shifts, add and multiply, and the zeroing below ln FLT_MIN in its mask).
        return _mm512_maskz_scalef_ps(kept, pmadd(fraction, q, fraction), m);
    }
#else
    using integer = typename Eigen::internal::unpacket_traits<value>::integer_packet;
    static constexpr float magic = 12582912.0f;  // s = 1

    /// 2^n for n in t's bits (s = 1): the magic's bits are a multiple of 2^22, so the low 9 bits of n + 127 are n's
    /// biased exponent in [1, 255].
    static value power_of_two(const value& t) {
        using namespace Eigen::internal;
        return preinterpret<value>(plogical_shift_left<23>(padd(preinterpret<integer>(t), pset1<integer>(127))));
    }

    static value by_polynomial(const value& xc) {
        using namespace Eigen::internal;
        const value t = rounded(xc, magic);
        const value m = psub(t, pset1<value>(magic));
        value r = pmadd(m, pset1<value>(-0.693359375f), xc);  // ln 2 in two parts: m times the first is exact
        r = pmadd(m, pset1<value>(2.12194440e-4f), r);
        const value r2 = pmul(r, r);
        value y = pmadd(r, pset1<value>(1.9875691500e-4f), pset1<value>(1.3981999507e-3f));
        y = pmadd(y, r, pset1<value>(8.3334519073e-3f));
        y = pmadd(y, r, pset1<value>(4.1665795894e-2f));
        y = pmadd(y, r, pset1<value>(1.6666665459e-1f));
        y = pmadd(y, r, pset1<value>(5.0000001201e-1f));
        y = padd(pmadd(y, r2, r), pset1<value>(1.0f));
        return pmul(y, power_of_two(t));
    }
#endif
};
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

/// x[j] = exp(x[j] - shift) on a contiguous run, exactly 0 where x[j] is -inf (a forbidden key) and where the
/// result would be subnormal (below 1e-38 in float next to a row maximum of 1: no effect on any sum, and it keeps
/// subnormals, which are slow on many cores, out of the products), NaN kept; returns the sum of the results, the
/// online softmax's inner step in one pass. Float a packet at a time through packet_exp, two independent packets
/// per step; double through Eigen's vectorized exp (which on its own returns a tiny positive number, not 0, for -inf);
/// the last few elements through std::exp, so an element's result depends on its position in the run only, in every
/// caller.
/// NoneAboveShift: the caller knows no x[j] exceeds shift (shift is their row's maximum), so packet_exp leaves out its
/// upper clamp (the same bits).
template <class T, bool NoneAboveShift = false>
T exp_shifted_sum(T* x, index_t n, T shift) {
    using namespace Eigen::internal;
    using packet = typename packet_traits<T>::type;
    constexpr index_t lanes = packet_traits<T>::size;
    constexpr T tiny = std::numeric_limits<T>::min();
    const packet by = pset1<packet>(shift);
    packet sums = pset1<packet>(T(0));
    index_t j = 0;
    if constexpr (std::is_same_v<T, float>) {
        const packet_exp<NoneAboveShift> exp;
        packet more = sums;
        for (; j + 2 * lanes <= n; j += 2 * lanes) {
            const packet a = exp(psub(ploadu<packet>(x + j), by));
            const packet b = exp(psub(ploadu<packet>(x + j + lanes), by));
            pstoreu(x + j, a);
            pstoreu(x + j + lanes, b);
            sums = padd(sums, a);
            more = padd(more, b);
        }
        for (; j + lanes <= n; j += lanes) {
            const packet a = exp(psub(ploadu<packet>(x + j), by));
            pstoreu(x + j, a);
            sums = padd(sums, a);
        }
        sums = padd(sums, more);
    } else {
        const packet smallest = pset1<packet>(tiny);
        for (; j + lanes <= n; j += lanes) {
            packet e = pexp(psub(ploadu<packet>(x + j), by));
            e = pandnot(e, pcmp_lt(e, smallest));  // e < tiny: 0 (NaN compares false and stays)
            pstoreu(x + j, e);
            sums = padd(sums, e);
        }
    }
    T sum = predux(sums);
    for (; j < n; ++j) {
        const T e = std::exp(x[j] - shift);
        x[j] = e < tiny ? T(0) : e;
        sum += x[j];
    }
    return sum;
}

/// exp_shifted_sum without the sum.
template <class T, bool NoneAboveShift = false>
void exp_shifted(T* x, index_t n, T shift) {
    exp_shifted_sum<T, NoneAboveShift>(x, n, shift);
}

/// c tanh(s / c) on a packet of float scores s, as s P(y) / Q(y) for y = (s / c)^2: P and Q of degree 4 are a
/// minimax fit of tanh(t) / t for t in [0, 9] (relative error 2e-8 before rounding; within four epsilons of tanh
/// in float, tests/support/soft_cap_check.hpp), and s is clamped to +-9 c, where tanh rounds to +-1. NaN is kept.
/// For caps in [2^-20, 2^20] (folds()) the powers of c go into the coefficients: c^4 P(s^2 / c^2) and
/// c^4 Q(s^2 / c^2) are polynomials in s^2, so a packet takes one multiply for s^2, eight multiply-adds, a division
/// and the multiply by s, where dividing by c first took two more multiplies. Other caps (Prescale) scale s by
/// an exact power of two for y alone, which brings the folded cap into [1, 2): one multiply more, and s itself
/// is not scaled, so a score far below a huge cap keeps its precision. Every capped float score goes through this
/// one functor (the micro-kernel's epilogue, soft_cap's runs and their tails), so a score gets the same bits on
/// every path.
template <bool Prescale>
class capped_tanh_packets {
public:
    using value = Eigen::internal::packet_traits<float>::type;

    /// Whether a cap is folded into the coefficients whole: the coefficients and s^2 stay normal floats.
    static bool folds(float cap) { return cap >= 0x1p-20f && cap <= 0x1p20f; }

    explicit capped_tanh_packets(float cap) {
        using Eigen::internal::pset1;
        int e = 0;
        if constexpr (Prescale) {
            (void)std::frexp(cap, &e);  // cap = m 2^e, m in [0.5, 1)
            e = std::max(e - 1, -126);  // cap 2^-e in [1, 2) (in (0, 1) for subnormal caps)
            prescale_ = pset1<value>(std::ldexp(1.0f, -e));
        }
        const double folded = std::ldexp(static_cast<double>(cap), -e), c2 = folded * folded;
        const double powers[5] = {c2 * c2, c2, 1, 1 / c2, 1 / (c2 * c2)};  // c^(4 - 2k) for the coefficient of y^k
        for (int k = 0; k < 5; ++k) {
            p_[k] = pset1<value>(static_cast<float>(numerator[k] * powers[k]));
            q_[k] = pset1<value>(static_cast<float>(denominator[k] * powers[k]));
        }
        const float high =
            static_cast<float>(std::min(9.0 * cap, static_cast<double>(std::numeric_limits<float>::max())));
        high_ = pset1<value>(high);
        low_ = pset1<value>(-high);
    }

    value operator()(const value& s) const {
        using namespace Eigen::internal;
        const value x = pmax(pmin(s, high_), low_);
        value u;
        if constexpr (Prescale) {
            const value t = pmul(x, prescale_);
            u = pmul(t, t);
        } else {
            u = pmul(x, x);
        }
        value p = pmadd(u, p_[4], p_[3]);
        value q = pmadd(u, q_[4], q_[3]);
        for (int k = 2; k >= 0; --k) {
            p = pmadd(u, p, p_[k]);
            q = pmadd(u, q, q_[k]);
        }
        // P / Q first, near 1 for small s, so s of the smallest normal sizes keeps its precision.
        return pmul(x, pdiv(p, q));
    }

private:
    static constexpr double numerator[5] = {0.9999999794516959, 0.1338102414834552, 0.0034955863811417013,
                                            2.0609054260806343e-05, 1.3354623462635828e-08};
    static constexpr double denominator[5] = {1.0, 0.4671433973930515, 0.02587697549616153, 0.000328563199538041,
                                              7.776542576103107e-07};
    value high_, low_, prescale_{};
    value p_[5], q_[5];
};

/// The functor of the caps that fold, the only one the micro-kernel's epilogue takes.
using capped_tanh = capped_tanh_packets<false>;

/// f on every packet of a contiguous run of float scores, in place: two packets at a time (two independent
/// chains: the polynomials are long), the tail through a packet-sized buffer.
template <class F>
void cap_runs(float* x, index_t n, const F& f) {
    using packet = typename F::value;
    using Eigen::internal::ploadu;
    using Eigen::internal::pstoreu;
    constexpr index_t lanes = Eigen::internal::packet_traits<float>::size;
    index_t j = 0;
    for (; j + 2 * lanes <= n; j += 2 * lanes) {
        const packet a = f(ploadu<packet>(x + j));
        const packet b = f(ploadu<packet>(x + j + lanes));
        pstoreu(x + j, a);
        pstoreu(x + j + lanes, b);
    }
    for (; j + lanes <= n; j += lanes) pstoreu(x + j, f(ploadu<packet>(x + j)));
    if (j < n) {
        float tail[lanes] = {};
        std::copy(x + j, x + n, tail);
        pstoreu(tail, f(ploadu<packet>(tail)));
        std::copy(tail, tail + (n - j), x + j);
    }
}

/// Soft-capping c tanh(s / c) of a contiguous run of scores, in place: float through capped_tanh_packets;
/// double through Eigen's (scalar, exact to the last bit or so) tanh and the two scalings.
template <class T>
void soft_cap(T* x, index_t n, T cap) {
    if constexpr (std::is_same_v<T, float>) {
        if (capped_tanh::folds(cap)) cap_runs(x, n, capped_tanh(cap));
        else cap_runs(x, n, capped_tanh_packets<true>(cap));
    } else {
        auto a = row_array(x, n);
        a = (a * (T(1) / cap)).tanh() * cap;
    }
}

/// From dot products to scores, in this order: scale (folded into one GEMM operand by the kernels), soft-capping,
/// the user's score_mod, score_bias, mask. Both tiled kernels call finish_tile on every tile they compute, so
/// forward, backward and the weights pass see the same bits.
template <class Acc>
class score_pipeline {
public:
    score_pipeline(const attention_shape& s, const mask_tiles& mask, const kernel_params<Acc>& p)
        : mask_(mask),
          bias_(p.bias && !p.bias->empty() ? p.bias : nullptr),
          mod_(p.score_mod),
          scale_(p.scale),
          softcap_(p.softcap),
          query_len_(s.query_len),
          key_len_(s.key_len) {}

    /// The scale, applied once to the operand the kernel packs (queries forward, keys backward), not per score.
    Acc scale() const { return scale_; }
    bool has_bias() const { return bias_ != nullptr; }
    /// Whether the scores pass through a modifier whose derivative is not 1 (see finish_tile's `slope`).
    bool modifies_scores() const { return softcap_ > 0 || mod_ != nullptr; }

    /// Runs `products(epilogue)`, a tile's dot products through the micro-kernel (scores_from_panels), with the
    /// epilogue it applies to each packet before storing it: for float scores with a cap that folds, the cap, so
    /// capping costs no pass over the tile; otherwise nothing (finish_tile caps). Returns whether the products came
    /// out capped, which finish_tile is then told.
    template <class Products>
    bool products_with_cap(Products&& products) const {
        if constexpr (std::is_same_v<Acc, float>)
            if (softcap_ > 0 && capped_tanh::folds(softcap_)) {
                products(capped_tanh(softcap_));
                return true;
            }
        products(micro::keep_products{});
        return false;
    }

    /// Scores `[t.query_end - t.query_begin, t.key_end - t.key_begin]` at `scores` (row stride ld) hold the
    /// scaled dot products of one head's tile `t` of class `c` (the mask's classify(t)), already soft-capped if
    /// `capped` (products_with_cap); afterwards they hold the scores: capped, bias added, forbidden entries -inf
    /// (all of them for an empty tile, none for a full one). With `slope` (same layout), the backward also gets
    /// d score / d dot product of the modifiers there (only when modifies_scores()).
    void finish_tile(const tile& t, tile_class c, Acc* scores, index_t ld, bool capped, Acc* slope = nullptr) const {
        const index_t rows = t.query_end - t.query_begin, cols = t.key_end - t.key_begin;
        if (c == tile_class::empty) {
            for (index_t r = 0; r < rows; ++r)
                std::fill(scores + r * ld, scores + r * ld + cols, minus_infinity<Acc>());
            return;
        }
        if (softcap_ > 0)
            for (index_t r = 0; r < rows; ++r) {
                // c tanh(s / c); for the backward its derivative 1 - tanh^2, from the capped score itself, so the
                // forward and the backward see the same scores.
                if (!capped) soft_cap(scores + r * ld, cols, softcap_);
                if (slope)
                    row_array(slope + r * ld, cols) = Acc(1) - (row_array(scores + r * ld, cols) / softcap_).square();
            }
        if (mod_) {  // the user's function; its derivative multiplies into the slope (1 without a cap)
            if (slope && softcap_ <= 0)
                for (index_t r = 0; r < rows; ++r) std::fill(slope + r * ld, slope + r * ld + cols, Acc(1));
            mod_->apply(t, scores, ld, slope);
        }
        if (bias_) bias_->add_tile(t.head, t.query_begin, t.key_begin, rows, cols, query_len_, key_len_, scores, ld);
        if (c == tile_class::mixed) mask_.apply(t, scores, ld);
    }

    /// d loss / d dot product from d loss / d score in place, `grad` times the `slope` finish_tile gave (layout
    /// as finish_tile's scores); a no-op without score modifiers. Bias and mask have derivative 1.
    void to_dot_product_gradient(index_t rows, index_t cols, Acc* grad, const Acc* slope, index_t ld) const {
        if (!modifies_scores()) return;
        for (index_t r = 0; r < rows; ++r) row_array(grad + r * ld, cols) *= row_array(slope + r * ld, cols);
    }

    /// Adds the tile's score gradient `grad` (layout as finish_tile's scores) to the bias gradient of its head,
    /// one sum per key - query diagonal: `diagonals` holds `[query_len + key_len - 1]`, entry n for
    /// key - query = n - (query_len - 1).
    void add_bias_gradient(const tile& t, const Acc* grad, index_t ld, Acc* diagonals) const {
        const index_t rows = t.query_end - t.query_begin, cols = t.key_end - t.key_begin;
        for (index_t r = 0; r < rows; ++r) {
            Acc* diagonal = diagonals + (t.key_begin - t.query_begin - r + query_len_ - 1);
            const Acc* g = grad + r * ld;
            for (index_t j = 0; j < cols; ++j) diagonal[j] += g[j];
        }
    }

private:
    const mask_tiles& mask_;
    const score_bias* bias_ = nullptr;
    const score_tiles* mod_ = nullptr;
    Acc scale_ = 1;
    Acc softcap_ = 0;
    index_t query_len_ = 0, key_len_ = 0;
};

/// The online softmax of a block of rows (FlashAttention-2): per row a running max m, a running sum l of
/// exp(score - m) and, kept by the caller, an accumulator of exp(score - m) V that is rescaled by exp(m_old - m)
/// whenever m grows. Rows whose keys were all forbidden so far have m = -inf and contribute nothing.
template <class Acc>
class online_softmax {
public:
    online_softmax() = default;
    explicit online_softmax(index_t rows)
        : max_(static_cast<std::size_t>(rows)),
          sum_(static_cast<std::size_t>(rows)),
          new_max_(static_cast<std::size_t>(rows)),
          rescale_(static_cast<std::size_t>(rows)) {}

    /// Rows [0, rows): m = -inf, l = 0.
    void reset(index_t rows) {
        std::fill(max_.begin(), max_.begin() + rows, minus_infinity<Acc>());
        std::fill(sum_.begin(), sum_.begin() + rows, Acc(0));
    }

    /// One tile of scores for rows [r0, r0 + rows) (row r at scores + (r - r0) * ld, nk keys): turns them into
    /// exp(score - new max) in place (all 0 for a row with nothing allowed yet), rescales that row of `acc`
    /// (contiguous rows of dv values) by exp(old max - new max) and updates m and l. `then(r, row)` runs on each
    /// row's probabilities right after them, while the row is still in L1 (dropout, the pair path's rounding to
    /// bf16: one pass over a tile from L2 fewer). The caller then multiplies the probabilities by V into acc.
    template <class Then>
    void absorb(Acc* scores, index_t ld, index_t r0, index_t rows, index_t nk, Acc* acc, index_t dv, const Then& then) {
        // New running max per row, and the rescale factor exp(old max - new max) for all rows in one vectorized
        // exp: exp(-inf) = 0 when the row had no allowed key before; exp(0) = 1 when the max stays. (A row at a
        // time, its maximum and exponentials while it is in L1, took 1.09 x the time of a bf16 prefill on
        // Emerald Rapids: each row's exponentials then wait for its maximum's reduction.)
        for (index_t r = 0; r < rows; ++r) {
            const auto u = static_cast<std::size_t>(r0 + r);
            const Acc tile_max = max_of(scores + r * ld, nk);
            const Acc m = max_[u];
            new_max_[u] = std::max(m, tile_max);
            rescale_[u] = m == minus_infinity<Acc>() ? minus_infinity<Acc>() : m - new_max_[u];
        }
        exp_shifted<Acc, true>(rescale_.data() + r0, rows, Acc(0));  // old max - new max: at most 0
        for (index_t r = 0; r < rows; ++r) {
            const auto u = static_cast<std::size_t>(r0 + r);
            Acc* row = scores + r * ld;
            const Acc m_new = new_max_[u];
            if (m_new == minus_infinity<Acc>()) {  // nothing allowed so far: no contribution
                std::fill(row, row + nk, Acc(0));
                then(r0 + r, row);
                continue;
            }
            const Acc row_sum = exp_shifted_sum<Acc, true>(row, nk, m_new);  // m_new: at least every score of the row
            then(r0 + r, row);
            const Acc alpha = rescale_[u];
            if (alpha != Acc(1)) row_array(acc + r * dv, dv) *= alpha;
            sum_[u] = alpha * sum_[u] + row_sum;
            max_[u] = m_new;
        }
    }

    /// Row r's sink logit z (sinks.hpp) as one more score whose value row is zero: m = max(m, z), the row's
    /// accumulator (dv values at acc) rescaled by exp(m_old - m), l = l exp(m_old - m) + exp(z - m). Absorbed once
    /// per row, by the pass over the first key range, so a split over keys counts it once. Afterwards the row is
    /// never empty: a row whose keys are all forbidden has all its mass on the sink, out 0 and lse z.
    void absorb_sink(index_t r, Acc z, Acc* acc, index_t dv) {
        const auto u = static_cast<std::size_t>(r);
        const Acc m = max_[u];
        if (m == minus_infinity<Acc>() || z > m) {
            const Acc alpha = m == minus_infinity<Acc>() ? Acc(0) : std::exp(m - z);
            row_array(acc, dv) *= alpha;
            sum_[u] = alpha * sum_[u] + Acc(1);
            max_[u] = z;
        } else {
            sum_[u] += std::exp(z - m);
        }
    }

    /// Row r has no probability mass: every key forbidden (or every weight underflowed to 0).
    bool empty(index_t r) const {
        return max_[static_cast<std::size_t>(r)] == minus_infinity<Acc>() || !(sum_[static_cast<std::size_t>(r)] > 0);
    }
    Acc max(index_t r) const { return max_[static_cast<std::size_t>(r)]; }
    Acc sum(index_t r) const { return sum_[static_cast<std::size_t>(r)]; }
    /// log sum exp of the row's scores; only for rows that are not empty.
    Acc lse(index_t r) const { return max(r) + std::log(sum(r)); }
    /// Marks row r empty (a padded query), so later passes see a zero row.
    void clear(index_t r) { max_[static_cast<std::size_t>(r)] = minus_infinity<Acc>(); }

    /// Writes row r's normalized result acc / l into `out` (dv values, converted to the storage type once) and
    /// returns its lse; a zero row and -inf for an empty row.
    template <class Storage>
    Acc normalize_into(index_t r, const Acc* acc, index_t dv, Storage* out) const {
        if (empty(r)) {
            std::fill(out, out + dv, Storage(0));
            return minus_infinity<Acc>();
        }
        const Acc l = sum(r);
        // Straight into out when it holds Acc (through the runs below, a 256-token fp32 prefill took 1.008 of the
        // time); otherwise divided in Acc and rounded a run at a time (narrow: in registers where the target can).
        if constexpr (std::is_same_v<Storage, Acc>) {
            for (index_t d = 0; d < dv; ++d) out[d] = acc[d] / l;
        } else {
            constexpr index_t run = 64;
            Acc quotient[run];
            for (index_t d0 = 0; d0 < dv; d0 += run) {
                const index_t n = std::min(run, dv - d0);
                for (index_t d = 0; d < n; ++d) quotient[d] = acc[d0 + d] / l;
                narrow(quotient, n, out + d0);
            }
        }
        return lse(r);
    }

private:
    aligned_vector<Acc> max_;      ///< [rows] m
    aligned_vector<Acc> sum_;      ///< [rows] l
    aligned_vector<Acc> new_max_;  ///< [rows] m after the current tile
    aligned_vector<Acc> rescale_;  ///< [rows] exp(m_old - m_new)
};

}  // namespace attend::detail
