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

namespace attend::detail {

/// A contiguous run of scores as an Eigen array, for Eigen's vectorized reductions.
template <class T>
Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>> row_array(T* x, index n) {
    return Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>>(x, n);
}
template <class T>
Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>> row_array(const T* x, index n) {
    return Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>(x, n);
}

/// exp of a packet of float, for the softmax: its arguments are a score minus its row's maximum or lse, so at
/// most a rounding above 0. Cody-Waite reduction x = m ln 2 + r with |r| <= ln 2 / 2, Cephes' degree-7 polynomial
/// for exp(r) (the one Eigen's float exp uses) and 2^m written into an exponent field directly: x is clamped to
/// [ln FLT_MIN, ln FLT_MAX], so m lies in [-126, 128] and 2^m is one float (+inf for m = 128) and one multiply.
/// Eigen's pexp scales by a general ldexp instead (four multiplies and eight integer operations for any m), which
/// was half of its cost; this is about 20 operations a packet against 35.
/// Within 2 ulp of exp from ln FLT_MIN to 88.37 (micro_kernel_test, half a million floats through that range and
/// every float near its ends), +inf above it (where exp is within a factor of 1.25 of FLT_MAX), exactly 0 below
/// ln FLT_MIN (no subnormal results) and for -inf, NaN kept. (The integer packet's vector attributes are not part of
/// the types it is a template argument of, which GCC warns about, as in transpose_square.)
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wignored-attributes"
#endif
class packet_exp {
public:
    using value = Eigen::internal::packet_traits<float>::type;

    value operator()(const value& x) const {
        using namespace Eigen::internal;
        using integer = typename unpacket_traits<value>::integer_packet;
        const value xc = pmin(pmax(x, pset1<value>(lowest)), pset1<value>(highest));  // std::max order: NaN kept
        // t = 1.5 * 2^23 + round(x / ln 2): the integer m sits in t's low mantissa bits.
        const value magic = pset1<value>(12582912.0f);
        const value t = pmadd(xc, pset1<value>(1.44269504088896341f), magic);
        const value m = psub(t, magic);
        value r = pmadd(m, pset1<value>(-0.693359375f), xc);  // ln 2 in two parts: m times the first is exact
        r = pmadd(m, pset1<value>(2.12194440e-4f), r);
        const value r2 = pmul(r, r);
        value y = pmadd(r, pset1<value>(1.9875691500e-4f), pset1<value>(1.3981999507e-3f));
        y = pmadd(y, r, pset1<value>(8.3334519073e-3f));
        y = pmadd(y, r, pset1<value>(4.1665795894e-2f));
        y = pmadd(y, r, pset1<value>(1.6666665459e-1f));
        y = pmadd(y, r, pset1<value>(5.0000001201e-1f));
        y = padd(pmadd(y, r2, r), pset1<value>(1.0f));
        // 2^m: (m + 127) in the exponent field; the low 9 bits of t's bits plus 127 are m + 127 in [1, 255].
        const integer biased = padd(preinterpret<integer>(t), pset1<integer>(127));
        const value e = pmul(y, preinterpret<value>(plogical_shift_left<23>(biased)));
        return pandnot(e, pcmp_lt(x, pset1<value>(lowest)));  // below ln FLT_MIN and -inf: 0 (NaN compares false)
    }

private:
    static constexpr float lowest = -87.3365402f;  // ln FLT_MIN, rounded up: exp of it is at least FLT_MIN
    static constexpr float highest = 88.7228394f;  // ln FLT_MAX: 2^m is at most 2^128, which is +inf
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
template <class T>
T exp_shifted_sum(T* x, index n, T shift) {
    using namespace Eigen::internal;
    using packet = typename packet_traits<T>::type;
    constexpr index lanes = packet_traits<T>::size;
    constexpr T tiny = std::numeric_limits<T>::min();
    const packet by = pset1<packet>(shift);
    packet sums = pset1<packet>(T(0));
    index j = 0;
    if constexpr (std::is_same_v<T, float>) {
        const packet_exp exp;
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
template <class T>
void exp_shifted(T* x, index n, T shift) {
    exp_shifted_sum(x, n, shift);
}

/// c tanh(s / c) on a packet of float scores s: Eigen's rational tanh for float (generic_fast_tanh_float, within
/// 3e-7 of tanh) with the cap folded in, c tanh(s / c) = s P(y) / Q(y) for y = (s / c)^2, so one pass does the
/// work of the two scalings and the tanh. Clamped where tanh rounds to +-1, NaN kept. Every capped float score
/// goes through this one function on whole packets (the micro-kernel's epilogue, soft_cap's runs and their tails),
/// so a score gets the same bits on every path.
class capped_tanh {
public:
    using value = Eigen::internal::packet_traits<float>::type;

    explicit capped_tanh(float cap)
        : high_(Eigen::internal::pset1<value>(clamp * cap)),
          low_(Eigen::internal::pset1<value>(-clamp * cap)),
          inverse_(Eigen::internal::pset1<value>(1 / cap)) {}

    value operator()(const value& s) const {
        using namespace Eigen::internal;
        const value x = pmax(pmin(s, high_), low_);
        const value t = pmul(x, inverse_), y = pmul(t, t);  // (s / c)^2 without squaring c, for any cap
        // Eigen's coefficients: numerator (odd, without its x) and denominator (even) in y = (s / c)^2.
        value p = pmadd(y, pset1<value>(-2.76076847742355e-16f), pset1<value>(2.00018790482477e-13f));
        p = pmadd(y, p, pset1<value>(-8.60467152213735e-11f));
        p = pmadd(y, p, pset1<value>(5.12229709037114e-08f));
        p = pmadd(y, p, pset1<value>(1.48572235717979e-05f));
        p = pmadd(y, p, pset1<value>(6.37261928875436e-04f));
        p = pmadd(y, p, pset1<value>(4.89352455891786e-03f));
        value q = pmadd(y, pset1<value>(1.19825839466702e-06f), pset1<value>(1.18534705686654e-04f));
        q = pmadd(y, q, pset1<value>(2.26843463243900e-03f));
        q = pmadd(y, q, pset1<value>(4.89352518554385e-03f));
        // P / Q first, near 1 for small s, so s of the smallest normal sizes keeps its precision; near 0,
        // P(0) / Q(0) = 1 - 1.3e-7 is about one ulp of s, so no branch to s itself as Eigen's tanh has.
        return pmul(x, pdiv(p, q));
    }

private:
#ifdef EIGEN_VECTORIZE_FMA  // where Eigen's own float tanh clamps, with and without FMA
    static constexpr float clamp = 7.99881172180175781f;
#else
    static constexpr float clamp = 7.90531110763549805f;
#endif
    value high_, low_, inverse_;
};

/// Soft-capping c tanh(s / c) of a contiguous run of scores, in place: float through capped_tanh, two packets at a
/// time, the tail through a packet-sized buffer; double through Eigen's (scalar, exact to the last bit or so) tanh
/// and the two scalings.
template <class T>
void soft_cap(T* x, index n, T cap) {
    if constexpr (std::is_same_v<T, float>) {
        using packet = capped_tanh::value;
        using Eigen::internal::ploadu;
        using Eigen::internal::pstoreu;
        constexpr index lanes = Eigen::internal::packet_traits<float>::size;
        const capped_tanh f(cap);
        index j = 0;
        for (; j + 2 * lanes <= n; j += 2 * lanes) {  // two independent chains: the polynomials are long
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
    } else {
        auto a = row_array(x, n);
        a = (a * (T(1) / cap)).tanh() * cap;
    }
}

/// From dot products to scores, in this order: scale (folded into one GEMM operand by the kernels), soft-capping,
/// the user's score_mod, score_bias, mask. Both tiled kernels call finish_tile on every tile they compute, so forward, backward and the
/// weights pass see the same bits.
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
    /// epilogue it applies to each packet before storing it: for float scores with a cap, the cap, so capping
    /// costs no pass over the tile; otherwise nothing. Returns whether the products came out capped, which
    /// finish_tile is then told.
    template <class Products>
    bool products_with_cap(Products&& products) const {
        if constexpr (std::is_same_v<Acc, float>)
            if (softcap_ > 0) {
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
    void finish_tile(const tile& t, tile_class c, Acc* scores, index ld, bool capped, Acc* slope = nullptr) const {
        const index rows = t.query_end - t.query_begin, cols = t.key_end - t.key_begin;
        if (c == tile_class::empty) {
            for (index r = 0; r < rows; ++r) std::fill(scores + r * ld, scores + r * ld + cols, minus_infinity<Acc>());
            return;
        }
        if (softcap_ > 0)
            for (index r = 0; r < rows; ++r) {
                // c tanh(s / c); for the backward its derivative 1 - tanh^2, from the capped score itself, so the
                // forward and the backward see the same scores.
                if (!capped) soft_cap(scores + r * ld, cols, softcap_);
                if (slope)
                    row_array(slope + r * ld, cols) = Acc(1) - (row_array(scores + r * ld, cols) / softcap_).square();
            }
        if (mod_) {  // the user's function; its derivative multiplies into the slope (1 without a cap)
            if (slope && softcap_ <= 0)
                for (index r = 0; r < rows; ++r) std::fill(slope + r * ld, slope + r * ld + cols, Acc(1));
            mod_->apply(t, scores, ld, slope);
        }
        if (bias_) bias_->add_tile(t.head, t.query_begin, t.key_begin, rows, cols, query_len_, key_len_, scores, ld);
        if (c == tile_class::mixed) mask_.apply(t, scores, ld);
    }

    /// d loss / d dot product from d loss / d score in place, `grad` times the `slope` finish_tile gave (layout
    /// as finish_tile's scores); a no-op without score modifiers. Bias and mask have derivative 1.
    void to_dot_product_gradient(index rows, index cols, Acc* grad, const Acc* slope, index ld) const {
        if (!modifies_scores()) return;
        for (index r = 0; r < rows; ++r) row_array(grad + r * ld, cols) *= row_array(slope + r * ld, cols);
    }

    /// Adds the tile's score gradient `grad` (layout as finish_tile's scores) to the bias gradient of its head,
    /// one sum per key - query diagonal: `diagonals` holds `[query_len + key_len - 1]`, entry n for
    /// key - query = n - (query_len - 1).
    void add_bias_gradient(const tile& t, const Acc* grad, index ld, Acc* diagonals) const {
        const index rows = t.query_end - t.query_begin, cols = t.key_end - t.key_begin;
        for (index r = 0; r < rows; ++r) {
            Acc* diagonal = diagonals + (t.key_begin - t.query_begin - r + query_len_ - 1);
            const Acc* g = grad + r * ld;
            for (index j = 0; j < cols; ++j) diagonal[j] += g[j];
        }
    }

private:
    const mask_tiles& mask_;
    const score_bias* bias_ = nullptr;
    const score_tiles* mod_ = nullptr;
    Acc scale_ = 1;
    Acc softcap_ = 0;
    index query_len_ = 0, key_len_ = 0;
};

/// The online softmax of a block of rows (FlashAttention-2): per row a running max m, a running sum l of
/// exp(score - m) and, kept by the caller, an accumulator of exp(score - m) V that is rescaled by exp(m_old - m)
/// whenever m grows. Rows whose keys were all forbidden so far have m = -inf and contribute nothing.
template <class Acc>
class online_softmax {
public:
    online_softmax() = default;
    explicit online_softmax(index rows)
        : max_(static_cast<std::size_t>(rows)),
          sum_(static_cast<std::size_t>(rows)),
          new_max_(static_cast<std::size_t>(rows)),
          rescale_(static_cast<std::size_t>(rows)) {}

    /// Rows [0, rows): m = -inf, l = 0.
    void reset(index rows) {
        std::fill(max_.begin(), max_.begin() + rows, minus_infinity<Acc>());
        std::fill(sum_.begin(), sum_.begin() + rows, Acc(0));
    }

    /// One tile of scores for rows [r0, r0 + rows) (row r at scores + (r - r0) * ld, nk keys): turns them into
    /// exp(score - new max) in place (all 0 for a row with nothing allowed yet), rescales that row of `acc`
    /// (contiguous rows of dv values) by exp(old max - new max) and updates m and l. The caller then multiplies the
    /// probabilities by V into acc.
    void absorb(Acc* scores, index ld, index r0, index rows, index nk, Acc* acc, index dv) {
        // New running max per row, and the rescale factor exp(old max - new max) for all rows in one vectorized
        // exp: exp(-inf) = 0 when the row had no allowed key before; exp(0) = 1 when the max stays.
        for (index r = 0; r < rows; ++r) {
            const auto u = static_cast<std::size_t>(r0 + r);
            const Acc tile_max = row_array(scores + r * ld, nk).maxCoeff();
            const Acc m = max_[u];
            new_max_[u] = std::max(m, tile_max);
            rescale_[u] = m == minus_infinity<Acc>() ? minus_infinity<Acc>() : m - new_max_[u];
        }
        exp_shifted(rescale_.data() + r0, rows, Acc(0));
        for (index r = 0; r < rows; ++r) {
            const auto u = static_cast<std::size_t>(r0 + r);
            Acc* row = scores + r * ld;
            const Acc m_new = new_max_[u];
            if (m_new == minus_infinity<Acc>()) {  // nothing allowed so far: no contribution
                std::fill(row, row + nk, Acc(0));
                continue;
            }
            const Acc row_sum = exp_shifted_sum(row, nk, m_new);
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
    void absorb_sink(index r, Acc z, Acc* acc, index dv) {
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
    bool empty(index r) const {
        return max_[static_cast<std::size_t>(r)] == minus_infinity<Acc>() || !(sum_[static_cast<std::size_t>(r)] > 0);
    }
    Acc max(index r) const { return max_[static_cast<std::size_t>(r)]; }
    Acc sum(index r) const { return sum_[static_cast<std::size_t>(r)]; }
    /// log sum exp of the row's scores; only for rows that are not empty.
    Acc lse(index r) const { return max(r) + std::log(sum(r)); }
    /// Marks row r empty (a padded query), so later passes see a zero row.
    void clear(index r) { max_[static_cast<std::size_t>(r)] = minus_infinity<Acc>(); }

    /// Writes row r's normalized result acc / l into `out` (dv values, converted to the storage type once) and
    /// returns its lse; a zero row and -inf for an empty row.
    template <class Storage>
    Acc normalize_into(index r, const Acc* acc, index dv, Storage* out) const {
        if (empty(r)) {
            std::fill(out, out + dv, Storage(0));
            return minus_infinity<Acc>();
        }
        const Acc l = sum(r);
        for (index d = 0; d < dv; ++d) out[d] = static_cast<Storage>(acc[d] / l);
        return lse(r);
    }

private:
    aligned_vector<Acc> max_;      ///< [rows] m
    aligned_vector<Acc> sum_;      ///< [rows] l
    aligned_vector<Acc> new_max_;  ///< [rows] m after the current tile
    aligned_vector<Acc> rescale_;  ///< [rows] exp(m_old - m_new)
};

}  // namespace attend::detail
