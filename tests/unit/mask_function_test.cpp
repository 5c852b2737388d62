// SPDX-License-Identifier: MIT
// Masks given as functions (mask_mod, mask_function.hpp): the same results as the built-in rule they reproduce,
// composed with the mask algebra, forward and backward, and a block rule that keeps the kernels from testing
// tiles position by position.

#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <type_traits>
#include <vector>

#include <attend/attend.hpp>

#include "support/compare.hpp"
#include "support/random.hpp"
#include "support/scalar_names.hpp"
#include "support/score_feature_golden.hpp"

namespace {

using attend::alignment;
using attend::index_t;
using attend::tile_class;

/// sliding_window(left, 0, top_left) as a function, and its exact block rule.
struct window_function {
    index_t left = 0;
    bool operator()(index_t, index_t, index_t i, index_t j) const { return j <= i && j >= i - left; }
};
struct window_blocks {
    index_t left = 0;
    tile_class operator()(const attend::tile& t) const {
        // Row i sees [i - left, i]: the first row has the lowest bounds, the last the highest.
        if (t.key_begin > t.query_end - 1 || t.key_end - 1 < t.query_begin - left) return tile_class::empty;
        if (t.key_end - 1 <= t.query_begin && t.key_begin >= t.query_end - 1 - left) return tile_class::full;
        return tile_class::mixed;
    }
};

template <class T>
class MaskFunction : public ::testing::Test {};
TYPED_TEST_SUITE(MaskFunction, attend_test::scalar_types, attend_test::scalar_names);

TYPED_TEST(MaskFunction, SlidingWindowAsAFunctionEqualsTheBuiltInRule) {
    using T = TypeParam;
    const double tolerance = std::is_same_v<T, float> ? 2e-6 : 1e-13;
    const index_t B = 2, H = 4, G = 2, L = 300, D = 16, left = 70;
    const auto q = attend_test::random_tensor<T>(1, B, H, L, D), k = attend_test::random_tensor<T>(2, B, G, L, D),
               v = attend_test::random_tensor<T>(3, B, G, L, D);
    const auto builtin = attend::sliding_window(left, 0, attend::alignment::top_left);
    const auto with_blocks = attend::mask_mod(window_function{left}, window_blocks{left});
    const auto untiled = attend::mask_mod(window_function{left});
    for (const auto kernel : {attend::kernel::reference, attend::kernel::tiled})
        for (const int threads : {1, 2}) {
            attend::sdpa_options o;
            o.kernel = kernel;
            o.threads = threads;
            o.need_weights = true;
            const auto want = attend::scaled_dot_product_attention(q, k, v, builtin, o);
            const auto a = attend::scaled_dot_product_attention(q, k, v, with_blocks, o);
            const auto b = attend::scaled_dot_product_attention(q, k, v, untiled, o);
            // With an exact block rule the kernels take the same path, so the same bits.
            EXPECT_TRUE(attend_test::bit_equal(a.out, want.out));
            EXPECT_TRUE(attend_test::bit_equal(a.weights, want.weights));
            EXPECT_LE(attend_test::max_abs_diff(b.out, want.out), tolerance);
            EXPECT_LE(attend_test::max_abs_diff(b.lse, want.lse), 10 * tolerance);
        }
}

TEST(MaskFunctionBackward, DocumentMaskingAsAFunctionEqualsPackedSegmentsForwardAndBackward) {
    // Three documents packed into 200 positions, causal within each: FlexAttention's document mask.
    const std::vector<index_t> offsets{0, 64, 150, 200};
    std::vector<index_t> document(200);
    for (std::size_t n = 0; n + 1 < offsets.size(); ++n)
        for (index_t p = offsets[n]; p < offsets[n + 1]; ++p)
            document[static_cast<std::size_t>(p)] = static_cast<index_t>(n);
    const auto same_document = attend::mask_mod([document](index_t, index_t, index_t i, index_t j) {
        return document[static_cast<std::size_t>(i)] == document[static_cast<std::size_t>(j)];
    });
    const auto as_function = attend::causal(alignment::top_left) && same_document;
    const auto packed = attend::packed_segments(attend::segment_offsets(offsets), attend::segment_offsets(offsets))
                            .causal(alignment::top_left);
    const attend::score_shape shape{1, 1, 200, 200};
    EXPECT_EQ(attend::to_string(as_function, shape), attend::to_string(packed, shape));
    const auto q = attend_test::random_tensor<double>(4, 1, 2, 200, 8),
               k = attend_test::random_tensor<double>(5, 1, 2, 200, 8),
               v = attend_test::random_tensor<double>(6, 1, 2, 200, 8),
               d_out = attend_test::random_tensor<double>(7, 1, 2, 200, 8);
    for (const auto kernel : {attend::kernel::reference, attend::kernel::tiled}) {
        attend::sdpa_options o;
        o.kernel = kernel;
        const auto fa = attend::scaled_dot_product_attention(q, k, v, as_function, o);
        const auto fb = attend::scaled_dot_product_attention(q, k, v, packed, o);
        const auto ga = attend::scaled_dot_product_attention_backward(q, k, v, as_function, fa, d_out, o);
        const auto gb = attend::scaled_dot_product_attention_backward(q, k, v, packed, fb, d_out, o);
        EXPECT_LE(attend_test::max_abs_diff(fa.out, fb.out), 1e-13);
        EXPECT_LE(attend_test::max_abs_diff(ga.d_query, gb.d_query), 1e-13);
        EXPECT_LE(attend_test::max_abs_diff(ga.d_key, gb.d_key), 1e-13);
        EXPECT_LE(attend_test::max_abs_diff(ga.d_value, gb.d_value), 1e-13);
    }
}

TEST(MaskFunctionGolden, DocumentMaskingAsAFunctionAndAsPackedSegmentsMatchesFlexAttentionInDouble) {
    // Documents [0, 0, 0, 1, 1, 1, 1, 2, 2, 2], causal within each (FlexAttention's document mask).
    const std::vector<index_t> document{0, 0, 0, 1, 1, 1, 1, 2, 2, 2};
    const auto same_document = attend::mask_mod([document](index_t, index_t, index_t i, index_t j) {
        return document[static_cast<std::size_t>(i)] == document[static_cast<std::size_t>(j)];
    });
    const char* name = "flex_mask_mod_documents_causal";
    attend_test::expect_score_feature_golden(name, attend::causal(alignment::top_left) && same_document, {});
    attend_test::expect_score_feature_golden(name,
                                             attend::packed_segments(attend::segment_offsets({0, 3, 7, 10}),
                                                                     attend::segment_offsets({0, 3, 7, 10}))
                                                 .causal(alignment::top_left),
                                             {});
}

TEST(MaskFunctionTiles, AnExactBlockRuleKeepsTheKernelFromTestingSkippedAndFullTiles) {
    constexpr index_t L = 2048, left = 127;
    const auto q = attend_test::random_tensor<float>(1, 1, 1, L, 16),
               k = attend_test::random_tensor<float>(2, 1, 1, L, 16),
               v = attend_test::random_tensor<float>(3, 1, 1, L, 16);
    std::atomic<std::int64_t> calls_with_blocks{0}, calls_without{0};
    const auto counted = [](std::atomic<std::int64_t>* calls) {
        return [calls](index_t b, index_t h, index_t i, index_t j) {
            calls->fetch_add(1, std::memory_order_relaxed);
            return window_function{left}(b, h, i, j);
        };
    };
    attend::sdpa_options o;
    o.check_finite = false;
    attend::scaled_dot_product_attention(q, k, v, attend::mask_mod(counted(&calls_with_blocks), window_blocks{left}),
                                         o);
    attend::scaled_dot_product_attention(q, k, v, attend::mask_mod(counted(&calls_without)), o);
    // Without a block rule every tile is mixed and the empty-row check alone tests every position; with it only
    // the tiles the window's edges cross are tested.
    EXPECT_GE(calls_without.load(), L * L);
    EXPECT_LE(calls_with_blocks.load() * 4, L * L);
}

TEST(MaskFunctionIndices, TheFunctionReceivesTheSameThirtyTwoBitIndicesAsScoreMod) {
    const auto rule = attend::mask_mod([](auto b, auto h, auto i, auto j) {
        static_assert(std::is_same_v<decltype(b), attend::mod_index> && std::is_same_v<decltype(h), attend::mod_index>);
        static_assert(std::is_same_v<decltype(i), attend::mod_index> && std::is_same_v<decltype(j), attend::mod_index>);
        return j <= i;
    });
    const auto allowed = attend::materialize(rule, attend::score_shape{1, 1, 3, 3});
    EXPECT_TRUE(allowed(0, 0, 2, 2) && !allowed(0, 0, 1, 2));
}

}  // namespace
