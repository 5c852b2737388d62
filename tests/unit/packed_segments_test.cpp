// SPDX-License-Identifier: MIT
// Packed variable-length sequences (packed_segments, mask.hpp): query slot n sees only key slot n, causally or in
// a window aligned within the segment, with padding at the end of slots and past the last one. Proven against
// attending each segment alone (forward and backward), by finite differences, tiled against reference with every
// other score feature, against a brute-force check of the tile classifier, and on its error paths.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include <attend/attend.hpp>

#include "support/compare.hpp"
#include "support/errors.hpp"
#include "support/finite_differences.hpp"
#include "support/kernel_agreement.hpp"
#include "support/random.hpp"
#include "support/scalar_names.hpp"

namespace {

using attend::alignment;
using attend::index_t;

/// Segments with slots and real lengths along both axes: q `[batch, heads, query_len, dim]`, k and v
/// `[batch, kv_heads, key_len, dim]`, query_len and key_len a little past the last slot (trailing padding).
template <class T>
struct packed_case {
    index_t batch = 2, heads = 4, kv_heads = 2, dim = 8;
    std::vector<index_t> query_offsets{0}, key_offsets{0}, query_lengths, key_lengths;
    index_t query_len = 0, key_len = 0;
    attend::tensor<T, 4> q, k, v;

    /// Real lengths 1..max_len (keys) and 0..max_len (queries), slots up to 2 longer.
    packed_case(std::uint64_t seed, int segments, index_t max_len) {
        attend_test::rng r(seed);
        for (int n = 0; n < segments; ++n) {
            const index_t real_q = r.uniform_int(0, max_len), real_k = r.uniform_int(1, max_len);
            query_lengths.push_back(real_q);
            key_lengths.push_back(real_k);
            query_offsets.push_back(query_offsets.back() + real_q + r.uniform_int(0, 2));
            key_offsets.push_back(key_offsets.back() + real_k + r.uniform_int(0, 2));
        }
        query_len = query_offsets.back() + 3;
        key_len = key_offsets.back() + 2;
        q = attend_test::random_tensor<T>(seed + 1, batch, heads, query_len, dim) * T(2);
        k = attend_test::random_tensor<T>(seed + 2, batch, kv_heads, key_len, dim) * T(2);
        v = attend_test::random_tensor<T>(seed + 3, batch, kv_heads, key_len, dim);
    }
    attend::packed_segments_rule packed() const {
        return attend::packed_segments(attend::segment_offsets(query_offsets), attend::segment_offsets(key_offsets))
            .with_lengths(query_lengths, key_lengths);
    }
};

/// Rows [begin, begin + len) of axis 2 of x.
template <class T>
attend::tensor<T, 4> rows_of(const attend::tensor<T, 4>& x, index_t begin, index_t len) {
    attend::tensor<T, 4> part(x.dimension(0), x.dimension(1), len, x.dimension(3));
    for (index_t b = 0; b < x.dimension(0); ++b)
        for (index_t h = 0; h < x.dimension(1); ++h)
            for (index_t i = 0; i < len; ++i)
                for (index_t d = 0; d < x.dimension(3); ++d) part(b, h, i, d) = x(b, h, begin + i, d);
    return part;
}

/// What a segment's rule is when it is attended alone.
enum class within { everything, causal_top_left, causal_bottom_right, window_bottom_right };

attend::packed_segments_rule restricted(attend::packed_segments_rule r, within w) {
    switch (w) {
        case within::everything: return r;
        case within::causal_top_left: return r.causal(alignment::top_left);
        case within::causal_bottom_right: return r.causal(alignment::bottom_right);
        case within::window_bottom_right: return r.window(3, 1, alignment::bottom_right);
    }
    return r;
}

/// f(mask) with the rule of one segment alone.
template <class F>
auto alone(within w, F&& f) {
    switch (w) {
        case within::causal_top_left: return f(attend::causal(alignment::top_left));
        case within::causal_bottom_right: return f(attend::causal(alignment::bottom_right));
        case within::window_bottom_right: return f(attend::sliding_window(3, 1, alignment::bottom_right));
        default: return f(attend::sliding_window(1 << 20, 1 << 20, attend::alignment::top_left));
    }
}

template <class T>
class PackedSegments : public ::testing::Test {};
TYPED_TEST_SUITE(PackedSegments, attend_test::scalar_types, attend_test::scalar_names);

TYPED_TEST(PackedSegments, EverySegmentEqualsItselfAttendedAloneAndPaddingIsZero) {
    using T = TypeParam;
    const double tolerance = std::is_same_v<T, float> ? 2e-6 : 1e-13;
    const packed_case<T> c(7, 9, 40);
    for (const within w :
         {within::everything, within::causal_top_left, within::causal_bottom_right, within::window_bottom_right}) {
        SCOPED_TRACE(static_cast<int>(w));
        attend::sdpa_options o;
        o.empty_rows = attend::empty_rows::zero;  // bottom-right: a segment's first queries may see nothing
        const auto mask = restricted(c.packed(), w);
        std::vector<attend::attention_result<T, 4>> packed;
        for (const auto kernel : {attend::kernel::reference, attend::kernel::tiled})
            for (const int threads : {1, 2}) {
                o.kernel = kernel;
                o.threads = threads;
                packed.push_back(attend::scaled_dot_product_attention(c.q, c.k, c.v, mask, o));
            }
        EXPECT_TRUE(attend_test::bit_equal(packed[2].out, packed[3].out));
        o.kernel = attend::kernel::reference;
        std::vector<char> real(static_cast<std::size_t>(c.query_len), 0);
        for (std::size_t n = 0; n + 1 < c.query_offsets.size(); ++n) {
            const index_t q0 = c.query_offsets[n], nq = c.query_lengths[n];
            const index_t k0 = c.key_offsets[n], nk = c.key_lengths[n];
            if (nq == 0) continue;
            std::fill(real.begin() + q0, real.begin() + q0 + nq, 1);
            const auto want = alone(w, [&](const auto& m) {
                return attend::scaled_dot_product_attention(rows_of(c.q, q0, nq), rows_of(c.k, k0, nk),
                                                            rows_of(c.v, k0, nk), m, o);
            });
            for (const auto& r : packed) {
                double worst = 0, worst_lse = 0;
                for (index_t b = 0; b < c.batch; ++b)
                    for (index_t h = 0; h < c.heads; ++h)
                        for (index_t i = 0; i < nq; ++i) {
                            for (index_t d = 0; d < c.dim; ++d)
                                worst = std::max(worst, std::abs(static_cast<double>(r.out(b, h, q0 + i, d)) -
                                                                 static_cast<double>(want.out(b, h, i, d))));
                            const double a = r.lse(b, h, q0 + i), e = want.lse(b, h, i);
                            worst_lse = std::max(worst_lse, a == e ? 0.0 : std::abs(a - e));
                        }
                EXPECT_LE(worst, tolerance) << "segment " << n;
                EXPECT_LE(worst_lse, 10 * tolerance) << "segment " << n;
            }
        }
        // Padded queries (the end of a slot, past the last slot): zero rows, lse -inf.
        for (const auto& r : packed)
            for (index_t i = 0; i < c.query_len; ++i) {
                if (real[static_cast<std::size_t>(i)]) continue;
                EXPECT_EQ(r.lse(1, 3, i), -std::numeric_limits<T>::infinity()) << "query " << i;
                EXPECT_EQ(r.out(0, 1, i, 2), T(0)) << "query " << i;
            }
    }
}

TEST(PackedSegmentsBackward, GradientsEqualEachSegmentAloneAndPaddedKeysGetNone) {
    const packed_case<double> c(11, 6, 30);
    attend::sdpa_options o;
    o.empty_rows = attend::empty_rows::zero;
    const auto mask = c.packed().causal(alignment::bottom_right);
    const auto d_out = attend_test::random_tensor<double>(5, c.batch, c.heads, c.query_len, c.dim);
    for (const auto kernel : {attend::kernel::reference, attend::kernel::tiled}) {
        o.kernel = kernel;
        const auto f = attend::scaled_dot_product_attention(c.q, c.k, c.v, mask, o);
        const auto g = attend::scaled_dot_product_attention_backward(c.q, c.k, c.v, mask, f, d_out, o);
        std::vector<char> real_key(static_cast<std::size_t>(c.key_len), 0);
        for (std::size_t n = 0; n + 1 < c.query_offsets.size(); ++n) {
            const index_t q0 = c.query_offsets[n], nq = c.query_lengths[n];
            const index_t k0 = c.key_offsets[n], nk = c.key_lengths[n];
            std::fill(real_key.begin() + k0, real_key.begin() + k0 + nk, 1);
            if (nq == 0) continue;
            const auto m = attend::causal(alignment::bottom_right);
            const auto qs = rows_of(c.q, q0, nq), ks = rows_of(c.k, k0, nk), vs = rows_of(c.v, k0, nk);
            const auto fs = attend::scaled_dot_product_attention(qs, ks, vs, m, o);
            const auto gs = attend::scaled_dot_product_attention_backward(qs, ks, vs, m, fs, rows_of(d_out, q0, nq), o);
            EXPECT_LE(attend_test::max_abs_diff(rows_of(g.d_query, q0, nq), gs.d_query), 1e-13) << "segment " << n;
            EXPECT_LE(attend_test::max_abs_diff(rows_of(g.d_key, k0, nk), gs.d_key), 1e-13) << "segment " << n;
            EXPECT_LE(attend_test::max_abs_diff(rows_of(g.d_value, k0, nk), gs.d_value), 1e-13) << "segment " << n;
        }
        for (index_t j = 0; j < c.key_len; ++j) {
            if (real_key[static_cast<std::size_t>(j)]) continue;
            for (index_t d = 0; d < c.dim; ++d) EXPECT_EQ(g.d_key(1, 1, j, d), 0.0) << "padded key " << j;
        }
    }
}

TEST(PackedSegmentsBackward, GradientsOfBothKernelsEqualFiniteDifferences) {
    packed_case<double> c(3, 3, 4);
    c.dim = 3;
    c.q = attend_test::random_tensor<double>(4, c.batch, c.heads, c.query_len, c.dim);
    c.k = attend_test::random_tensor<double>(5, c.batch, c.kv_heads, c.key_len, c.dim);
    c.v = attend_test::random_tensor<double>(6, c.batch, c.kv_heads, c.key_len, c.dim);
    attend::sdpa_options o;
    o.empty_rows = attend::empty_rows::zero;
    const auto mask = c.packed().window(1, 0, alignment::bottom_right);
    const auto w = attend_test::random_tensor<double>(7, c.batch, c.heads, c.query_len, c.dim);
    const auto loss = [&] {
        auto r = o;
        r.kernel = attend::kernel::reference;
        return attend_test::linear_loss(attend::scaled_dot_product_attention(c.q, c.k, c.v, mask, r).out, w);
    };
    const auto fd_q = attend_test::fd_gradient(c.q, loss);
    const auto fd_k = attend_test::fd_gradient(c.k, loss);
    const auto fd_v = attend_test::fd_gradient(c.v, loss);
    for (const auto kernel : {attend::kernel::reference, attend::kernel::tiled}) {
        o.kernel = kernel;
        const auto f = attend::scaled_dot_product_attention(c.q, c.k, c.v, mask, o);
        const auto g = attend::scaled_dot_product_attention_backward(c.q, c.k, c.v, mask, f, w, o);
        attend_test::expect_close_to_fd(g.d_query, fd_q, "dq");
        attend_test::expect_close_to_fd(g.d_key, fd_k, "dk");
        attend_test::expect_close_to_fd(g.d_value, fd_v, "dv");
    }
}

/// Tiled against reference with every score feature at once: packed segments with a per-segment window and a
/// global sliding window on top, sinks, softcap, ALiBi, grouped heads and dropout; forward and every gradient.
TEST(PackedSegmentsCombined, TiledEqualsReferenceWithSinksSoftcapWindowGqaAndDropout) {
    const packed_case<double> c(21, 6, 100);
    attend::sdpa_options o;
    o.empty_rows = attend::empty_rows::zero;
    o.softcap = 5.0;
    o.sinks = attend::attention_sinks{0.5, -1.0, 2.0, 0.0};
    o.score_bias = attend::score_bias::alibi(attend::alibi_slopes(c.heads), attend::alignment::top_left);
    o.dropout = {0.1, 9, true};
    o.need_weights = true;
    const auto mask = c.packed().window(64, 0, alignment::bottom_right) &&
                      attend::sliding_window(1000, 1000, attend::alignment::top_left);
    const auto d_out = attend_test::random_tensor<double>(8, c.batch, c.heads, c.query_len, c.dim);
    attend_test::expect_kernels_agree(attend_test::run_every_kernel(c.q, c.k, c.v, d_out, mask, o));
}

TEST(PackedSegmentsTiles, ClassifierIsExactForEmptyAndFullAndSkipsCrossSegmentTiles) {
    for (std::uint64_t seed = 1; seed <= static_cast<std::uint64_t>(attend_test::repeat(12)); ++seed) {
        const packed_case<float> c(seed, 7, 24);
        const attend::attention_shape s = attend::detail::check_views(
            attend::detail::as_view(c.q), attend::detail::as_view(c.k), attend::detail::as_view(c.v));
        for (const within w :
             {within::everything, within::causal_top_left, within::causal_bottom_right, within::window_bottom_right}) {
            const auto bound = restricted(c.packed(), w).bind(s);
            attend_test::rng r(seed * 31 + static_cast<std::uint64_t>(w));
            for (int n = 0; n < 200; ++n) {
                const index_t q0 = r.uniform_int(0, s.query_len - 1), k0 = r.uniform_int(0, s.key_len - 1);
                const attend::tile t{
                    0, 0, q0, r.uniform_int(q0 + 1, s.query_len), k0, r.uniform_int(k0 + 1, s.key_len)};
                bool any = false, all = true;
                for (index_t i = t.query_begin; i < t.query_end; ++i) {
                    all = all && !bound.query_padded(0, i);
                    for (index_t j = t.key_begin; j < t.key_end; ++j) {
                        const bool a = bound.allowed(0, 0, i, j);
                        any = any || a;
                        all = all && a;
                    }
                }
                // Exact both ways: empty exactly when nothing is allowed, full exactly when everything is.
                const attend::tile_class got = bound.classify(t);
                ASSERT_EQ(got == attend::tile_class::empty, !any) << "seed " << seed << " tile " << q0 << ',' << k0;
                ASSERT_EQ(got == attend::tile_class::full, all) << "seed " << seed << " tile " << q0 << ',' << k0;
            }
        }
    }
    // Eight sequences of 512 packed into 4096: a tile of one segment's queries against another's keys is empty.
    std::vector<index_t> offsets;
    for (index_t n = 0; n <= 8; ++n) offsets.push_back(512 * n);
    attend::attention_shape s;
    s.batch = s.heads = s.kv_heads = 1;
    s.query_len = s.key_len = 4096;
    s.head_dim = s.value_dim = 64;
    const auto bound = attend::packed_segments(attend::segment_offsets(offsets), attend::segment_offsets(offsets))
                           .causal(alignment::top_left)
                           .bind(s);
    EXPECT_EQ(bound.classify({0, 0, 512, 640, 0, 512}), attend::tile_class::empty);
    EXPECT_EQ(bound.classify({0, 0, 640, 768, 512, 640}), attend::tile_class::full);
    EXPECT_EQ(bound.classify({0, 0, 512, 640, 512, 640}), attend::tile_class::mixed);
}

TEST(PackedSegmentsErrors, OffsetsAndLengthsThatDoNotDescribeSegmentsAreRejectedBeforeAnyWrite) {
    const packed_case<float> c(2, 3, 5);
    attend::tensor<float, 4> out(c.batch, c.heads, c.query_len, c.dim);
    out.setConstant(42.0f);
    const auto rejects = [&](const attend::packed_segments_rule& rule, const std::string& what) {
        SCOPED_TRACE(what);
        attend_test::expect_error<attend::mask_error>(
            [&] { attend::scaled_dot_product_attention_into(c.q, c.k, c.v, rule, out); }, "attend.mask.segments");
        EXPECT_TRUE(std::all_of(out.data(), out.data() + out.size(), [](float x) { return x == 42.0f; }));
    };
    const auto qo = c.query_offsets, ko = c.key_offsets;
    rejects(attend::packed_segments(attend::segment_offsets({0}), attend::segment_offsets({0})), "no segment");
    rejects(attend::packed_segments(attend::segment_offsets(qo), attend::segment_offsets({0, 1})),
            "different segment counts");
    rejects(attend::packed_segments(attend::segment_offsets({1, qo.back()}), attend::segment_offsets({0, ko.back()})),
            "offsets not from 0");
    rejects(attend::packed_segments(attend::segment_offsets({0, 3, 2, qo.back()}), attend::segment_offsets(ko)),
            "decreasing offsets");
    rejects(attend::packed_segments(attend::segment_offsets({0, c.query_len + 1}), attend::segment_offsets({0, 1})),
            "past query_len");
    rejects(attend::packed_segments(attend::segment_offsets({0, 1}), attend::segment_offsets({0, c.key_len + 1})),
            "past key_len");
    rejects(c.packed().with_lengths({1, 1}, c.key_lengths), "lengths for two of three segments");
    rejects(c.packed().with_lengths({-1, 0, 0}, c.key_lengths), "negative length");
    rejects(c.packed().with_lengths(c.query_lengths, {ko[1] - ko[0] + 1, 1, 1}), "length past its slot");
    attend_test::expect_error<attend::mask_error>([&] { c.packed().window(-1, 0, attend::alignment::top_left); },
                                                  "attend.mask.window");
}

}  // namespace
