// SPDX-License-Identifier: MIT
/// Differential fuzzer of scaled_dot_product_attention and its backward.
///
/// One input decodes into a call: scalar type, rank, sizes (sometimes empty or inconsistent), a runtime mask
/// expression (fuzz_masks.hpp), options (soft-capping, sinks and a score_mod among them) and values (sometimes huge, tiny,
/// subnormal or non-finite). The call runs
/// through kernel::reference, kernel::tiled with the default tiles, and the tiled kernel with small random tiles
/// on 1 and 2 threads, and the fuzzer checks:
///   - every path throws the same attend::error id, or none does; empty_row errors agree with the mask's meaning,
///     score_overflow errors with the documented score-range rule (thrown exactly when it is broken);
///   - with finite inputs whose scores fit the scalar type: outputs are finite, forbidden and dropped weights are
///     exactly 0, padded and (under empty_rows::zero) empty rows are zero with lse -inf (an empty row with a sink:
///     its sink);
///   - on well-conditioned rows every kernel matches a long double evaluation of the definition within a bound
///     derived from the row's rounding (see row_oracle);
///   - the tiled kernel gives bit-identical results on 1 and 2 threads;
///   - for float inputs, the tiled kernel storing float and accumulating in double passes the same oracle checks;
///   - for float inputs, 16-bit storage is float arithmetic on the rounded values: q, k, v rounded to half or
///     bfloat16 give in both kernels the float call on the widened values, out and weights rounded once, lse the
///     same, and the same error; float queries over the rounded keys and values give the float call bit for bit;
///     when the call has a backward, so does the 16-bit backward (its gradients the float backward's on the
///     widened values, rounded once, or the same error);
///   - for float inputs of rank 4, an int8 (q8_0) and an int4 (q4_0) cache hold each value within their format's
///     bound and refuse exactly the values they cannot hold; float queries over them give the float call over the
///     values they hold, bit for bit, or the same error, and fp16 and bf16 queries the float call on their values
///     rounded once (check_quantized_cache);
///   - a call split at a random key into two calls merged by merge_partials meets the same oracle
///     (check_split_merge);
///   - the backward of both kernels agrees within a bound derived the same way.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include <attend/backward.hpp>
#include <attend/merge.hpp>
#include <attend/position.hpp>
#include <attend/q8_cache.hpp>
#include <attend/sdpa.hpp>

#include "fuzz_check.hpp"
#include "fuzz_input.hpp"
#include "fuzz_masks.hpp"
#include "support/q8_blocks.hpp"

namespace attend_fuzz {
namespace {

using ld = long double;

/// Sizes of q `[batch, heads, query_len, head_dim]`, k `[batch, kv_heads, key_len, head_dim]` and v
/// `[batch, kv_heads, key_len, value_dim]` as decoded; the three may disagree on purpose.
struct case_sizes {
    std::array<index_t, 4> q{}, k{}, v{};
};

case_sizes decode_sizes(fuzz_input& in, int rank) {
    // Mostly small; sometimes long enough for several default tiles (one head, small dims, to stay fast), or
    // with head_dim past 128, where the default key tile halves.
    const bool large = in.chance(16);
    const index_t batch = in.chance(12) ? 0 : in.in_range(1, large ? 1 : 3);
    const index_t kv_heads = rank == 4 && !large ? in.in_range(1, 3) : 1;
    const index_t heads = rank == 4 ? kv_heads * in.in_range(1, large ? 2 : 3) : 1;
    const index_t query_len = in.chance(12) ? 0 : in.in_range(1, large ? 160 : 24);
    const index_t key_len = in.in_range(1, large ? 600 : 24);
    const index_t head_dim = !large && in.chance(8) ? in.in_range(1, 130) : in.in_range(1, 8);
    const index_t value_dim = in.in_range(1, 8);
    case_sizes c{{batch, heads, query_len, head_dim},
                 {batch, kv_heads, key_len, head_dim},
                 {batch, kv_heads, key_len, value_dim}};
    if (in.chance(20)) {  // one rule broken
        switch (in.choose(8)) {
            case 0: c.k[0] += 1; break;
            case 1: c.v[0] += 1; break;
            case 2: c.v[2] += 1; break;
            case 3: c.k[3] += 1; break;
            case 4: c.q[1] += 1; break;  // heads not a multiple of kv_heads
            case 5: c.k[2] = c.v[2] = 0; break;
            case 6: c.q[3] = c.k[3] = 0; break;
            default: c.k[1] = c.v[1] = 0; break;
        }
        if (rank == 3) c.q[1] = c.k[1] = c.v[1] = 1;  // rank 3 has no heads axis to break
    }
    return c;
}

template <class T>
T to_scalar(double x) {
    if (std::isfinite(x) && std::abs(x) > static_cast<double>(std::numeric_limits<T>::max()))
        return std::copysign(std::numeric_limits<T>::infinity(), static_cast<T>(x > 0 ? 1 : -1));
    return static_cast<T>(x);
}

/// Tensor values: a magnitude class for the whole tensor, then a few special values at random positions.
template <class T>
std::vector<T> decode_values(fuzz_input& in, index_t count) {
    value_stream g(in.word());
    const int kind = in.choose(8);
    const double magnitude = kind == 1 ? std::pow(10.0, static_cast<double>(in.in_range(-45, 40))) : 1.0;
    const double constant = static_cast<double>(in.in_range(-2, 2));
    std::vector<T> x(static_cast<std::size_t>(count));
    for (T& e : x) {
        if (kind == 2) e = to_scalar<T>(constant);
        else if (kind == 3) e = to_scalar<T>(std::round(4 * g.uniform(-1.0, 1.0)));
        else e = to_scalar<T>(magnitude * g.uniform(-1.0, 1.0));
    }
    if (count > 0 && in.chance(40)) {
        using limits = std::numeric_limits<T>;
        const T specials[] = {limits::quiet_NaN(), limits::infinity(),   -limits::infinity(), limits::max(),
                              limits::lowest(),    limits::denorm_min(), limits::min(),       T(-0.0)};
        const int n = in.choose(4) + 1;
        for (int s = 0; s < n; ++s) x[static_cast<std::size_t>(g.uniform_int(0, count - 1))] = specials[in.choose(8)];
    }
    return x;
}

template <class T, int Rank>
attend::tensor<T, Rank> make_tensor(const std::array<index_t, 4>& dims4, const std::vector<T>& values) {
    attend::tensor<T, Rank> t;
    if constexpr (Rank == 4) t.resize(dims4[0], dims4[1], dims4[2], dims4[3]);
    else t.resize(dims4[0], dims4[2], dims4[3]);
    std::copy(values.begin(), values.end(), t.data());
    return t;
}

index_t product(const std::array<index_t, 4>& d) { return d[0] * d[1] * d[2] * d[3]; }

/// The score_mod a call drew, for the oracle: score -> alpha score + beta (j - i), derivative alpha.
struct drawn_score_mod {
    bool on = false;
    double alpha = 1, beta = 0;
};

/// A positive option (scale, softcap): mostly a power of two in [2^lo, 2^hi], sometimes a value the checks must
/// reject (0, -1, inf, NaN, 1e300, 1e-300) or an edge (1e-3, `usual`).
double drawn_positive(fuzz_input& in, double usual, index_t lo, index_t hi) {
    const double choices[] = {
        0.0,  -1.0, std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN(), 1e300, 1e-300,
        1e-3, usual};
    return in.chance(128) ? choices[in.choose(8)] : std::pow(2.0, static_cast<double>(in.in_range(lo, hi)));
}

attend::sdpa_options decode_options(fuzz_input& in, index_t heads, std::string& text, drawn_score_mod& mod) {
    attend::sdpa_options o;
    std::ostringstream s;
    if (in.chance(64)) {
        o.scale = drawn_positive(in, 10.0, -8, 8);
        s << " scale " << *o.scale;
    }
    if (in.chance(48)) {
        o.softcap = drawn_positive(in, 50.0, -4, 6);
        s << " softcap " << *o.softcap;
    }
    o.empty_rows = in.chance(128) ? attend::empty_rows::zero : attend::empty_rows::error;
    if (in.chance(64)) {
        const double choices[] = {0.5, 0.1, 0.9, 0.999, 1.0, -0.1, std::numeric_limits<double>::quiet_NaN(), 0.0};
        o.dropout.probability = choices[in.choose(8)];
        o.dropout.training = in.chance(200);
        o.dropout.seed = in.word();
        s << " dropout " << o.dropout.probability << (o.dropout.training ? " training" : " eval");
    }
    if (in.chance(64)) {
        std::vector<double> slopes = attend::alibi_slopes(std::max<index_t>(heads, 1));
        if (in.chance(64)) slopes.resize(static_cast<std::size_t>(in.in_range(0, heads + 1)), 0.5);
        if (in.chance(32))
            for (double& x : slopes)
                x = std::pow(10.0, static_cast<double>(in.in_range(-3, 3))) * (in.chance(64) ? -1 : 1);
        const auto align = in.chance(128) ? attend::alignment::top_left : attend::alignment::bottom_right;
        o.score_bias = attend::score_bias::alibi(slopes, align);
        s << " alibi(" << slopes.size() << " slopes)";
    }
    if (in.chance(48)) {  // sinks: one per query head, sometimes of the wrong count or not finite
        const double specials[] = {std::numeric_limits<double>::quiet_NaN(),
                                   std::numeric_limits<double>::infinity(),
                                   -std::numeric_limits<double>::infinity(),
                                   1e300,
                                   -1e4,
                                   1e4,
                                   0.0,
                                   40.0};
        const index_t n = in.chance(16) ? in.in_range(0, heads + 1) : std::max<index_t>(heads, 1);
        std::vector<double> logits(static_cast<std::size_t>(n));
        for (double& z : logits)
            z = in.chance(16) ? specials[in.choose(8)] : static_cast<double>(in.in_range(-64, 64)) / 8;
        o.sinks = logits;
        s << " sinks(" << n << ")";
    }
    if (in.chance(40)) {  // a contraction (alpha <= 1) plus a small position term, so scores that fit stay in range
        mod = {true, in.chance(128) ? 0.5 : 1.0, static_cast<double>(in.in_range(-4, 4)) / 8};
        const double alpha = mod.alpha, beta = mod.beta;
        o.score_mod = attend::score_mod(
            [alpha, beta](auto x, index_t, index_t, index_t i, index_t j) {
                using S = decltype(x);
                return static_cast<S>(alpha) * x + static_cast<S>(beta * static_cast<double>(j - i));
            },
            [alpha](auto x, index_t, index_t, index_t, index_t) { return static_cast<decltype(x)>(alpha); });
        s << " score_mod(" << alpha << " s + " << beta << " (j - i))";
    }
    o.need_weights = in.chance(128);
    o.need_lse = in.chance(128);
    o.weights_after_dropout = in.chance(32);
    o.check_finite = !in.chance(24);
    s << (o.empty_rows == attend::empty_rows::zero ? " empty_rows::zero" : " empty_rows::error")
      << (o.need_weights ? " weights" : "") << (o.weights_after_dropout ? "(after dropout)" : "")
      << (o.need_lse ? " lse" : "") << (o.check_finite ? "" : " no check_finite");
    text += s.str();
    return o;
}

/// The small tile sizes the tiled kernel runs with besides its defaults, so multi-tile paths (several query
/// blocks and key tiles, trimmed strips, slabs, GEMV rows, decode chunks) run on small inputs.
attend::detail::tile_config decode_tiles(fuzz_input& in) {
    attend::detail::tile_config c;
    c.query_rows = in.in_range(1, 12);
    c.key_tile = in.in_range(1, 20);
    c.trim_step = in.in_range(1, 8);
    c.slab_rows = in.in_range(1, 8);
    c.gemv_rows = in.in_range(0, 8);
    c.decode_queries = in.in_range(0, 20);
    c.decode_chunk = c.key_tile * in.in_range(1, 3);
    return c;
}

/// One query row evaluated in long double from the definition, with what rounding in T can do to it.
struct row_oracle {
    bool padded = false;
    bool empty = false;        ///< not padded, no allowed key
    bool fits = false;         ///< scores (before additive terms) and outputs are far from T's overflow
    bool conditioned = false;  ///< fits, and rounding moves the weights by at most `error`
    ld error = 0;              ///< bound on |weight error| (relative to the largest weight) from rounding scores
    /// Whether the soft-cap's slope 1 - tanh^2(s / c), which the backward multiplies into dS, is set by the inputs:
    /// it turns from 1 to 0 within a few caps of s = 0, so a key there whose score rounding is not far below the
    /// cap gets a slope that depends on the order of the sums (found by the fuzzer: cap 1e-300 in double).
    bool slope_conditioned = true;
    /// An additive term (or a partial sum of them) of an allowed key is near or beyond T's range: the library
    /// saturates each addition (mask_nodes.hpp), so values follow neither the exact sum nor, where a wider
    /// accumulation than T holds the lse, need the lse fit in T (found by the fuzzer: +-DBL_MAX terms summed).
    bool saturating = false;
    ld lse = 0;
    std::vector<ld> weights;  ///< softmax, before dropout
    std::vector<ld> out;      ///< after dropout
};

template <class T>
struct call_case {
    int rank = 4;
    attention_shape s;
    std::vector<T> q, k, v;
    attend::sdpa_options options;
    drawn_score_mod mod;
    meaning mask;
    bool finite_inputs = true;
    ld v_max = 0, keep_scale = 1;
};

template <class T>
const T* row_of(const std::vector<T>& x, index_t heads, index_t len, index_t dim, index_t b, index_t h, index_t i) {
    return x.data() + ((b * heads + h) * len + i) * dim;
}

/// attend's rule for scores that overflow (detail/input_scan.hpp), written out from its documentation: true when
/// some element has |scale q_d| > max(T) / 2, or some query and key (masked or not) have
/// max(1, scale) sum_d |q_d k_d| > max(T) / 2, with the scale as the kernels hold it (rounded to T).
template <class T>
bool breaks_score_range(const call_case<T>& c) {
    const attention_shape& s = c.s;
    const ld limit = static_cast<ld>(std::numeric_limits<T>::max()) / 2;
    const ld scale = static_cast<ld>(
        static_cast<T>(c.options.scale ? *c.options.scale : 1.0 / std::sqrt(static_cast<double>(s.head_dim))));
    for (index_t b = 0; b < s.batch; ++b)
        for (index_t h = 0; h < s.heads; ++h)
            for (index_t i = 0; i < s.query_len; ++i) {
                const T* q = row_of(c.q, s.heads, s.query_len, s.head_dim, b, h, i);
                for (index_t d = 0; d < s.head_dim; ++d)
                    if (scale * std::abs(static_cast<ld>(q[d])) > limit) return true;
                for (index_t j = 0; j < s.key_len; ++j) {
                    const T* k = row_of(c.k, s.kv_heads, s.key_len, s.head_dim, b, s.kv_head(h), j);
                    ld sum = 0;
                    for (index_t d = 0; d < s.head_dim; ++d)
                        sum += std::abs(static_cast<ld>(q[d]) * static_cast<ld>(k[d]));
                    if (std::max<ld>(1, scale) * sum > limit) return true;
                }
            }
    return false;
}

template <class T>
row_oracle evaluate_row(const call_case<T>& c, index_t b, index_t h, index_t i) {
    const attention_shape& s = c.s;
    constexpr ld eps = std::numeric_limits<T>::epsilon();
    constexpr ld big = static_cast<ld>(std::numeric_limits<T>::max()) / 16;
    const ld scale =
        static_cast<ld>(c.options.scale ? *c.options.scale : 1.0 / std::sqrt(static_cast<double>(s.head_dim)));
    row_oracle r;
    r.padded = c.mask.padded(b, i);
    const index_t S = s.key_len, kvh = s.kv_head(h);
    const T* q = row_of(c.q, s.heads, s.query_len, s.head_dim, b, h, i);
    std::vector<ld> t(static_cast<std::size_t>(S), meaning::minus_inf()), rounding(static_cast<std::size_t>(S), 0);
    ld q_max = 0;
    for (index_t d = 0; d < s.head_dim; ++d) q_max = std::max(q_max, std::abs(static_cast<ld>(q[d])));
    // The kernels may scale q before the product (the tiled one does): a scaled query element beyond the range
    // is outside the score-range rule, which only check_finite enforces; with it off the caller promised it.
    r.fits = c.v_max * c.keep_scale * static_cast<ld>(S) < big && scale * q_max < big;
    bool any = false;
    for (index_t j = 0; j < S; ++j) {
        const ld added = c.mask.added(b, h, i, j);
        if (r.padded || added == meaning::minus_inf()) continue;
        if (c.mask.largest(b, h, i, j) > big) r.saturating = true;
        const T* k = row_of(c.k, s.kv_heads, S, s.head_dim, b, kvh, j);
        ld dot = 0, magnitude = 0, k_max = 0;
        for (index_t d = 0; d < s.head_dim; ++d) {
            dot += static_cast<ld>(q[d]) * static_cast<ld>(k[d]);
            magnitude += std::abs(static_cast<ld>(q[d]) * static_cast<ld>(k[d]));
            k_max = std::max(k_max, std::abs(static_cast<ld>(k[d])));
        }
        const ld bias = c.options.score_bias.empty()
                            ? 0
                            : static_cast<ld>(c.options.score_bias.template value<double>(h, i, j, s.query_len, S));
        // Soft-capping bends the scaled dot product (slope <= 1, so it shrinks the error of its input) and adds
        // the error of tanh itself: a few ulps of the cap.
        const ld cap = c.options.softcap ? static_cast<ld>(*c.options.softcap) : 0;
        const ld capped = cap > 0 ? cap * std::tanh(scale * dot / cap) : scale * dot;
        if (cap > 0 && std::abs(scale * dot) < 40 * cap && static_cast<ld>(s.head_dim + 2) * scale * magnitude > cap)
            r.slope_conditioned = false;
        const ld modded = c.mod.on ? static_cast<ld>(c.mod.alpha) * capped +
                                         static_cast<ld>(static_cast<T>(c.mod.beta * static_cast<double>(j - i)))
                                   : capped;
        const ld score = modded + bias;
        const ld total = score + added;
        t[static_cast<std::size_t>(j)] = total;
        // GEMM and scaling round each product and partial sum (subnormal products lose up to min() each); the
        // bias and the additive term add one rounding each of the running value.
        rounding[static_cast<std::size_t>(j)] =
            eps * (static_cast<ld>(s.head_dim + 2) * scale * magnitude + std::abs(score) + std::abs(modded) +
                   std::abs(bias) + std::abs(added) + std::abs(total) + 8 * cap) +
            static_cast<ld>(s.head_dim + 2) * static_cast<ld>(std::numeric_limits<T>::min()) * (1 + scale) *
                (1 + q_max + k_max);
        if (std::max<ld>(1, scale) * magnitude + std::abs(bias) >= big) r.fits = false;
        any = true;
    }
    r.empty = !r.padded && !any;
    r.weights.assign(static_cast<std::size_t>(S), 0);
    r.out.assign(static_cast<std::size_t>(s.value_dim), 0);
    // The sink joins the denominator as a score with no value (sinks.hpp); an empty row's mass is all sink.
    const bool sink = !c.options.sinks.empty() && !r.padded;
    const ld z = sink ? static_cast<ld>(static_cast<T>(c.options.sinks[h])) : meaning::minus_inf();
    if (!any) {
        r.lse = z;
        r.conditioned = r.fits;
        return r;
    }
    const ld m = std::max(z, *std::max_element(t.begin(), t.end()));
    ld sum = sink ? std::exp(z - m) : 0, worst = 0;
    for (index_t j = 0; j < S; ++j) {
        const ld x = t[static_cast<std::size_t>(j)];
        if (x == meaning::minus_inf()) continue;
        sum += std::exp(x - m);
        // Rounding matters only for keys whose weight is not negligible next to the largest.
        if (x >= m - 60) worst = std::max(worst, rounding[static_cast<std::size_t>(j)]);
    }
    r.lse = m + std::log(sum);
    r.error = 2 * worst;
    r.conditioned = r.fits && r.error < 1e-3L && !r.saturating;
    const attend::detail::dropout_rule drop{c.options.dropout.seed, c.options.dropout.probability, 1};
    const bool dropping = c.options.dropout.training && c.options.dropout.probability > 0;
    for (index_t j = 0; j < S; ++j) {
        const ld x = t[static_cast<std::size_t>(j)];
        if (x == meaning::minus_inf()) continue;
        const ld p = std::exp(x - m) / sum;
        r.weights[static_cast<std::size_t>(j)] = p;
        if (dropping && !drop.keep(b, h, i, j)) continue;
        const T* v = row_of(c.v, s.kv_heads, S, s.value_dim, b, kvh, j);
        for (index_t d = 0; d < s.value_dim; ++d)
            r.out[static_cast<std::size_t>(d)] += p * c.keep_scale * static_cast<ld>(v[d]);
    }
    return r;
}

/// The outputs of one kernel run, flat: out `[batch, heads, query_len, value_dim]`, weights, lse.
template <class T>
struct outputs {
    std::vector<T> out, weights, lse;
};

template <class T, int Rank>
outputs<T> flatten(const attend::attention_result<T, Rank>& r) {
    outputs<T> o;
    o.out.assign(r.out.data(), r.out.data() + r.out.size());
    o.weights.assign(r.weights.data(), r.weights.data() + r.weights.size());
    o.lse.assign(r.lse.data(), r.lse.data() + r.lse.size());
    return o;
}

std::string where(const char* what, const char* path, index_t b, index_t h, index_t i) {
    std::ostringstream s;
    s << what << " of " << path << " at batch " << b << ", head " << h << ", query " << i;
    return s.str();
}

/// Checks one kernel's outputs against the oracle rows.
template <class T>
void check_against_oracle(const call_case<T>& c, const std::vector<row_oracle>& rows, const outputs<T>& o,
                          const char* path) {
    const attention_shape& s = c.s;
    constexpr ld eps = std::numeric_limits<T>::epsilon();
    const ld tiny = 64 * static_cast<ld>(std::numeric_limits<T>::min());
    const bool dropping = c.options.dropout.training && c.options.dropout.probability > 0;
    const attend::detail::dropout_rule drop{c.options.dropout.seed, c.options.dropout.probability, 1};
    for (index_t b = 0; b < s.batch; ++b)
        for (index_t h = 0; h < s.heads; ++h)
            for (index_t i = 0; i < s.query_len; ++i) {
                const index_t n = (b * s.heads + h) * s.query_len + i;
                const row_oracle& r = rows[static_cast<std::size_t>(n)];
                if (!r.fits) continue;
                const T* out = o.out.data() + n * s.value_dim;
                const T* w = o.weights.empty() ? nullptr : o.weights.data() + n * s.key_len;
                const bool zero_row = r.padded || r.empty;
                for (index_t d = 0; d < s.value_dim; ++d) {
                    require(std::isfinite(out[d]), where("non-finite out", path, b, h, i));
                    if (zero_row)
                        require(out[d] == T(0), where("non-zero out of a padded or empty row", path, b, h, i));
                }
                if (!o.lse.empty()) {
                    const T lse = o.lse[static_cast<std::size_t>(n)];
                    // -inf, or the sink (the whole mass) for an empty row of a call with sinks.
                    if (zero_row)
                        require(static_cast<ld>(lse) == r.lse,
                                where("lse of a zero row is not -inf or its sink", path, b, h, i));
                    else if (!r.saturating) require(std::isfinite(lse), where("non-finite lse", path, b, h, i));
                    else require(!std::isnan(lse), where("NaN lse", path, b, h, i));
                }
                if (w)
                    for (index_t j = 0; j < s.key_len; ++j) {
                        const bool forbidden = zero_row || !c.mask.allowed(b, h, i, j);
                        const bool dropped = c.options.weights_after_dropout && dropping && !drop.keep(b, h, i, j);
                        if (forbidden || dropped)
                            require(w[j] == T(0), where(forbidden ? "forbidden weight is not exactly 0"
                                                                  : "dropped weight is not exactly 0",
                                                        path, b, h, i) +
                                                      ", key " + std::to_string(j));
                        require(std::isfinite(w[j]), where("non-finite weight", path, b, h, i));
                    }
                if (!r.conditioned) continue;
                const ld weight_tol = 32 * (r.error + eps * static_cast<ld>(s.key_len + 4)) + tiny;
                const ld out_tol = weight_tol * c.keep_scale * c.v_max * 2 + tiny;
                for (index_t d = 0; d < s.value_dim; ++d)
                    require(std::abs(static_cast<ld>(out[d]) - r.out[static_cast<std::size_t>(d)]) <= out_tol,
                            where("out differs from the long double oracle", path, b, h, i));
                if (!o.lse.empty() && !zero_row)
                    require(std::abs(static_cast<ld>(o.lse[static_cast<std::size_t>(n)]) - r.lse) <=
                                weight_tol + 4 * eps * std::abs(r.lse),
                            where("lse differs from the long double oracle", path, b, h, i));
                if (w)
                    for (index_t j = 0; j < s.key_len; ++j) {
                        ld expected = r.weights[static_cast<std::size_t>(j)];
                        if (c.options.weights_after_dropout && dropping)
                            expected = drop.keep(b, h, i, j) ? expected * c.keep_scale : 0;
                        const ld tol = c.options.weights_after_dropout ? weight_tol * c.keep_scale : weight_tol;
                        require(std::abs(static_cast<ld>(w[j]) - expected) <= tol,
                                where("weight differs from the long double oracle", path, b, h, i) + ", key " +
                                    std::to_string(j));
                    }
            }
}

/// Both results bit for bit (NaN equal to NaN of any payload).
template <class T>
bool identical(const std::vector<T>& a, const std::vector<T>& b) {
    if (a.size() != b.size()) return false;
    for (std::size_t n = 0; n < a.size(); ++n)
        if (!(std::isnan(a[n]) && std::isnan(b[n])) && std::memcmp(&a[n], &b[n], sizeof(T)) != 0) return false;
    return true;
}

/// Two runs' outputs bit for bit: out, weights and lse.
template <class T>
bool identical(const outputs<T>& a, const outputs<T>& b) {
    return identical(a.out, b.out) && identical(a.weights, b.weights) && identical(a.lse, b.lse);
}

/// The tiled kernel with explicit tile sizes, through the same checks as the public call, storing T and
/// accumulating in Acc (float storage accumulated in double is the kernels' staged path); keys and values as
/// `Rows` (strided views of T, or a quantized cache's blocks).
template <class T, class Acc = T, class Rows = attend::strided_view<const T>, class Mask>
outputs<T> tiled_with(const attend::strided_view<const T>& q, const Rows& k, const Rows& v, const Mask& mask,
                      const attend::sdpa_options& options, const attend::detail::tile_config& tiles, int threads) {
    const attention_shape s = attend::detail::check_views(q, k, v);
    // As the API does: the scan of k and v deferred to the kernel, so an empty row's error comes first.
    const auto call = attend::detail::check_call(q, k, v, s, mask, options, true);
    const attend::detail::erased_mask<decltype(call.mask)> erased(call.mask);
    outputs<T> o;
    const index_t rows = s.batch * s.heads * s.query_len;
    o.out.assign(static_cast<std::size_t>(rows * s.value_dim), std::numeric_limits<T>::quiet_NaN());
    if (options.need_weights)
        o.weights.assign(static_cast<std::size_t>(rows * s.key_len), std::numeric_limits<T>::quiet_NaN());
    if (options.need_lse) o.lse.assign(static_cast<std::size_t>(rows), std::numeric_limits<T>::quiet_NaN());
    attend::detail::attention_outputs<T> views;
    views.out.data = o.out.data();
    views.out.dims = {s.batch, s.heads, s.query_len, s.value_dim};
    views.out.strides = {s.heads * s.query_len * s.value_dim, s.query_len * s.value_dim, s.value_dim, 1};
    views.weights = o.weights.empty() ? nullptr : o.weights.data();
    views.lse = o.lse.empty() ? nullptr : o.lse.data();
    attend::detail::kernel_params<Acc> params;
    params.scale = static_cast<Acc>(call.params.scale);
    params.softcap = static_cast<Acc>(call.params.softcap);
    params.dropout = call.params.dropout;
    params.bias = call.params.bias;
    params.weights_after_dropout = call.params.weights_after_dropout;
    params.score_mod = call.params.score_mod;
    for (const T z : call.params.sinks) params.sinks.push_back(static_cast<Acc>(z));
    const attend::detail::kv_scan_of<T, Rows> kv_scan(q, k, v, s, call.params.scale, call.query_magnitudes);
    if (call.kv_scan_deferred && !kv_scan.settled()) params.kv_scan = &kv_scan;
    attend::detail::tiled_forward<T, Acc, Rows>(q, k, v, s, erased, params, views, threads, tiles);
    return o;
}

/// Reference against tiled backward on a call whose forward was checked well-conditioned.
template <class T, int Rank, class Mask>
void check_backward(fuzz_input& in, const call_case<T>& c, const attend::tensor<T, Rank>& q,
                    const attend::tensor<T, Rank>& k, const attend::tensor<T, Rank>& v,
                    const attend::attention_result<T, Rank>& forward, const Mask& mask,
                    const std::vector<row_oracle>& rows, int threads) {
    const attention_shape& s = c.s;
    attend::tensor<T, Rank> d_out = forward.out;
    value_stream g(in.word());
    for (index_t n = 0; n < d_out.size(); ++n) d_out.data()[n] = static_cast<T>(g.uniform(-1.0, 1.0));
    attend::sdpa_options reference = c.options, tiled = c.options;
    reference.kernel = attend::kernel::reference;
    tiled.kernel = attend::kernel::tiled;
    tiled.threads = threads;
    std::optional<attend::attention_gradients<T, Rank>> a, b;
    const auto id_a = error_id_of([&] {
        a.emplace(
            attend::scaled_dot_product_attention_backward(q, k, v, mask, forward.out, forward.lse, d_out, reference));
    });
    const auto id_b = error_id_of([&] {
        b.emplace(attend::scaled_dot_product_attention_backward(q, k, v, mask, forward.out, forward.lse, d_out, tiled));
    });
    require(id_a == id_b, "backward: reference throws " + spell(id_a) + ", tiled " + spell(id_b));
    if (id_a) return;
    ld error = 0;
    for (const row_oracle& r : rows) {
        if (!r.conditioned || !r.slope_conditioned) return;
        error = std::max(error, r.error);
    }
    constexpr ld eps = std::numeric_limits<T>::epsilon();
    const ld scale =
        static_cast<ld>(c.options.scale ? *c.options.scale : 1.0 / std::sqrt(static_cast<double>(s.head_dim)));
    ld q_max = 0, k_max = 0;
    for (T x : c.q) q_max = std::max(q_max, std::abs(static_cast<ld>(x)));
    for (T x : c.k) k_max = std::max(k_max, std::abs(static_cast<ld>(x)));
    // |dP| <= keep * value_dim * max|d_out| * max|v|; a row of dS = P (dP - D) sums to at most 2 max|dP|; a key
    // collects from every query of its group (and dv from P' directly).
    const ld queries = static_cast<ld>(s.query_len * s.group_size() * std::max<index_t>(1, s.batch));
    const ld dp = c.keep_scale * static_cast<ld>(s.value_dim) * c.v_max;
    const ld rel = 64 * (error + eps * static_cast<ld>(s.key_len + s.query_len + s.head_dim + s.value_dim + 8));
    // Subnormal operands (scale folded into a subnormal q or k, a subnormal probability) lose up to min() each,
    // absolutely: `flow` bounds what multiplies them.
    const ld subnormal = 8 * static_cast<ld>(std::numeric_limits<T>::min()) * (1 + scale);
    const auto compare = [&](const char* name, const T* x, const T* y, index_t n, ld bound, ld flow) {
        // Gradients that may overflow T (huge values with small scores) are not comparable.
        if (!(bound * std::max<ld>(1, scale) < static_cast<ld>(std::numeric_limits<T>::max()) / 64)) return;
        for (index_t e = 0; e < n; ++e) {
            require(std::isfinite(x[e]) && std::isfinite(y[e]), std::string("backward: non-finite ") + name);
            require(std::abs(static_cast<ld>(x[e]) - static_cast<ld>(y[e])) <= rel * bound + subnormal * (1 + flow),
                    std::string("backward: ") + name + " of reference and tiled differ at flat index " +
                        std::to_string(e) + ": " + attend::detail::concat(x[e], " vs ", y[e], ", bound ", bound));
        }
    };
    compare("dq", a->d_query.data(), b->d_query.data(), a->d_query.size(), scale * 2 * dp * k_max, 2 * dp);
    compare("dk", a->d_key.data(), b->d_key.data(), a->d_key.size(), scale * 2 * dp * q_max * queries,
            2 * dp * queries);
    compare("dv", a->d_value.data(), b->d_value.data(), a->d_value.size(), c.keep_scale * queries,
            c.keep_scale * queries);
    compare("d_score_bias", a->d_score_bias.data(), b->d_score_bias.data(), a->d_score_bias.size(), 2 * dp * queries,
            2 * dp * queries);
    // d sink = -sum over a head's rows of p_sink * rowsum(d_out * out), |rowsum| <= value_dim * keep * max|v|.
    compare("d_sinks", a->d_sinks.data(), b->d_sinks.data(), a->d_sinks.size(), dp * queries, dp * queries);
}

/// A tensor's elements, flat.
template <class X>
auto flat(const X& t) {
    return std::vector(t.data(), t.data() + t.size());
}

/// x rounded once to S.
template <class S>
std::vector<S> rounded_to(const std::vector<float>& x) {
    std::vector<S> y(x.size());
    std::transform(x.begin(), x.end(), y.begin(), [](float e) { return static_cast<S>(e); });
    return y;
}

/// The same 16-bit values, bit for bit (any NaN matches any NaN).
template <class S>
bool same_bits16(const std::vector<S>& a, const std::vector<S>& b) {
    if (a.size() != b.size()) return false;
    for (std::size_t n = 0; n < a.size(); ++n)
        if (!((Eigen::numext::isnan)(a[n]) && (Eigen::numext::isnan)(b[n])) &&
            attend::detail::bits_of(a[n]) != attend::detail::bits_of(b[n]))
            return false;
    return true;
}

/// A 16-bit call's outputs are the float call's on its values, rounded once (lse stays float).
template <class S, int Rank>
bool rounded_once(const attend::attention_result<S, Rank>& got, const attend::attention_result<float, Rank>& want) {
    return same_bits16(flat(got.out), rounded_to<S>(flat(want.out))) &&
           same_bits16(flat(got.weights), rounded_to<S>(flat(want.weights))) &&
           identical(flat(got.lse), flat(want.lse));
}

/// The 16-bit storage check of the file comment, for storage type S, both kernels (the tiled one on `threads`),
/// with the backward when `backward`.
template <class S, int Rank, class Mask>
void check_storage16(const attend::tensor<float, Rank>& q, const attend::tensor<float, Rank>& k,
                     const attend::tensor<float, Rank>& v, const Mask& mask, attend::sdpa_options o, int threads,
                     bool backward) {
    const attend::tensor<S, Rank> q16 = q.template cast<S>(), k16 = k.template cast<S>(), v16 = v.template cast<S>();
    const attend::tensor<float, Rank> qw = q16.template cast<float>(), kw = k16.template cast<float>(),
                                      vw = v16.template cast<float>();
    for (const auto kernel : {attend::kernel::reference, attend::kernel::tiled}) {
        o.kernel = kernel;
        o.threads = kernel == attend::kernel::tiled ? threads : 1;
        std::optional<attend::attention_result<S, Rank>> got;
        std::optional<attend::attention_result<float, Rank>> want, mixed, mixed_want;
        const auto id_got =
            error_id_of([&] { got.emplace(attend::scaled_dot_product_attention(q16, k16, v16, mask, o)); });
        const auto id_want =
            error_id_of([&] { want.emplace(attend::scaled_dot_product_attention(qw, kw, vw, mask, o)); });
        require(id_got == id_want,
                "16-bit storage throws " + spell(id_got) + ", float on its values " + spell(id_want));
        if (!id_got) {
            require(rounded_once(*got, *want), "16-bit storage is not the float result on its values rounded once");
            if (backward) {
                // d_out: the 16-bit out itself, a valid gradient of the right shape.
                const attend::tensor<S, Rank>& d16 = got->out;
                const attend::tensor<float, Rank> out_w = got->out.template cast<float>();
                std::optional<attend::attention_gradients<S, Rank>> g16;
                std::optional<attend::attention_gradients<float, Rank>> gw;
                const auto id_g16 = error_id_of([&] {
                    g16.emplace(
                        attend::scaled_dot_product_attention_backward(q16, k16, v16, mask, got->out, got->lse, d16, o));
                });
                const auto id_gw = error_id_of([&] {
                    gw.emplace(
                        attend::scaled_dot_product_attention_backward(qw, kw, vw, mask, out_w, got->lse, out_w, o));
                });
                require(id_g16 == id_gw,
                        "16-bit backward throws " + spell(id_g16) + ", float on its values " + spell(id_gw));
                if (!id_g16)
                    require(same_bits16(flat(g16->d_query), rounded_to<S>(flat(gw->d_query))) &&
                                same_bits16(flat(g16->d_key), rounded_to<S>(flat(gw->d_key))) &&
                                same_bits16(flat(g16->d_value), rounded_to<S>(flat(gw->d_value))) &&
                                same_bits16(flat(g16->d_score_bias), rounded_to<S>(flat(gw->d_score_bias))) &&
                                same_bits16(flat(g16->d_sinks), rounded_to<S>(flat(gw->d_sinks))),
                            "the 16-bit backward is not the float backward on its values rounded once");
            }
        }
        const auto id_mixed =
            error_id_of([&] { mixed.emplace(attend::scaled_dot_product_attention(q, k16, v16, mask, o)); });
        const auto id_mixed_want =
            error_id_of([&] { mixed_want.emplace(attend::scaled_dot_product_attention(q, kw, vw, mask, o)); });
        require(id_mixed == id_mixed_want, "float queries over 16-bit keys throw " + spell(id_mixed) +
                                               ", over float keys of the same values " + spell(id_mixed_want));
        if (!id_mixed) {
            const outputs<float> m = flatten(*mixed), mw = flatten(*mixed_want);
            require(identical(m, mw), "float queries over 16-bit keys differ from float keys of the same values");
        }
    }
}

/// A q8_0 block holding x (32 values) as w: each value within half a step, plus the float rounding of x / d
/// (q8_cache.hpp); a block of zeros exactly where its amax / 127 rounds to 0 in fp16.
void require_within_bound(const attend::q8_0_block& block, const float* x, const float* w) {
    const float d = static_cast<float>(block.scale);
    float amax = 0;
    for (index_t j = 0; j < 32; ++j) amax = std::max(amax, std::abs(x[j]));
    require((d == 0) == (static_cast<float>(Eigen::half(amax / 127.0f)) == 0),
            attend::detail::concat("a q8_0 block of largest magnitude ", amax, " has scale ", d));
    for (index_t j = 0; j < 32; ++j) {
        const double error = std::abs(static_cast<double>(x[j]) - static_cast<double>(w[j]));
        require(error <= static_cast<double>(d) * (0.5 + std::ldexp(1.0, -16)) || (d == 0 && w[j] == 0),
                attend::detail::concat("q8_kv_cache holds ", w[j], " for ", x[j], " (scale ", d,
                                       "), beyond half its block's scale"));
    }
}

/// A q4_0 block holding x as w: each value within half a step (plus 2^-19 of it), those of the extreme's opposite
/// sign beyond 7.5 steps within 1.5 (the format's [-8, 7] clamps them); a block of zeros exactly where m / -8
/// rounds to 0 in fp16, m its first value of largest magnitude (q8_cache.hpp).
void require_within_bound(const attend::q4_0_block& block, const float* x, const float* w) {
    const float d = static_cast<float>(block.scale);
    float m = 0;
    for (index_t j = 0; j < 32; ++j)
        if (std::abs(x[j]) > std::abs(m)) m = x[j];
    require((d == 0) == (static_cast<float>(Eigen::half(m / -8.0f)) == 0),
            attend::detail::concat("a q4_0 block of extreme ", m, " has scale ", d));
    for (index_t j = 0; j < 32; ++j) {
        const double error = std::abs(static_cast<double>(x[j]) - static_cast<double>(w[j]));
        const double steps = d != 0 && static_cast<double>(x[j]) / d > 7.5 ? 1.5 : 0.5 + std::ldexp(1.0, -19);
        require(error <= std::abs(static_cast<double>(d)) * steps || (d == 0 && w[j] == 0),
                attend::detail::concat("q4_kv_cache holds ", w[j], " for ", x[j], " (scale ", d, "), beyond ", steps,
                                       " of its block's scale"));
    }
}

/// The quantized cache check of the file comment, for an int8 (q8_0) or int4 (q4_0) cache. k and v are padded
/// with zero columns to whole blocks (q too, which leaves every score as it was) and appended to a
/// quantized_kv_cache<Block>: refused, with nothing appended, exactly when a value is not finite or beyond
/// max_magnitude; otherwise each value is held within its format's documented bound (quantized_block_bound). Float
/// queries over the cache give, in both kernels and in the tiled one with the drawn small tiles, the float call
/// over the values it holds (scale x integer), bit for bit, or the same error; fp16 and bf16 queries the float
/// call on their values rounded once.
template <class Block, class Mask>
void check_quantized_cache(const attend::tensor<float, 4>& q, const attend::tensor<float, 4>& k,
                           const attend::tensor<float, 4>& v, const Mask& mask, attend::sdpa_options o,
                           const attend::detail::tile_config& tiles, int threads) {
    using attend::detail::as_view;
    using cache_type = attend::quantized_kv_cache<Block>;
    const std::string name = attend::detail::block_format<Block>::name;
    if (error_id_of([&] { (void)attend::detail::check_views(as_view(q), as_view(k), as_view(v)); })) return;
    for (const index_t size : {k.dimension(0), k.dimension(1), k.dimension(2), k.dimension(3), v.dimension(3)})
        if (size < 1) return;  // the cache's own size errors are q8_cache_test's
    const auto padded = [](const attend::tensor<float, 4>& x) {
        const index_t dim = x.dimension(3);
        attend::tensor<float, 4> p(x.dimension(0), x.dimension(1), x.dimension(2),
                                   (dim + Block::size - 1) / Block::size * Block::size);
        p.setZero();
        for (index_t row = 0; row < x.size() / std::max<index_t>(dim, 1); ++row)
            std::copy(x.data() + row * dim, x.data() + (row + 1) * dim, p.data() + row * p.dimension(3));
        return p;
    };
    const attend::tensor<float, 4> qp = padded(q), kp = padded(k), vp = padded(v);
    cache_type cache(attend::kv_cache_config{}
                         .with_batch(k.dimension(0))
                         .with_kv_heads(k.dimension(1))
                         .with_capacity(k.dimension(2))
                         .with_head_dim(kp.dimension(3))
                         .with_value_dim(vp.dimension(3)));
    std::optional<std::string> refusal;  // the keys are checked first, each for finiteness first
    for (const auto* x : {&k, &v}) {
        const float* first = x->data();
        const float* last = first + x->size();
        if (refusal) break;
        if (std::any_of(first, last, [](float e) { return !std::isfinite(e); })) refusal = "attend.value.non_finite";
        else if (std::any_of(first, last,
                             [](float e) { return std::abs(static_cast<double>(e)) > cache_type::max_magnitude; }))
            refusal = "attend.value.quantized_range";
    }
    const auto id_append = error_id_of([&] { cache.append(kp, vp); });
    require(id_append == refusal,
            name + " cache append throws " + spell(id_append) + ", its values call for " + spell(refusal));
    if (id_append) {
        require(cache.length() == 0, "a refused " + name + " cache append changed the cache");
        return;
    }
    // What the cache holds, scale x integer per value: rows in the order of the tensors (its capacity is key_len).
    const auto held = [](const std::vector<Block>& blocks, const attend::tensor<float, 4>& x) {
        attend::tensor<float, 4> w(x.dimensions());
        for (index_t first = 0; first < x.size(); first += Block::size) {
            const Block& block = blocks[static_cast<std::size_t>(first / Block::size)];
            for (index_t j = 0; j < Block::size; ++j) w.data()[first + j] = attend_test::widened_by_hand(block, j);
            require_within_bound(block, x.data() + first, w.data() + first);
        }
        return w;
    };
    const attend::tensor<float, 4> kw = held(cache.key_blocks(), kp), vw = held(cache.value_blocks(), vp);
    for (const auto kernel : {attend::kernel::reference, attend::kernel::tiled}) {
        o.kernel = kernel;
        o.threads = kernel == attend::kernel::tiled ? threads : 1;
        std::optional<attend::attention_result<float, 4>> got, want;
        const auto id_got = error_id_of(
            [&] { got.emplace(attend::scaled_dot_product_attention(qp, cache.keys(), cache.values(), mask, o)); });
        const auto id_want =
            error_id_of([&] { want.emplace(attend::scaled_dot_product_attention(qp, kw, vw, mask, o)); });
        require(id_got == id_want, "float queries over an " + name + " cache throw " + spell(id_got) +
                                       ", over its values " + spell(id_want));
        if (!id_got)
            require(identical(flatten(*got), flatten(*want)),
                    "float queries over an " + name + " cache differ from float keys of the values it holds");
    }
    std::optional<outputs<float>> got, want;
    const auto id_got = error_id_of(
        [&] { got.emplace(tiled_with<float>(as_view(qp), cache.keys(), cache.values(), mask, o, tiles, threads)); });
    const auto id_want = error_id_of(
        [&] { want.emplace(tiled_with<float>(as_view(qp), as_view(kw), as_view(vw), mask, o, tiles, threads)); });
    require(id_got == id_want,
            "small tiles over an " + name + " cache throw " + spell(id_got) + ", over its values " + spell(id_want));
    if (!id_got)
        require(identical(*got, *want),
                "small tiles over an " + name + " cache differ from float keys of the values it holds");
    // fp16 and bf16 queries over the cache: the float call on their values, rounded once, or the same error.
    const auto sixteen_bit_queries = [&](auto type) {
        using S = decltype(type);
        const attend::tensor<S, 4> q16 = qp.template cast<S>();
        const attend::tensor<float, 4> qw = q16.template cast<float>();
        for (const auto kernel : {attend::kernel::reference, attend::kernel::tiled}) {
            o.kernel = kernel;
            o.threads = kernel == attend::kernel::tiled ? threads : 1;
            std::optional<attend::attention_result<S, 4>> got16;
            std::optional<attend::attention_result<float, 4>> want16;
            const auto id16 = error_id_of([&] {
                got16.emplace(attend::scaled_dot_product_attention(q16, cache.keys(), cache.values(), mask, o));
            });
            const auto idw = error_id_of([&] {
                want16.emplace(attend::scaled_dot_product_attention(qw, cache.keys(), cache.values(), mask, o));
            });
            require(id16 == idw, "16-bit queries over an " + name + " cache throw " + spell(id16) +
                                     ", float ones on their "
                                     "values " +
                                     spell(idw));
            if (!id16)
                require(rounded_once(*got16, *want16),
                        "16-bit queries over an " + name +
                            " cache are not the float call on their values rounded once");
        }
    };
    sixteen_bit_queries(Eigen::half{});
    sixteen_bit_queries(Eigen::bfloat16{});
}

/// Attention over keys [0, split) and over [split, key_len), each a call of its own (the mask's meaning as an
/// additive mask of that part, empty rows zero, dropout at the part's key offset), merged by merge_partials: the
/// whole call's result, within the oracle's bounds. Only for calls whose score features depend on nothing but the
/// scores (no score bias, score_mod or sinks) and whose mask values are finite in T or -inf.
template <class T, int Rank>
void check_split_merge(fuzz_input& in, const call_case<T>& c, const std::vector<row_oracle>& rows) {
    const attention_shape& s = c.s;
    if (s.key_len < 2 || !c.options.score_bias.empty() || !c.options.score_mod.empty() || !c.options.sinks.empty())
        return;
    for (index_t b = 0; b < s.batch; ++b)
        for (index_t h = 0; h < s.heads; ++h)
            for (index_t i = 0; i < s.query_len; ++i)
                for (index_t j = 0; j < s.key_len; ++j) {
                    const ld a = c.mask.added(b, h, i, j);
                    if (a != meaning::minus_inf() &&
                        !(std::abs(a) <= static_cast<ld>(std::numeric_limits<T>::max()) / 4))
                        return;
                }
    const index_t split = 1 + static_cast<index_t>(in.choose(static_cast<int>(std::min<index_t>(s.key_len - 1, 64))));
    const auto q = make_tensor<T, Rank>({s.batch, s.heads, s.query_len, s.head_dim}, c.q);
    const auto part = [&](index_t begin, index_t end) {
        const index_t n = end - begin;
        std::vector<T> k, v, added;
        for (index_t b = 0; b < s.batch; ++b)
            for (index_t g = 0; g < s.kv_heads; ++g)
                for (index_t j = begin; j < end; ++j) {
                    const T* kr = row_of(c.k, s.kv_heads, s.key_len, s.head_dim, b, g, j);
                    const T* vr = row_of(c.v, s.kv_heads, s.key_len, s.value_dim, b, g, j);
                    k.insert(k.end(), kr, kr + s.head_dim);
                    v.insert(v.end(), vr, vr + s.value_dim);
                }
        for (index_t b = 0; b < s.batch; ++b)
            for (index_t h = 0; h < s.heads; ++h)
                for (index_t i = 0; i < s.query_len; ++i)
                    for (index_t j = begin; j < end; ++j) {
                        const ld a = c.mask.added(b, h, i, j);
                        added.push_back(a == meaning::minus_inf() ? -std::numeric_limits<T>::infinity()
                                                                  : static_cast<T>(a));
                    }
        const auto kt = make_tensor<T, Rank>({s.batch, s.kv_heads, n, s.head_dim}, k);
        const auto vt = make_tensor<T, Rank>({s.batch, s.kv_heads, n, s.value_dim}, v);
        const auto mask =
            attend::additive_mask<T>::from_values(make_tensor<T, Rank>({s.batch, s.heads, s.query_len, n}, added));
        attend::sdpa_options o = c.options;
        o.need_weights = false;
        o.need_lse = true;
        o.empty_rows = attend::empty_rows::zero;  // a row may have its keys in the other part only
        o.dropout.key_offset += begin;
        return attend::scaled_dot_product_attention(q, kt, vt, mask, o);
    };
    const auto first = part(0, split), second = part(split, s.key_len);
    const auto merged = attend::merge_partials(first.out, first.lse, second.out, second.lse);
    outputs<T> o;
    o.out.assign(merged.out.data(), merged.out.data() + merged.out.size());
    o.lse.assign(merged.lse.data(), merged.lse.data() + merged.lse.size());
    check_against_oracle(c, rows, o, "two key parts merged by merge_partials");
}

template <class T, int Rank, class Mask>
void run_call(fuzz_input& in, call_case<T>& c, const attend::tensor<T, Rank>& q, const attend::tensor<T, Rank>& k,
              const attend::tensor<T, Rank>& v, const Mask& mask) {
    const attend::detail::tile_config tiles = decode_tiles(in);
    const int threads = in.chance(128) ? 2 : 1;
    const bool backward = in.chance(64);
    if (backward) c.options.need_lse = true;

    attend::sdpa_options reference = c.options, tiled = c.options;
    reference.kernel = attend::kernel::reference;
    tiled.kernel = attend::kernel::tiled;
    tiled.threads = threads;
    std::optional<attend::attention_result<T, Rank>> ref, til;
    const auto id_ref =
        error_id_of([&] { ref.emplace(attend::scaled_dot_product_attention(q, k, v, mask, reference)); });
    const auto id_til = error_id_of([&] { til.emplace(attend::scaled_dot_product_attention(q, k, v, mask, tiled)); });
    require(id_ref == id_til, "reference throws " + spell(id_ref) + ", tiled " + spell(id_til));
    if constexpr (std::is_same_v<T, float>) {
        const int storage = in.choose(4);  // 0: half, 1: bfloat16, 2: int8 and int4 caches (rank 4), otherwise none
        if (storage == 0) check_storage16<Eigen::half, Rank>(q, k, v, mask, c.options, threads, backward);
        if (storage == 1) check_storage16<Eigen::bfloat16, Rank>(q, k, v, mask, c.options, threads, backward);
        if constexpr (Rank == 4)
            if (storage == 2) {
                check_quantized_cache<attend::q8_0_block>(q, k, v, mask, c.options, tiles, threads);
                check_quantized_cache<attend::q4_0_block>(q, k, v, mask, c.options, tiles, threads);
            }
    }
    const auto qv = attend::detail::as_view(q), kv = attend::detail::as_view(k), vv = attend::detail::as_view(v);
    std::optional<outputs<T>> small1, small2;
    const auto id_small = error_id_of([&] { small1.emplace(tiled_with(qv, kv, vv, mask, c.options, tiles, 1)); });
    require(id_small == id_ref, "small tiles throw " + spell(id_small) + ", reference " + spell(id_ref));
    if (id_ref) {
        if (*id_ref == "attend.mask.empty_row") {
            // The mask's meaning must have a row without allowed keys.
            bool empty = false;
            for (index_t b = 0; b < c.s.batch && !empty; ++b)
                for (index_t i = 0; i < c.s.query_len && !empty; ++i)
                    for (index_t h = 0; h < c.s.heads && !empty; ++h) {
                        if (c.mask.padded(b, i)) continue;
                        bool any = false;
                        for (index_t j = 0; j < c.s.key_len && !any; ++j) any = c.mask.allowed(b, h, i, j);
                        empty = !any;
                    }
            require(empty, "attend.mask.empty_row thrown, but every row has an allowed key");
        }
        if (*id_ref == "attend.value.score_overflow")
            require(c.options.check_finite && breaks_score_range(c),
                    "attend.value.score_overflow thrown, but every score keeps within the rule");
        return;
    }
    if (c.options.check_finite)
        require(!breaks_score_range(c), "no attend.value.score_overflow, but some score breaks the rule");
    if (threads == 2) {
        small2.emplace(tiled_with(qv, kv, vv, mask, c.options, tiles, 2));
        require(identical(*small1, *small2), "tiled results differ between 1 and 2 threads");
    }
    if (!c.finite_inputs) return;  // check_finite off and non-finite values: no crash and the same errors suffice

    std::vector<row_oracle> rows;
    for (index_t b = 0; b < c.s.batch; ++b)
        for (index_t h = 0; h < c.s.heads; ++h)
            for (index_t i = 0; i < c.s.query_len; ++i) {
                rows.push_back(evaluate_row(c, b, h, i));
                require(!(rows.back().empty && c.options.empty_rows == attend::empty_rows::error),
                        where("no error although the mask leaves a row empty", "", b, h, i));
            }
    check_against_oracle(c, rows, flatten(*ref), "reference");
    check_against_oracle(c, rows, flatten(*til), "tiled");
    check_against_oracle(c, rows, *small1, "tiled with small tiles");
    if constexpr (std::is_same_v<T, float>)
        check_against_oracle(c, rows, tiled_with<T, double>(qv, kv, vv, mask, c.options, tiles, threads),
                             "tiled, float storage accumulated in double");
    if (backward) check_backward(in, c, q, k, v, *ref, mask, rows, threads);
    if (in.chance(64)) check_split_merge<T, Rank>(in, c, rows);
}

template <class T, int Rank>
void run_case(fuzz_input& in) {
    const case_sizes sizes = decode_sizes(in, Rank);
    call_case<T> c;
    c.rank = Rank;
    c.q = decode_values<T>(in, product(sizes.q));
    c.k = decode_values<T>(in, product(sizes.k));
    c.v = decode_values<T>(in, product(sizes.v));
    std::ostringstream text;
    text << (sizeof(T) == 4 ? "float" : "double") << " rank " << Rank << " q [" << sizes.q[0] << ',' << sizes.q[1]
         << ',' << sizes.q[2] << ',' << sizes.q[3] << "] k [" << sizes.k[0] << ',' << sizes.k[1] << ',' << sizes.k[2]
         << ',' << sizes.k[3] << "] v [" << sizes.v[0] << ',' << sizes.v[1] << ',' << sizes.v[2] << ',' << sizes.v[3]
         << ']';
    std::string description = text.str();
    c.options = decode_options(in, sizes.q[1], description, c.mod);

    // The shape the call will have if the sizes are consistent: masks are generated for it.
    c.s.batch = sizes.q[0];
    c.s.heads = sizes.q[1];
    c.s.kv_heads = std::max<index_t>(1, sizes.k[1]);
    c.s.query_len = sizes.q[2];
    c.s.key_len = sizes.k[2];
    c.s.head_dim = sizes.q[3];
    c.s.value_dim = sizes.v[3];
    c.s.rank = Rank;
    for (const auto* x : {&c.q, &c.k, &c.v})
        for (T e : *x) c.finite_inputs = c.finite_inputs && std::isfinite(e);
    for (T e : c.v) c.v_max = std::max(c.v_max, std::abs(static_cast<ld>(e)));
    const double p = c.options.dropout.probability;
    if (c.options.dropout.training && p > 0 && p < 1) c.keep_scale = 1 / (1 - static_cast<ld>(p));

    const auto q = make_tensor<T, Rank>(sizes.q, c.q);
    const auto k = make_tensor<T, Rank>(sizes.k, c.k);
    const auto v = make_tensor<T, Rank>(sizes.v, c.v);
    mask_generator generate(in, c.s, 3);
    const int form = in.choose(4);
    case_description() = description + " mask ...";
    if (form == 0) {
        c.mask = boolean_meaning([](index_t, index_t, index_t, index_t) { return true; });
        case_description() = description + " no mask";
        run_call<T, Rank>(in, c, q, k, v, attend::no_mask{});
        return;
    }
    // Building a mask can throw (negative window, NaN in an additive mask): an expected outcome.
    std::optional<runtime_allowed> allowed;
    std::optional<runtime_additive> additive;
    if (error_id_of([&] {
            if (form == 3) additive = generate.additive();
            else allowed = generate.allowed();
        }))
        return;
    const expression& e = allowed ? *allowed->node : *additive->node;
    case_description() = description + " mask " + e.text;
    // The meaning is needed only when the shape binds; check_views and bind reject the rest in every path.
    if (!error_id_of([&] {
            (void)attend::detail::check_views(attend::detail::as_view(q), attend::detail::as_view(k),
                                              attend::detail::as_view(v));
            (void)e.bind(c.s);
        }))
        c.mask = e.mean(c.s);
    if (allowed) run_call<T, Rank>(in, c, q, k, v, *allowed);
    else run_call<T, Rank>(in, c, q, k, v, *additive);
}

}  // namespace
}  // namespace attend_fuzz

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    attend_fuzz::fuzz_input in(data, size);
    switch (in.choose(4)) {
        case 0: attend_fuzz::run_case<float, 4>(in); break;
        case 1: attend_fuzz::run_case<double, 4>(in); break;
        case 2: attend_fuzz::run_case<float, 3>(in); break;
        default: attend_fuzz::run_case<double, 3>(in); break;
    }
    return 0;
}
