// SPDX-License-Identifier: MIT
// merge_partials (merge.hpp): attention over two disjoint key sets, merged from each part's out and lse, equals
// attention over their union. Random configurations (rank 3 and 4, GQA, float and double, both kernels), parts
// made by slicing K/V and by complementary masks (which leave rows with no key in a part: lse -inf).
//
// Tolerance of merged vs whole: float 1e-6, double 1e-13. Key lengths stay <= 16 and values in [-1, 1), so any
// summation order of a row (sum |w_j v_j| <= 1) moves it by at most 16 * eps / 2: 9.5e-7 in float, 1.8e-15 in
// double; the merge itself adds a few ulps.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include <attend/attend.hpp>

#include "support/compare.hpp"
#include "support/errors.hpp"
#include "support/random.hpp"
#include "support/scalar_names.hpp"

namespace {

using attend::index_t;
using attend_test::identical;
using attend_test::near;
using attend_test::rng;
template <class T, int Rank>
using tensor = attend::tensor<T, Rank>;

template <class T>
double tol() {
    return std::is_same_v<T, float> ? 1e-6 : 1e-13;
}

struct config {
    index_t batch, heads, kv_heads, query_len, key_len, head_dim, value_dim;
    bool rank3;
    attend::kernel kernel;
    std::uint64_t seed;
};

std::string describe(const config& c) {
    std::ostringstream s;
    s << "seed " << c.seed << ": rank " << (c.rank3 ? 3 : 4) << ", batch " << c.batch << ", heads " << c.heads
      << ", kv_heads " << c.kv_heads << ", query_len " << c.query_len << ", key_len " << c.key_len << ", head_dim "
      << c.head_dim << ", value_dim " << c.value_dim
      << (c.kernel == attend::kernel::reference ? ", reference kernel" : ", tiled kernel");
    return s.str();
}

config random_config(std::uint64_t seed) {
    rng g(seed * 0x2545F4914F6CDD1DULL + 99);
    config c{};
    c.seed = seed;
    c.rank3 = g.bernoulli(0.3);
    c.batch = g.uniform_int(1, 3);
    c.kv_heads = c.rank3 ? 1 : g.uniform_int(1, 3);
    c.heads = c.rank3 ? 1 : c.kv_heads * g.uniform_int(1, 3);
    c.query_len = g.uniform_int(1, 9);
    c.key_len = g.uniform_int(2, 16);
    c.head_dim = g.uniform_int(1, 7);
    c.value_dim = g.uniform_int(1, 7);
    c.kernel = g.bernoulli(0.5) ? attend::kernel::reference : attend::kernel::tiled;
    return c;
}

/// Rank-4 tensors [B, heads, len, dim] of the configuration; for rank 3 the heads axis is dropped.
template <class T, int Rank>
tensor<T, Rank> random_input(const config& c, std::uint64_t seed, index_t heads, index_t len, index_t dim) {
    tensor<T, Rank> t;
    if constexpr (Rank == 4) t.resize(c.batch, heads, len, dim);
    else t.resize(c.batch, len, dim);
    attend_test::fill_uniform(t, seed);
    return t;
}

/// Keys [begin, end) of k or v (the len axis is Rank - 2).
template <class T, int Rank>
tensor<T, Rank> slice_keys(const tensor<T, Rank>& x, index_t begin, index_t end) {
    auto offsets = x.dimensions();
    auto extents = x.dimensions();
    for (auto& o : offsets) o = 0;
    offsets[Rank - 2] = begin;
    extents[Rank - 2] = end - begin;
    return x.slice(offsets, extents);
}

template <class T, int Rank>
void check_split_by_slicing(const config& c, rng& g) {
    const index_t H = Rank == 4 ? c.heads : 1, G = Rank == 4 ? c.kv_heads : 1;
    const auto q = random_input<T, Rank>(c, c.seed * 3 + 1, H, c.query_len, c.head_dim);
    const auto k = random_input<T, Rank>(c, c.seed * 3 + 2, G, c.key_len, c.head_dim);
    const auto v = random_input<T, Rank>(c, c.seed * 3 + 3, G, c.key_len, c.value_dim);
    const index_t a = g.uniform_int(1, c.key_len - 1);
    SCOPED_TRACE(describe(c) + ", split at key " + std::to_string(a));
    attend::sdpa_options o;
    o.need_lse = true;
    o.kernel = c.kernel;
    // A mask given to both parts must be cut the same way; causal bottom_right is not shift-invariant, so the
    // sliced parts use no mask and the whole uses none either.
    const auto whole = attend::scaled_dot_product_attention(q, k, v, o);
    const auto part_a = attend::scaled_dot_product_attention(q, slice_keys(k, 0, a), slice_keys(v, 0, a), o);
    const auto part_b =
        attend::scaled_dot_product_attention(q, slice_keys(k, a, c.key_len), slice_keys(v, a, c.key_len), o);
    const auto merged = attend::merge_partials(part_a.out, part_a.lse, part_b.out, part_b.lse);
    ASSERT_TRUE(near(merged.out, whole.out, tol<T>()));
    ASSERT_TRUE(near(merged.lse, whole.lse, tol<T>() * 8));  // |lse| <= ~5: a few ulps of that
    // TensorMap views of the parts (caller memory, read without a copy; const and mutable maps mixed) merge to
    // the same bits as the tensors.
    {
        const attend::const_tensor_view<T, Rank> out_a(part_a.out.data(), part_a.out.dimensions());
        const attend::const_tensor_view<T, Rank - 1> lse_a(part_a.lse.data(), part_a.lse.dimensions());
        auto out_b_copy = part_b.out;
        const attend::tensor_view<T, Rank> out_b(out_b_copy.data(), out_b_copy.dimensions());
        const auto viewed = attend::merge_partials(out_a, lse_a, out_b, part_b.lse);
        ASSERT_TRUE(identical(viewed.out, merged.out));
        ASSERT_TRUE(identical(viewed.lse, merged.lse));
    }
    // The merge is symmetric, bit for bit (addition and max commute).
    const auto swapped = attend::merge_partials(part_b.out, part_b.lse, part_a.out, part_a.lse);
    ASSERT_TRUE(identical(swapped.out, merged.out));
    ASSERT_TRUE(identical(swapped.lse, merged.lse));
    // Three parts merge in either grouping to the whole.
    if (c.key_len >= 3) {
        const index_t b = g.uniform_int(1, c.key_len - 2), d = g.uniform_int(b + 1, c.key_len - 1);
        const auto p0 = attend::scaled_dot_product_attention(q, slice_keys(k, 0, b), slice_keys(v, 0, b), o);
        const auto p1 = attend::scaled_dot_product_attention(q, slice_keys(k, b, d), slice_keys(v, b, d), o);
        const auto p2 =
            attend::scaled_dot_product_attention(q, slice_keys(k, d, c.key_len), slice_keys(v, d, c.key_len), o);
        const auto left = attend::merge_partials(p0.out, p0.lse, p1.out, p1.lse);
        const auto left_all = attend::merge_partials(left.out, left.lse, p2.out, p2.lse);
        const auto right = attend::merge_partials(p1.out, p1.lse, p2.out, p2.lse);
        const auto right_all = attend::merge_partials(p0.out, p0.lse, right.out, right.lse);
        ASSERT_TRUE(near(left_all.out, whole.out, tol<T>()));
        ASSERT_TRUE(near(right_all.out, whole.out, tol<T>()));
        ASSERT_TRUE(near(left_all.lse, whole.lse, tol<T>() * 8));
        ASSERT_TRUE(near(right_all.lse, whole.lse, tol<T>() * 8));
    }
}

/// Parts by masks: keys j < split[b] (key_padding) and keys j >= split[b] (its complement), both intersected with
/// causal; split[b] may be 0 or key_len, so a part can have no key at all for a row (lse -inf, zero out).
template <class T, int Rank>
void check_split_by_masks(const config& c, rng& g, int& empty_part_rows) {
    const index_t H = Rank == 4 ? c.heads : 1, G = Rank == 4 ? c.kv_heads : 1;
    const auto q = random_input<T, Rank>(c, c.seed * 3 + 1, H, c.query_len, c.head_dim);
    const auto k = random_input<T, Rank>(c, c.seed * 3 + 2, G, c.key_len, c.head_dim);
    const auto v = random_input<T, Rank>(c, c.seed * 3 + 3, G, c.key_len, c.value_dim);
    std::vector<index_t> split;
    for (index_t b = 0; b < c.batch; ++b) split.push_back(g.uniform_int(0, c.key_len));
    const auto align = g.bernoulli(0.5) ? attend::alignment::top_left : attend::alignment::bottom_right;
    SCOPED_TRACE(describe(c) + (align == attend::alignment::top_left ? ", causal top_left" : ", causal bottom_right"));
    attend::sdpa_options o;
    o.need_lse = true;
    o.kernel = c.kernel;
    o.empty_rows = attend::empty_rows::zero;
    const auto causal = attend::causal(align);
    const auto whole = attend::scaled_dot_product_attention(q, k, v, causal, o);
    const auto part_a = attend::scaled_dot_product_attention(q, k, v, causal && attend::key_padding(split), o);
    const auto part_b = attend::scaled_dot_product_attention(q, k, v, causal && !attend::key_padding(split), o);
    for (index_t n = 0; n < part_a.lse.size(); ++n)
        empty_part_rows += (part_a.lse.data()[n] == -std::numeric_limits<T>::infinity()) +
                           (part_b.lse.data()[n] == -std::numeric_limits<T>::infinity());
    const auto merged = attend::merge_partials(part_a.out, part_a.lse, part_b.out, part_b.lse);
    ASSERT_TRUE(near(merged.out, whole.out, tol<T>()));
    ASSERT_TRUE(near(merged.lse, whole.lse, tol<T>() * 8));  // includes -inf == -inf for rows empty in both
}

template <class T>
class MergePartials : public ::testing::Test {};
TYPED_TEST_SUITE(MergePartials, attend_test::scalar_types, attend_test::scalar_names);

TYPED_TEST(MergePartials, AttentionOverTwoKeySlicesMergedEqualsAttentionOverAllKeys) {
    using T = TypeParam;
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        const config c = random_config(100 + static_cast<std::uint64_t>(n));
        rng g(c.seed);
        if (c.rank3) check_split_by_slicing<T, 3>(c, g);
        else check_split_by_slicing<T, 4>(c, g);
        if (::testing::Test::HasFatalFailure()) return;
    }
}

TYPED_TEST(MergePartials, AttentionUnderComplementaryKeyMasksMergedEqualsAttentionUnderTheUnion) {
    using T = TypeParam;
    int empty_part_rows = 0;
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        const config c = random_config(5000 + static_cast<std::uint64_t>(n));
        rng g(c.seed);
        if (c.rank3) check_split_by_masks<T, 3>(c, g, empty_part_rows);
        else check_split_by_masks<T, 4>(c, g, empty_part_rows);
        if (::testing::Test::HasFatalFailure()) return;
    }
    EXPECT_GT(empty_part_rows, 100) << "parts with no key for some rows (lse -inf) must be exercised";
}

TYPED_TEST(MergePartials, PartWithMinusInfinityLseLeavesTheOtherPartUnchangedBitForBit) {
    using T = TypeParam;
    const T minus_inf = -std::numeric_limits<T>::infinity();
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        rng g(700 + static_cast<std::uint64_t>(n));
        const index_t B = g.uniform_int(1, 3), H = g.uniform_int(1, 4), L = g.uniform_int(1, 9),
                      D = g.uniform_int(1, 9);
        tensor<T, 4> out_a(B, H, L, D), out_b(B, H, L, D);
        tensor<T, 3> lse_a(B, H, L), lse_b(B, H, L);
        attend_test::fill_uniform(out_a, g.next());
        attend_test::fill_uniform(out_b, g.next(), -50, 50);  // whatever an empty part holds, it must not leak
        attend_test::fill_uniform(lse_a, g.next(), -30, 30);
        // b empty on a random subset of rows; a empty on a disjoint subset.
        std::vector<int> kind(static_cast<std::size_t>(lse_a.size()));
        for (index_t r = 0; r < lse_a.size(); ++r) {
            kind[static_cast<std::size_t>(r)] = static_cast<int>(g.uniform_int(0, 2));
            lse_b.data()[r] = static_cast<T>(g.uniform(-30, 30));
            if (kind[static_cast<std::size_t>(r)] == 1) lse_b.data()[r] = minus_inf;
            if (kind[static_cast<std::size_t>(r)] == 2) lse_a.data()[r] = minus_inf;
        }
        const auto m = attend::merge_partials(out_a, lse_a, out_b, lse_b);
        for (index_t r = 0; r < lse_a.size(); ++r) {
            const int k = kind[static_cast<std::size_t>(r)];
            if (k == 0) continue;
            const auto& keep_out = k == 1 ? out_a : out_b;
            const auto& keep_lse = k == 1 ? lse_a : lse_b;
            ASSERT_EQ(m.lse.data()[r], keep_lse.data()[r]) << "row " << r;
            for (index_t d = 0; d < D; ++d)
                ASSERT_EQ(m.out.data()[r * D + d], keep_out.data()[r * D + d]) << "row " << r;
        }
    }
}

TYPED_TEST(MergePartials, BothPartsMinusInfinityGiveZeroOutputAndMinusInfinityLseWithoutNaN) {
    using T = TypeParam;
    const T minus_inf = -std::numeric_limits<T>::infinity();
    tensor<T, 3> out_a(2, 3, 4), out_b(2, 3, 4);  // rank 3: [batch, query_len, value_dim]
    tensor<T, 2> lse_a(2, 3), lse_b(2, 3);
    attend_test::fill_uniform(out_a, 1, -9, 9);
    attend_test::fill_uniform(out_b, 2, -9, 9);
    lse_a.setConstant(minus_inf);
    lse_b.setConstant(minus_inf);
    lse_a(1, 2) = T(0.5);  // one row not empty, to see it survive next to empty ones
    const auto m = attend::merge_partials(out_a, lse_a, out_b, lse_b);
    for (index_t b = 0; b < 2; ++b)
        for (index_t i = 0; i < 3; ++i) {
            if (b == 1 && i == 2) {
                EXPECT_EQ(m.lse(b, i), T(0.5));
                for (index_t d = 0; d < 4; ++d) EXPECT_EQ(m.out(b, i, d), out_a(b, i, d));
                continue;
            }
            EXPECT_EQ(m.lse(b, i), minus_inf);
            for (index_t d = 0; d < 4; ++d) {
                EXPECT_FALSE(std::isnan(m.out(b, i, d)));
                EXPECT_EQ(m.out(b, i, d), T(0));
            }
        }
}

// ---------------------------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------------------------

template <class E, class F>
void expect_error(F&& f, const std::string& id, const std::vector<std::string>& fragments) {
    try {
        f();
        ADD_FAILURE() << "expected " << id;
    } catch (const E& e) {
        EXPECT_EQ(e.id(), id);
        const std::string what = e.what();
        EXPECT_EQ(what, e.message() + " [" + id + "]") << what;
        for (const auto& fragment : fragments)
            EXPECT_NE(what.find(fragment), std::string::npos) << "message lacks \"" << fragment << "\": " << what;
    } catch (const std::exception& e) {
        ADD_FAILURE() << "expected " << id << ", got " << e.what();
    }
}

TEST(MergePartialsErrors, PartsOfDifferentShapesAreShapeMerge) {
    tensor<float, 4> out(2, 3, 4, 5), other(2, 3, 4, 6);
    tensor<float, 3> lse(2, 3, 4), wrong_lse(2, 4, 3);
    out.setZero();
    other.setZero();
    lse.setZero();
    wrong_lse.setZero();
    expect_error<attend::shape_error>([&] { (void)attend::merge_partials(out, lse, other, lse); }, "attend.shape.merge",
                                      {"out_a [2,3,4,5]", "out_b [2,3,4,6]"});
    expect_error<attend::shape_error>([&] { (void)attend::merge_partials(out, wrong_lse, out, lse); },
                                      "attend.shape.merge", {"lse_a [2,4,3]", "lse_b [2,3,4]"});
    expect_error<attend::shape_error>([&] { (void)attend::merge_partials(out, lse, out, wrong_lse); },
                                      "attend.shape.merge", {"lse_b [2,4,3]"});
}

TEST(MergePartialsErrors, ViewsOfDifferentShapesAreShapeMerge) {
    std::vector<float> memory(2 * 3 * 4 * 6, 0.f), lse_memory(2 * 3 * 4, 0.f);
    const attend::const_tensor_view<float, 4> out(memory.data(), 2, 3, 4, 5), other(memory.data(), 2, 3, 4, 6);
    const attend::const_tensor_view<float, 3> lse(lse_memory.data(), 2, 3, 4);
    expect_error<attend::shape_error>([&] { (void)attend::merge_partials(out, lse, other, lse); }, "attend.shape.merge",
                                      {"out_a [2,3,4,5]", "out_b [2,3,4,6]"});
}

TEST(MergePartialsErrors, NaNOrPlusInfinityLseIsValueLse) {
    for (const bool in_a : {true, false})
        for (const double bad : {std::nan(""), std::numeric_limits<double>::infinity()}) {
            SCOPED_TRACE(std::string(in_a ? "lse_a" : "lse_b") + " holds " + std::to_string(bad));
            tensor<double, 3> out(2, 3, 4);
            tensor<double, 2> lse(2, 3), broken(2, 3);
            out.setZero();
            lse.setZero();
            broken.setZero();
            broken(1, 1) = bad;
            expect_error<attend::value_error>(
                [&] {
                    (void)(in_a ? attend::merge_partials(out, broken, out, lse)
                                : attend::merge_partials(out, lse, out, broken));
                },
                "attend.value.lse", {"flat index 4"});
        }
}

// ---- split-KV through key_range views (views.hpp) ------------------------------------------------------------

template <class T>
class SplitKeyValue : public ::testing::Test {};
TYPED_TEST_SUITE(SplitKeyValue, attend_test::scalar_types, attend_test::scalar_names);

TYPED_TEST(SplitKeyValue, KeyRangesOfOneCacheMergeIntoTheWholeCallWithoutCopying) {
    using T = TypeParam;
    const double tolerance = std::is_same_v<T, float> ? 2e-6 : 1e-13;
    const index_t B = 2, H = 8, G = 2, S = 300, D = 16;
    const auto q = attend_test::random_tensor<T>(1, B, H, 1, D), k = attend_test::random_tensor<T>(2, B, G, S, D),
               v = attend_test::random_tensor<T>(3, B, G, S, D);
    attend::sdpa_options o;
    o.sinks = attend::attention_sinks{0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8};  // on the first range only
    const auto whole = attend::scaled_dot_product_attention(q, k, v, o);
    attend::partial_attention<T, 4> merged;
    const std::array<index_t, 4> bounds{0, 100, 250, S};
    for (std::size_t n = 0; n + 1 < bounds.size(); ++n) {
        const auto keys = attend::key_range(k, bounds[n], bounds[n + 1]);
        const auto values = attend::key_range(v, bounds[n], bounds[n + 1]);
        EXPECT_EQ(keys.data, k.data() + bounds[n] * D);  // a view into k, not a copy
        EXPECT_EQ(keys.dims[2], bounds[n + 1] - bounds[n]);
        auto part_options = o;
        if (n > 0) part_options.sinks = {};
        const auto part = attend::scaled_dot_product_attention(q, keys, values, part_options);
        merged = n == 0 ? attend::partial_attention<T, 4>{part.out, part.lse}
                        : attend::merge_partials(merged.out, merged.lse, part.out, part.lse);
    }
    EXPECT_LE(attend_test::max_abs_diff(merged.out, whole.out), tolerance);
    EXPECT_LE(attend_test::max_abs_diff(merged.lse, whole.lse), 10 * tolerance);
}

TEST(SplitKeyValueErrors, RangesOutsideTheSequenceAreShapeRange) {
    const auto k = attend_test::random_tensor<float>(1, 1, 2, 10, 4);
    for (const auto& range : {std::pair<index_t, index_t>{-1, 3}, {4, 3}, {0, 11}, {11, 11}}) {
        SCOPED_TRACE(range.first);
        attend_test::expect_error<attend::shape_error>([&] { (void)attend::key_range(k, range.first, range.second); },
                                                       "attend.shape.range");
    }
    EXPECT_EQ(attend::key_range(k, 10, 10).dims[2], 0);  // an empty range is a valid view
}

}  // namespace
