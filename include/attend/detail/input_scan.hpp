// SPDX-License-Identifier: MIT
#pragma once
/// The scans of a call's inputs before anything is written: finite values, and scores that fit their type.
///
/// The one rule for scores that overflow the accumulation type. Finite inputs can still give infinite scores
/// (q.k = 1e40 in float), and then the kernels would disagree (NaN in one, a zero row in another) or turn an allowed
/// row into zeros. So with check_finite on, a call whose scores could leave half of T's range is rejected before
/// anything is written (value_error attend.value.score_overflow), and both kernels see only inputs for which every
/// intermediate they form (scale * q_d, the products q_d k_d, their partial sums in any order, scale * q.k) is
/// finite, with room for a bias or an additive mask, which saturate.
///
/// The rule, exactly: for every element, |scale * q_d| <= max(T) / 2, and for every pair of a query and a key
/// (masked or not: the kernels compute a whole tile before masking it), max(1, scale) * sum_d |q_d| |k_d| <= max(T) / 2. A cheap bound from per-row magnitudes
/// decides almost every call in one pass over q and k; only when the bound fails are the pairs checked one by one
/// (in long double), so a call is rejected only when some pair really breaks the rule.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include "../error.hpp"
#include "../shape.hpp"
#include "../tensor.hpp"
#include "kernel_interface.hpp"
#include "memory.hpp"
#include "paged_view.hpp"
#include "parallel_for.hpp"
#include "quantized_rows.hpp"
#include "widen.hpp"

namespace attend::detail {

[[noreturn]] inline void throw_non_finite_at(const std::string& tensor, double value, const std::string& where) {
    throw value_error("attend.value.non_finite",
                      concat(tensor, " holds ", value, " at ", where, " (turn check_finite off to skip this scan)"));
}

template <class View>
[[noreturn]] void throw_non_finite(const View& x, index_t b, index_t h, index_t i, index_t d, const char* name) {
    const auto where = x.rank == 4 ? format_shape(std::array<index_t, 4>{b, h, i, d})
                                   : format_shape(std::array<index_t, 3>{b, i, d});
    using T = row_scalar_t<View>;
    const auto value = static_cast<double>(static_cast<accumulator_t<T>>(x.row(b, h, i)[d]));
    throw_non_finite_at(concat(name, ' ', spell_view(x)), value, where);
}

/// Whether row `row` of n values holds a NaN or an +-inf.
template <class T>
bool row_non_finite(const T* row, index_t n) {
    if constexpr (sizeof(T) == 2) {  // 16-bit: an all-ones exponent, found on the bits
        return any_non_finite_16(row, n);
    } else {
        // x * 0 is 0 for every finite x and NaN for NaN and +-inf: one vectorized sum per row finds out (a scalar
        // isfinite scan cost as much as the tiled kernel itself when decoding).
        const auto a = Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>(row, n);
        return std::isnan((a * T(0)).sum());
    }
}

/// Runs unit(n) for every n in [0, units) (a scan's (batch, head) units, `elements` values in all; a unit throws
/// at the first bad element it meets), on `threads` threads when there are 2^18 values or more (below, a
/// decode's few rows, starting a thread costs more than it saves). A unit that throws there only notes it; then
/// every unit runs again on this thread in order, so the error a call gets (the first bad element, the first
/// allocation that fails) does not depend on the thread count.
template <class Unit>
void scan_units(index_t units, index_t elements, int threads, const Unit& unit) {
    if (threads > 1 && elements >= (index_t(1) << 18)) {
        std::vector<char> clean(static_cast<std::size_t>(std::max<index_t>(units, 0)), 0);
        parallel_for(units, threads, [&](index_t n, int) {
            try {
                unit(n);
                clean[static_cast<std::size_t>(n)] = 1;
            } catch (...) {  // noted; the scan on this thread throws it again, in order
            }
        });
        if (std::all_of(clean.begin(), clean.end(), [](char c) { return c != 0; })) return;
    }
    for (index_t n = 0; n < units; ++n) unit(n);
}

/// check_finite of views that can hold NaN and inf.
template <class View>
void check_finite_values(const View& x, const char* name, int threads) {
    using T = row_scalar_t<View>;
    using Acc = accumulator_t<T>;  // 16-bit values widen to float, exactly: NaN stays NaN, inf stays inf
    const index_t heads = x.dims[0] * x.dims[1];
    const auto scan = [&](index_t n) {  // throws at the head's first bad element
        const index_t b = n / x.dims[1], h = n % x.dims[1];
        for (index_t i = 0; i < x.dims[2]; ++i) {
            const T* row = x.row(b, h, i);
            if (!row_non_finite(row, x.dims[3])) continue;
            for (index_t d = 0; d < x.dims[3]; ++d)
                if (!std::isfinite(static_cast<Acc>(row[d]))) throw_non_finite(x, b, h, i, d, name);
        }
    };
    scan_units(heads, heads * x.dims[2] * x.dims[3], threads, scan);
}

/// Throws value_error attend.value.non_finite naming the first NaN or +-inf of x (a strided or paged view) and
/// where it is, a (batch, head) per unit of scan_units. Quantized rows are finite by construction: their cache
/// rejected non-finite values when it quantized them, and a scale of a finite block is finite.
template <class View>
void check_finite(const View& x, const char* name, int threads = 1) {
    if constexpr (!quantized_rows_v<View>) check_finite_values(x, name, threads);
}

/// Throws value_error attend.value.non_finite for a float of x (a strided view) that is NaN or +-inf, or that
/// Stored (fp16, bf16) rounds to +-inf: appended into a 16-bit cache it would be stored as inf. One pass: a
/// non-finite float rounds to a non-finite Stored.
template <class Stored>
void check_rounds_finite(const strided_view<const float>& x, const char* name) {
    for (index_t b = 0; b < x.dims[0]; ++b)
        for (index_t h = 0; h < x.dims[1]; ++h)
            for (index_t i = 0; i < x.dims[2]; ++i) {
                const float* row = x.row(b, h, i);
                for (index_t d = 0; d < x.dims[3]; ++d)
                    if (!std::isfinite(static_cast<float>(static_cast<Stored>(row[d])))) {
                        if (!std::isfinite(row[d])) throw_non_finite(x, b, h, i, d, name);
                        throw value_error("attend.value.non_finite",
                                          concat(name, " hold ", row[d], " at [", b, ',', h, ',', i, ',', d,
                                                 "], beyond the range of the cache's 16-bit type: it would be "
                                                 "stored as inf (scale the values, or keep a float cache)"));
                    }
            }
}

/// The largest |x_d| and an upper bound of the largest row sum of |x_d| of one (batch, head) of a view. The same
/// pass is check_finite's for q and k: a non-finite element throws attend.value.non_finite naming it.
struct row_magnitudes {
    long double max_abs = 0;
    long double max_l1 = 0;
};

/// scan_magnitudes of quantized rows, exactly: per block |d| times the integer sum and maximum of |q|.
template <class View>
row_magnitudes scan_quantized_magnitudes(const View& x, index_t b, index_t h) {
    using Block = row_scalar_t<View>;
    row_magnitudes m;
    for (index_t i = 0; i < x.dims[2]; ++i) {
        const Block* row = x.row(b, h, i);
        long double l1 = 0;
        for (index_t k = 0; k < x.dims[3] / Block::size; ++k) {
            int sum = 0, largest = 0;
            for (index_t j = 0; j < Block::size; ++j) {
                const int q = block_integer(row[k], j), a = q < 0 ? -q : q;
                sum += a;
                largest = std::max(largest, a);
            }
            const long double d = std::fabs(static_cast<long double>(static_cast<float>(row[k].scale)));
            l1 += d * sum;
            m.max_abs = std::max(m.max_abs, d * largest);
        }
        m.max_l1 = std::max(m.max_l1, l1);
    }
    return m;
}

/// scan_magnitudes of views of float, double or a 16-bit type.
template <class View>
row_magnitudes scan_value_magnitudes(const View& x, index_t b, index_t h, const char* name) {
    using T = row_scalar_t<View>;
    using Acc = accumulator_t<T>;  // 16-bit rows are summed in float: 4096 x 60000 overflows half, not float
    row_magnitudes m;
    // A sum of n non-negative terms rounded in Acc is at least (1 - n eps) times the exact one.
    const long double rounding = 1 + 2 * static_cast<long double>(x.dims[3]) * std::numeric_limits<Acc>::epsilon();
    aligned_vector<Acc> wide;  // a 16-bit row widened (widen.hpp), one at a time
    if constexpr (!std::is_same_v<T, Acc>)
        allocating([&] { wide.resize(static_cast<std::size_t>(x.dims[3])); },
                   [&] {
                       return allocation_text("the input scan's row", std::array<index_t, 1>{x.dims[3]}, sizeof(Acc));
                   },
                   "Use a smaller head_dim");
    // One pass a row on packets: |x| into the row's sum and into a largest-|x| packet that runs over all the rows,
    // so a row costs one horizontal sum (a row's sum had cost two passes, two horizontal reductions and long double
    // compares, about a tenth of a 256-token causal prefill). The bound holds in any order of summation.
    using namespace Eigen::internal;
    using packet = typename packet_traits<Acc>::type;
    constexpr index_t lanes = packet_traits<Acc>::size;
    const index_t dim = x.dims[3];
    packet largest = pset1<packet>(Acc(0));
    Acc largest_tail = 0, max_l1 = 0;
    bool overflowed = false;
    for (index_t i = 0; i < x.dims[2]; ++i) {
        const T* row = x.row(b, h, i);
        const Acc* values = nullptr;
        if constexpr (std::is_same_v<T, Acc>) {
            values = row;
        } else {
            widen(row, dim, wide.data());
            values = wide.data();
        }
        packet sums = pset1<packet>(Acc(0));
        index_t d = 0;
        for (; d + lanes <= dim; d += lanes) {
            const packet a = pabs(ploadu<packet>(values + d));
            sums = padd(sums, a);
            largest = pmax(largest, a);
        }
        Acc l1 = predux(sums);
        for (; d < dim; ++d) {
            const Acc a = std::abs(values[d]);
            l1 += a;
            largest_tail = std::max(largest_tail, a);
        }
        if (!(l1 <= std::numeric_limits<Acc>::max())) {  // NaN, inf, or finite terms whose sum overflows Acc
            for (d = 0; d < dim; ++d)
                if (!std::isfinite(static_cast<Acc>(row[d]))) throw_non_finite(x, b, h, i, d, name);
            overflowed = true;
            continue;
        }
        max_l1 = std::max(max_l1, l1);
    }
    // Every value was finite here (a NaN or inf would have thrown), so pmax saw no NaN.
    m.max_abs = static_cast<long double>(std::max(predux_max(largest), largest_tail));
    m.max_l1 = overflowed ? std::numeric_limits<long double>::infinity() : static_cast<long double>(max_l1) * rounding;
    return m;
}

/// The largest |x_d| and row sums of |x_d| of one (batch, head) of any view (struct row_magnitudes).
template <class View>
row_magnitudes scan_magnitudes(const View& x, index_t b, index_t h, const char* name) {
    if constexpr (quantized_rows_v<View>) return scan_quantized_magnitudes(x, b, h);
    else return scan_value_magnitudes(x, b, h, name);
}

/// Element d of row (b, h, i) of a view as the kernels see it (widened to Acc), in long double.
template <class Acc, class View>
long double element(const View& x, index_t b, index_t h, index_t i, index_t d) {
    if constexpr (quantized_rows_v<View>) {
        using Block = row_scalar_t<View>;
        const Block& block = x.row(b, h, i)[d / Block::size];
        return static_cast<long double>(static_cast<float>(block.scale)) *
               static_cast<long double>(block_integer(block, d % Block::size));
    } else {
        return static_cast<long double>(static_cast<Acc>(x.row(b, h, i)[d]));
    }
}

/// The cheap bound of the file comment for one query head: |q.k| <= sum_d |q_d| |k_d| <= ||q||_1 max_d |k_d|, so
/// one product bounds every pair of the head. False: the pairs need checking one by one.
template <class Acc>
bool pairs_fit(const row_magnitudes& queries, long double key_max_abs, Acc scale) {
    const long double limit = static_cast<long double>(std::numeric_limits<Acc>::max()) / 2;
    return std::max<long double>(1, static_cast<long double>(scale)) * queries.max_l1 * key_max_abs <= limit;
}

/// The largest magnitude any element of a view can have, for a format that holds no NaN or inf and bounds its
/// values: quantized blocks (an int8 times a finite fp16 scale, 128 x 65504 at most; an int4, 8 x 65504). 0: no
/// such bound (floats, fp16, bf16 and paged blocks of them can hold anything their type can).
template <class View>
long double format_bound(const View&) {
    if constexpr (quantized_rows_v<View>) return block_format<row_scalar_t<View>>::largest_integer * 65504.0L;
    else return 0;
}

/// Whether q's side of the score rule (queries: q's head_magnitudes) fits against keys whose largest |k| is
/// key_max_abs(batch, kv head), for every head of the call: then no pair needs checking.
template <class Acc, class KeyMaxAbs>
bool queries_fit(const std::vector<row_magnitudes>& queries, const attention_shape& s, Acc scale,
                 const KeyMaxAbs& key_max_abs) {
    const long double limit = static_cast<long double>(std::numeric_limits<Acc>::max()) / 2;
    for (index_t b = 0; b < s.batch; ++b)
        for (index_t h = 0; h < s.heads; ++h) {
            const row_magnitudes& qm = queries[static_cast<std::size_t>(b * s.heads + h)];
            if (static_cast<long double>(scale) * qm.max_abs > limit ||
                !pairs_fit(qm, key_max_abs(b, s.kv_head(h)), scale))
                return false;
        }
    return true;
}

/// Whether check_finite's scan of k and v is settled without reading them: keys and values in a format with a
/// bound (format_bound: no NaN or inf either) and queries that fit against any key the format can hold.
template <class Acc, class Rows>
bool settled_by_format(const std::vector<row_magnitudes>& queries, const Rows& k, const attention_shape& s, Acc scale) {
    const long double bound = format_bound(k);
    return bound > 0 && queries_fit(queries, s, scale, [&](index_t, index_t) { return bound; });
}

/// scan_magnitudes of every (batch, head) of x (q or k, strided or paged), in that order, a (batch, head) per unit
/// of scan_units: a non-finite element is named as check_finite names it.
template <class View>
std::vector<row_magnitudes> head_magnitudes(const View& x, const char* name, int threads) {
    const index_t heads = x.dims[0] * x.dims[1];
    std::vector<row_magnitudes> m;
    allocating([&] { m.resize(static_cast<std::size_t>(heads)); },
               [&] {
                   return allocation_text("the input scan's per-head magnitudes",
                                          std::array<index_t, 2>{x.dims[0], x.dims[1]}, sizeof(row_magnitudes));
               },
               "Split the call over the batch");
    scan_units(heads, heads * x.dims[2] * x.dims[3], threads, [&](index_t n) {
        m[static_cast<std::size_t>(n)] = scan_magnitudes(x, n / x.dims[1], n % x.dims[1], name);
    });
    return m;
}

/// The rule of the file comment, given q's head_magnitudes `queries` (which checked q for NaN and inf), with
/// check_finite of k in the same pass: throws value_error attend.value.non_finite or attend.value.score_overflow.
/// q, k are checked views of a call of shape s (k strided or paged, of q's type or 16-bit); the scores are computed
/// in Acc, which sets the range (float for 16-bit storage: fp16 scores beyond 65504 are normal and fine).
template <class T, class KeyView, class Acc>
void check_scores_fit(const strided_view<const T>& q, const std::vector<row_magnitudes>& queries, const KeyView& k,
                      const attention_shape& s, Acc scale, int threads) {
    if (settled_by_format(queries, k, s, scale)) return;  // q8_0 keys under q's bound: nothing to read
    const long double limit = static_cast<long double>(std::numeric_limits<Acc>::max()) / 2;
    const long double sc = static_cast<long double>(scale), grow = std::max<long double>(1, sc);
    const std::vector<row_magnitudes> keys = head_magnitudes(k, "key", threads);
    for (index_t b = 0; b < s.batch; ++b)
        for (index_t h = 0; h < s.heads; ++h) {
            const index_t kvh = s.kv_head(h);
            const row_magnitudes qm = queries[static_cast<std::size_t>(b * s.heads + h)];
            const row_magnitudes km = keys[static_cast<std::size_t>(b * s.kv_heads + kvh)];
            if (sc * qm.max_abs > limit)
                throw value_error("attend.value.score_overflow",
                                  concat("scale ", static_cast<double>(scale), " x a query element of magnitude ",
                                         static_cast<double>(qm.max_abs), " (batch ", b, ", head ", h,
                                         ") leaves half the range of the scores' type (", static_cast<double>(limit),
                                         "); rescale the inputs"));
            if (pairs_fit(qm, km.max_abs, scale)) continue;
            for (index_t i = 0; i < s.query_len; ++i)
                for (index_t j = 0; j < s.key_len; ++j) {
                    long double sum = 0;
                    for (index_t d = 0; d < s.head_dim; ++d)
                        sum += std::fabs(element<Acc>(q, b, h, i, d) * element<Acc>(k, b, kvh, j, d));
                    if (grow * sum > limit)
                        throw value_error("attend.value.score_overflow",
                                          concat("the score of query ", i, " and key ", j, " (batch ", b, ", head ", h,
                                                 ") can reach ", static_cast<double>(grow * sum),
                                                 ", beyond half the range of the scores' type (",
                                                 static_cast<double>(limit),
                                                 "): it would overflow to inf; rescale q or k (or lower the scale)"));
                }
        }
}

/// check_finite's scan of k and v, after q's (`queries`, q's head_magnitudes): every score q.k must fit the
/// accumulation type, and v must be finite.
template <class T, class Rows>
void scan_keys_and_values(const strided_view<const T>& q, const std::vector<row_magnitudes>& queries, const Rows& k,
                          const Rows& v, const attention_shape& s, accumulator_t<T> scale, int threads) {
    check_scores_fit(q, queries, k, s, scale, threads);
    check_finite(v, "value", threads);
}

/// check_finite's scan of k and v for a kernel that reads them anyway (deferred_kv_scan): the call's q, k, v and
/// scale, kept for the verdict. verify needs only q's magnitudes (a decode's few rows) besides what the kernel
/// found; whenever those findings do not settle the call it runs the whole scan, so a call is rejected with the
/// same error and message either way.
template <class T, class Rows>
class kv_scan_of final : public deferred_kv_scan {
public:
    /// `queries`: q's head_magnitudes from check_call's scan of q, which q is not scanned again after.
    kv_scan_of(const strided_view<const T>& q, const Rows& k, const Rows& v, const attention_shape& s,
               accumulator_t<T> scale, const std::vector<row_magnitudes>& queries)
        : q_(q), k_(k), v_(v), s_(s), scale_(scale), queries_(queries) {}

    void scan_now(int threads) const override { scan_keys_and_values(q_, queries_, k_, v_, s_, scale_, threads); }

    void verify(const std::vector<double>& key_max_abs, bool non_finite) const override {
        if (non_finite) return scan_now(1);  // finds the first bad element and names it
        if (!queries_fit(queries_, s_, scale_, [&](index_t b, index_t kvh) {
                return static_cast<long double>(key_max_abs[static_cast<std::size_t>(b * s_.kv_heads + kvh)]);
            }))
            scan_now(1);
    }

    /// Whether the scan is settled without reading k or v (settled_by_format): the kernel need not note them.
    bool settled() const { return settled_by_format(queries_, k_, s_, scale_); }

private:
    strided_view<const T> q_;
    Rows k_, v_;
    attention_shape s_;
    accumulator_t<T> scale_;
    const std::vector<row_magnitudes>& queries_;
};

/// The magnitude whose bits (of a T) these are.
template <class T, class Bits>
double magnitude_of_bits(Bits b) {
    T x;
    std::memcpy(static_cast<void*>(&x), &b, sizeof x);
    return static_cast<double>(static_cast<accumulator_t<T>>(x));
}

/// Throws value_error `attend.value.quantized_range` for row (b, h, i) of x, which holds a value beyond what a
/// Block can hold, naming the first one.
template <class Block, class T>
[[noreturn]] void refuse_quantized_range(const strided_view<const T>& x, const char* name, index_t b, index_t h,
                                         index_t i) {
    constexpr double limit = block_format<Block>::max_magnitude;
    index_t d = 0;
    double value = 0;
    for (; d < x.dims[3]; ++d) {
        value = static_cast<double>(static_cast<accumulator_t<T>>(x.row(b, h, i)[d]));
        if (std::abs(value) > limit) break;
    }
    throw value_error("attend.value.quantized_range",
                      concat(name, ' ', spell_view(x), " holds ", value, " at ",
                             format_shape(std::array<index_t, 4>{b, h, i, d}), ", beyond the ", limit, " an ",
                             block_format<Block>::name, " block with an fp16 scale can hold"));
}

/// What a quantized cache of Block checks of values before it quantizes any: throws value_error
/// `attend.value.non_finite` (before anything else) or `attend.value.quantized_range` for the first value of x that
/// is NaN or +-inf or beyond block_format<Block>::max_magnitude. One pass over the rows' bits finds out whether any
/// is, the checks that name it run only then (two passes, the finiteness scan's and a magnitude's through double,
/// had taken as long as the quantization).
template <class Block, class T>
void check_quantizable(const strided_view<const T>& x, const char* name) {
    static_assert(is_storage_type_v<T>,
                  "attend: a quantized cache quantizes float, double, Eigen::half or Eigen::bfloat16 values");
    constexpr double limit = block_format<Block>::max_magnitude;
    const auto infinity = bits_of(std::numeric_limits<T>::infinity());
    std::remove_const_t<decltype(infinity)> largest = 0;
    for (index_t b = 0; b < x.dims[0]; ++b)
        for (index_t h = 0; h < x.dims[1]; ++h)
            for (index_t i = 0; i < x.dims[2]; ++i)
                largest = std::max(largest, largest_magnitude_bits(x.row(b, h, i), x.dims[3]));
    if (largest < infinity && magnitude_of_bits<T>(largest) <= limit) return;
    check_finite(x, name);  // throws if a value is NaN or +-inf
    for (index_t b = 0; b < x.dims[0]; ++b)
        for (index_t h = 0; h < x.dims[1]; ++h)
            for (index_t i = 0; i < x.dims[2]; ++i)
                if (magnitude_of_bits<T>(largest_magnitude_bits(x.row(b, h, i), x.dims[3])) > limit)
                    refuse_quantized_range<Block>(x, name, b, h, i);
}

}  // namespace attend::detail
