// SPDX-License-Identifier: MIT
// Every public entry point that takes a size, a length, a count, an offset or a position, called with hostile
// values (negative, zero, the Eigen::Index extremes, values whose sums or products overflow): each call must give
// a typed attend::error or a correct result, never a crash, a std::bad_alloc or a sanitizer report. The
// sanitizer pass of scripts/test runs this file under ASan + UBSan, which is what turns a wrapped size or a
// signed overflow into a failure here.

#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <attend/attend.hpp>

#include "support/errors.hpp"

namespace {

using attend::index_t;

constexpr index_t most = std::numeric_limits<index_t>::max();
constexpr index_t least = std::numeric_limits<index_t>::min();

/// Sizes that break something: negative, the extremes, and values whose sums or products overflow. (Valid sizes
/// too large for memory are allocation_failure_test's: under AddressSanitizer a failed operator new aborts.)
const std::vector<index_t> hostile{-1, -2, least, least + 1, most, most - 1, index_t(1) << 62};

/// Runs f: it may return, or throw an attend::error; anything else (a standard exception) is a failure.
/// Returns the error id, empty when f returned.
std::string typed_or_ok(const std::function<void()>& f, const std::string& what) {
    try {
        f();
    } catch (const attend::error& e) {
        EXPECT_EQ(std::string(e.what()), e.message() + " [" + e.id() + "]") << what << ": " << e.what();
        return e.id();
    } catch (const std::exception& e) {
        ADD_FAILURE() << what << ": untyped " << typeid(e).name() << ": " << e.what();
        return "untyped";
    }
    return {};
}

/// A small valid buffer that hostile views point into: a check must reject the view before reading past it.
std::vector<float>& pool() {
    static std::vector<float> data(4096, 0.5f);
    return data;
}

attend::strided_view<const float> view_with(std::array<index_t, 4> dims) {
    attend::strided_view<const float> v;
    v.data = pool().data();
    v.dims = dims;
    v.strides = {16, 16, 4, 1};
    return v;
}

TEST(HostileSizes, AttentionViewsWithAnyHostileSizeThrowTypedErrorsBeforeReading) {
    const auto q = view_with({1, 2, 3, 4}), k = view_with({1, 2, 3, 4}), v = view_with({1, 2, 3, 4});
    // A view claiming 2^40 valid rows over a small buffer would be a lie no library can detect; these sizes are
    // negative or overflow.
    for (const index_t n : hostile)
        for (std::size_t axis = 0; axis < 4; ++axis) {
            for (int which = 0; which < 3; ++which) {
                auto qq = q, kk = k, vv = v;
                auto& target = which == 0 ? qq : which == 1 ? kk : vv;
                target.dims[axis] = n;
                const std::string what = "sdpa tensor " + std::to_string(which) + " axis " + std::to_string(axis) +
                                         " = " + std::to_string(n);
                const auto id = typed_or_ok([&] { (void)attend::scaled_dot_product_attention(qq, kk, vv); }, what);
                EXPECT_FALSE(id.empty()) << what << " was accepted";
                typed_or_ok([&] { (void)attend::check_shapes(qq, kk, vv); }, what);
            }
        }
    // INT64_MIN heads over -1 kv_heads: the GQA remainder would trap (SIGFPE); negative sizes are rejected first.
    auto qq = q, kk = k, vv = v;
    qq.dims[1] = least;
    kk.dims[1] = vv.dims[1] = -1;
    attend_test::expect_error<attend::shape_error>([&] { (void)attend::check_shapes(qq, kk, vv); },
                                                   "attend.shape.negative");
}

TEST(HostileSizes, SplitHeadsOfANegativeLengthIsRejectedByEveryConsumer) {
    std::vector<float> buf(64, 1.0f);
    const auto negative = attend::split_heads(static_cast<const float*>(buf.data()), 1, -1, 1, 4);
    attend::kv_cache<float> cache(attend::kv_cache_config{}.with_capacity(8).with_head_dim(4));
    attend_test::expect_error<attend::shape_error>([&] { cache.append(negative, negative); }, "attend.shape.negative");
    EXPECT_EQ(cache.length(), 0);
    // The next valid append still lands at position 0.
    const auto one = attend::split_heads(static_cast<const float*>(buf.data()), 1, 1, 1, 4);
    cache.append(one, one);
    EXPECT_EQ(cache.length(), 1);
    attend_test::expect_error<attend::shape_error>([&] { cache.check_fits(-3); }, "attend.shape.negative");
    for (const index_t n : hostile) {
        typed_or_ok([&] { cache.check_fits(n); }, "check_fits " + std::to_string(n));
        typed_or_ok([&] { cache.truncate(n); }, "truncate " + std::to_string(n));
        EXPECT_EQ(cache.length(), 1);
    }
}

TEST(HostileSizes, CacheConstructionWithHostileSizesThrowsTypedErrors) {
    for (const index_t n : hostile)
        for (int axis = 0; axis < 5; ++axis) {
            std::array<index_t, 5> sizes{1, 1, 4, 4, 4};
            sizes[static_cast<std::size_t>(axis)] = n;
            const auto id = typed_or_ok(
                [&] {
                    attend::kv_cache<float> c(attend::kv_cache_config{}
                                                  .with_batch(sizes[0])
                                                  .with_kv_heads(sizes[1])
                                                  .with_capacity(sizes[2])
                                                  .with_head_dim(sizes[3])
                                                  .with_value_dim(sizes[4]));
                },
                "kv_cache axis " + std::to_string(axis) + " = " + std::to_string(n));
            EXPECT_FALSE(id.empty());
        }
}

TEST(HostileSizes, MaskInspectionWithHostileShapesThrowsTypedErrors) {
    for (const index_t n : hostile)
        for (int axis = 0; axis < 4; ++axis) {
            std::array<index_t, 4> d{1, 1, 3, 3};
            d[static_cast<std::size_t>(axis)] = n;
            const attend::score_shape shape{d[0], d[1], d[2], d[3]};
            const std::string what = "score shape axis " + std::to_string(axis) + " = " + std::to_string(n);
            const auto causal = attend::causal(attend::alignment::bottom_right);
            EXPECT_FALSE(typed_or_ok([&] { (void)attend::materialize(causal, shape); }, what).empty()) << what;
            EXPECT_FALSE(typed_or_ok([&] { (void)attend::to_string(causal, shape); }, what).empty()) << what;
            typed_or_ok([&] { (void)attend::classify(causal, shape, attend::tile{0, 0, 0, 1, 0, 1}); }, what);
        }
}

TEST(HostileSizes, MaterializeOfANegativeQueryLengthIsANegativeShapeError) {
    attend_test::expect_error<attend::shape_error>(
        [] {
            (void)attend::materialize(attend::causal(attend::alignment::top_left), {1, 1, -1, 3});
        },
        "attend.shape.negative");
    attend_test::expect_error<attend::shape_error>(
        [] {
            (void)attend::to_string(attend::no_mask{}, {1, 1, index_t(1) << 40, index_t(1) << 40});
        },
        "attend.shape.overflow");
}

TEST(HostileSizes, ClassifyOutsideTheShapeIsATileError) {
    const attend::score_shape shape{1, 1, 4, 4};
    for (const attend::tile t :
         {attend::tile{0, 0, 0, 5, 0, 4}, attend::tile{0, 0, -1, 2, 0, 4}, attend::tile{1, 0, 0, 1, 0, 1},
          attend::tile{0, 0, 3, 2, 0, 4}, attend::tile{0, 0, 0, 1, 0, most}})
        attend_test::expect_error<attend::shape_error>(
            [&] { (void)attend::classify(attend::causal(attend::alignment::top_left), shape, t); },
            "attend.shape.tile");
}

TEST(HostileSizes, BlockDiagonalLengthsSummingPastTheIndexRangeAreAMaskError) {
    attend::tensor<float, 4> q(1, 1, 4, 2), k(1, 1, 4, 2), v(1, 1, 4, 2);
    q.setConstant(0.1f);
    k.setConstant(0.2f);
    v.setConstant(0.3f);
    attend_test::expect_error<attend::mask_error>(
        [&] {
            (void)attend::scaled_dot_product_attention(
                q, k, v, attend::block_diagonal(attend::segment_lengths({most, most, 2})));
        },
        "attend.mask.block_lengths");
    attend_test::expect_error<attend::mask_error>(
        [&] {
            (void)attend::scaled_dot_product_attention(
                q, k, v, attend::block_diagonal(attend::segment_lengths({2, most - 1, 2})));
        },
        "attend.mask.block_lengths");
}

TEST(HostileSizes, MaskRulesWithHostileLengthsThrowTypedErrors) {
    attend::tensor<float, 4> q(2, 1, 3, 2), k(2, 1, 5, 2), v(2, 1, 5, 2);
    q.setConstant(0.1f);
    k.setConstant(0.2f);
    v.setConstant(0.3f);
    attend::sdpa_options o;
    o.empty_rows = attend::empty_rows::zero;
    for (const index_t n : hostile) {
        const auto s = std::to_string(n);
        typed_or_ok(
            [&] {
                (void)attend::scaled_dot_product_attention(q, k, v, attend::key_padding({n, 2}), o);
            },
            "key_padding " + s);
        typed_or_ok(
            [&] {
                (void)attend::scaled_dot_product_attention(q, k, v, attend::query_padding({1, n}), o);
            },
            "query_padding " + s);
        typed_or_ok(
            [&] {
                (void)attend::scaled_dot_product_attention(
                    q, k, v, attend::sliding_window(n, 1, attend::alignment::top_left), o);
            },
            "sliding_window left " + s);
        typed_or_ok(
            [&] {
                (void)attend::scaled_dot_product_attention(
                    q, k, v, attend::sliding_window(1, n, attend::alignment::top_left), o);
            },
            "sliding_window right " + s);
        typed_or_ok(
            [&] {
                (void)attend::scaled_dot_product_attention(
                    q, k, v, attend::sliding_window(n, n, attend::alignment::bottom_right), o);
            },
            "sliding_window bottom_right " + s);
        typed_or_ok(
            [&] {
                (void)attend::scaled_dot_product_attention(q, k, v, attend::prefix_lm(n, attend::alignment::top_left),
                                                           o);
            },
            "prefix_lm " + s);
        typed_or_ok(
            [&] {
                (void)attend::scaled_dot_product_attention(q, k, v,
                                                           attend::block_diagonal(attend::segment_lengths({n})), o);
            },
            "block_diagonal " + s);
    }
}

TEST(HostileSizes, PositionTablesWithHostileSizesThrowTypedErrors) {
    for (const index_t n : hostile) {
        const auto s = std::to_string(n);
        EXPECT_FALSE(typed_or_ok([&] { (void)attend::sinusoidal_positions<float>(n, 4); }, "sin length " + s).empty());
        EXPECT_FALSE(typed_or_ok([&] { (void)attend::sinusoidal_positions<float>(4, n); }, "sin dim " + s).empty());
        EXPECT_FALSE(typed_or_ok([&] { attend::learned_positions<float> p(n, 4); }, "learned max_len " + s).empty());
        typed_or_ok([&] { (void)attend::alibi_slopes(n); }, "alibi heads " + s);
        typed_or_ok([&] { (void)attend::relative_position_bucket(n, true); }, "bucket " + s);
        typed_or_ok([&] { (void)attend::relative_position_bucket(1, true, n, n); }, "bucket config " + s);
        typed_or_ok([&] { attend::relative_position_bias<float> t(n, true); }, "bias heads " + s);
    }
    attend_test::expect_error<attend::shape_error>(
        [] { (void)attend::sinusoidal_positions<float>(index_t(1) << 40, index_t(1) << 40); }, "attend.shape.overflow");
    // The 2^40-row table of dim 0 is empty, so no frequency vector of 2^39 entries is needed for it.
    const attend::learned_positions<float> table(8, 4);
    for (const index_t offset : hostile)
        for (const index_t length : {index_t(0), index_t(1), index_t(8), most, least}) {
            const auto what = "lookup(" + std::to_string(offset) + ", " + std::to_string(length) + ")";
            EXPECT_FALSE(typed_or_ok([&] { (void)table.lookup(offset, length); }, what).empty()) << what;
        }
    attend_test::expect_error<attend::position_error>([&] { (void)table.lookup(most, 0); },
                                                      "attend.position.past_table");
    EXPECT_EQ(table.lookup(8, 0).size(), 0);  // the empty range just past the table: offset + length == max_len
    const attend::relative_position_bias<float> bias(2, true);
    for (const index_t a : hostile)
        for (const index_t b : hostile) typed_or_ok([&] { (void)bias.bucket(a, b); }, "bias bucket");
    EXPECT_EQ(bias.bucket(least, most), bias.bucket(0, index_t(1) << 40));  // far in both: the last bucket
}

TEST(HostileSizes, RotaryWithHostileOffsetsThrowsTypedErrors) {
    attend::tensor<float, 4> x(1, 1, 3, 4);
    x.setConstant(1.0f);
    for (const index_t n : hostile) {
        attend::rotary_embedding rotary{4};
        typed_or_ok([&] { rotary.apply(x, n); }, "rotary offset " + std::to_string(n));
        attend::rotary_embedding bad{n};
        const auto id = typed_or_ok([&] { bad.apply(x, 0); }, "rotary dim " + std::to_string(n));
        EXPECT_FALSE(id.empty());
    }
}

TEST(HostileSizes, ModulesWithHostileConfigsThrowTypedErrors) {
    for (const index_t n : hostile)
        for (int field = 0; field < 5; ++field) {
            attend::mha_config c{8, 2};
            index_t* f[] = {&c.model_dim, &c.heads, &c.kv_heads, &c.key_dim, &c.value_dim};
            *f[field] = n;
            const auto id = typed_or_ok([&] { attend::multi_head_attention<float> m(c); },
                                        "mha field " + std::to_string(field) + " = " + std::to_string(n));
            EXPECT_FALSE(id.empty());
        }
}

TEST(HostileSizes, CachedDecodingAtAPositionOffsetNearTheIndexLimitIsAPositionError) {
    attend::multi_head_attention<float> m(attend::mha_config{8, 2});
    auto cache = m.make_cache(1, 4);
    attend::tensor<float, 3> x(1, 2, 8);
    x.setConstant(0.25f);
    attend::mha_options o;
    o.rotary = attend::rotary_embedding{4};
    for (const index_t offset : {most, most - 1}) {  // offset + new tokens overflows
        o.position_offset = offset;
        attend_test::expect_error<attend::position_error>([&] { (void)m.forward_cached(x, cache, o); },
                                                          "attend.position.overflow");
        EXPECT_EQ(cache.length(), 0);
    }
    o.position_offset = most - 4;  // positions most - 4 and most - 3: representable
    (void)m.forward_cached(x, cache, o);
    EXPECT_EQ(cache.length(), 2);
    o.position_offset = most - 3;  // after the two cached tokens: most - 1 and most
    attend_test::expect_error<attend::position_error>([&] { (void)m.forward_cached(x, cache, o); },
                                                      "attend.position.overflow");
    EXPECT_EQ(cache.length(), 2);
}

TEST(HostileSizes, ThreadCountsAndProbabilitiesAtTheExtremesThrowTypedErrors) {
    attend::tensor<float, 4> q(1, 1, 2, 2), k(1, 1, 2, 2), v(1, 1, 2, 2);
    q.setConstant(0.1f);
    k.setConstant(0.2f);
    v.setConstant(0.3f);
    for (const int threads : {-1, std::numeric_limits<int>::min()}) {
        attend::sdpa_options o;
        o.threads = threads;
        attend_test::expect_error<attend::value_error>([&] { (void)attend::scaled_dot_product_attention(q, k, v, o); },
                                                       "attend.value.threads");
    }
    attend::sdpa_options o;
    o.threads = std::numeric_limits<int>::max();  // more threads than work: clamped to the work, same result
    const auto many = attend::scaled_dot_product_attention(q, k, v, o);
    const auto one = attend::scaled_dot_product_attention(q, k, v);
    for (index_t n = 0; n < one.out.size(); ++n) EXPECT_EQ(many.out.data()[n], one.out.data()[n]);
}

}  // namespace
