// SPDX-License-Identifier: MIT
// Every error path of scaled_dot_product_attention (sdpa.hpp, shape.hpp, mask.hpp, score_bias.hpp): one test per
// error id, asserting the exception type, e.id(), that the message ends with "[id]" and carries the offending
// shapes or values, and that nothing was written: the calls go through scaled_dot_product_attention_into with
// sentinel-filled out, weights and lse, which must still hold the sentinel afterwards. The allocating form is
// checked to throw the same id.

#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <gtest/gtest.h>

#include <attend/attend.hpp>

#include "support/random.hpp"

namespace {

using attend::index_t;
template <class T, int Rank>
using tensor = attend::tensor<T, Rank>;

constexpr float sentinel = -7777.25f;
constexpr float nan_f = std::numeric_limits<float>::quiet_NaN();
constexpr float inf_f = std::numeric_limits<float>::infinity();

template <int Rank>
tensor<float, Rank> random4(std::uint64_t seed, const std::array<index_t, static_cast<std::size_t>(Rank)>& dims) {
    tensor<float, Rank> t(dims);
    attend_test::fill_uniform(t, seed);
    return t;
}

/// q [B,H,L,D], k [B,G,S,D], v [B,G,S,Dv] filled with random values.
struct qkv {
    tensor<float, 4> q, k, v;
};
qkv make(index_t B, index_t H, index_t G, index_t L, index_t S, index_t D, index_t Dv) {
    return {random4<4>(1, {B, H, L, D}), random4<4>(2, {B, G, S, D}), random4<4>(3, {B, G, S, Dv})};
}

/// Sentinel-filled outputs shaped after the inputs (rank of q), as a caller would allocate them.
template <int Rank>
struct sentinel_outputs {
    tensor<float, Rank> out, weights;
    tensor<float, Rank - 1> lse;

    bool untouched() const {
        for (const auto* t : {&out, &weights})
            for (index_t n = 0; n < t->size(); ++n)
                if (!(t->data()[n] == sentinel)) return false;
        for (index_t n = 0; n < lse.size(); ++n)
            if (!(lse.data()[n] == sentinel)) return false;
        return true;
    }
};

template <class Q, class K, class V>
auto outputs_for(const Q& q, const K& k, const V& v) {
    constexpr int rank = Q::NumDimensions;
    // value_dim and key_len from the last axes of v and k, which may have another rank than q (attend.shape.rank).
    const index_t value_dim = v.dimension(V::NumDimensions - 1), key_len = k.dimension(K::NumDimensions - 2);
    sentinel_outputs<rank> s;
    if constexpr (rank == 4) {
        s.out.resize(q.dimension(0), q.dimension(1), q.dimension(2), value_dim);
        s.weights.resize(q.dimension(0), q.dimension(1), q.dimension(2), key_len);
        s.lse.resize(q.dimension(0), q.dimension(1), q.dimension(2));
    } else {
        s.out.resize(q.dimension(0), q.dimension(1), value_dim);
        s.weights.resize(q.dimension(0), q.dimension(1), key_len);
        s.lse.resize(q.dimension(0), q.dimension(1));
    }
    s.out.setConstant(sentinel);
    s.weights.setConstant(sentinel);
    s.lse.setConstant(sentinel);
    return s;
}

/// Runs f, which must throw E with the given id and a message holding every fragment.
template <class E, class F>
void expect_error(F&& f, const std::string& id, const std::vector<std::string>& fragments) {
    static_assert(std::is_base_of_v<attend::error, E>, "attend errors only");
    try {
        f();
        ADD_FAILURE() << "expected " << id << ", nothing was thrown";
    } catch (const E& e) {
        const std::string what = e.what();
        EXPECT_EQ(e.id(), id) << what;
        EXPECT_EQ(what, e.message() + " [" + id + "]") << "message must end with the bracketed id: " << what;
        for (const auto& fragment : fragments)
            EXPECT_NE(what.find(fragment), std::string::npos) << "message lacks \"" << fragment << "\": " << what;
    } catch (const std::exception& e) {
        ADD_FAILURE() << "expected " << id << " as the right exception type, got: " << e.what();
    }
}

/// The _into form with sentinel outputs (nothing may be written) and the allocating form; both must throw.
template <class E, class Q, class K, class V, class Mask>
void expect_call_error(const Q& q, const K& k, const V& v, const Mask& mask, const attend::sdpa_options& o,
                       const std::string& id, const std::vector<std::string>& fragments) {
    auto s = outputs_for(q, k, v);
    expect_error<E>([&] { attend::scaled_dot_product_attention_into(q, k, v, mask, o, s.out, s.weights, s.lse); }, id,
                    fragments);
    EXPECT_TRUE(s.untouched()) << id << ": an output was written before the error";
    attend::sdpa_options with_outputs = o;
    with_outputs.need_weights = true;
    with_outputs.need_lse = true;
    expect_error<E>([&] { (void)attend::scaled_dot_product_attention(q, k, v, mask, with_outputs); }, id, fragments);
}

template <class E, class Q, class K, class V>
void expect_call_error(const Q& q, const K& k, const V& v, const attend::sdpa_options& o, const std::string& id,
                       const std::vector<std::string>& fragments) {
    expect_call_error<E>(q, k, v, attend::no_mask{}, o, id, fragments);
}

/// The message of the error `run` throws (value_error expected), or "" when it throws nothing.
template <class F>
std::string value_error_text(F&& run) {
    try {
        run();
    } catch (const attend::value_error& e) {
        return e.what();
    }
    return "";
}

// ---------------------------------------------------------------------------------------------------------------
// Shape rules (shape.hpp), in the order check_shapes applies them
// ---------------------------------------------------------------------------------------------------------------

TEST(SdpaErrors, RankDiffersBetweenQueryKeyAndValueIsShapeRank) {
    const auto q = random4<4>(1, {2, 3, 5, 4});
    const auto k = random4<3>(2, {2, 6, 4}), v = random4<3>(3, {2, 6, 7});
    expect_call_error<attend::shape_error>(q, k, v, {}, "attend.shape.rank",
                                           {"4, 3, 3", "[2,3,5,4]", "[2,6,4]", "[2,6,7]"});
    expect_error<attend::shape_error>([&] { (void)attend::check_shapes(q, k, v); }, "attend.shape.rank", {"[2,3,5,4]"});
}

TEST(SdpaErrors, BatchDiffersIsShapeBatch) {
    const auto x = make(2, 2, 2, 4, 5, 3, 3);
    const auto k = random4<4>(4, {3, 2, 5, 3});
    expect_call_error<attend::shape_error>(x.q, k, x.v, {}, "attend.shape.batch",
                                           {"query 2, key 3, value 2", "[2,2,4,3]", "[3,2,5,3]", "[2,2,5,3]"});
}

TEST(SdpaErrors, KeyAndValueKvHeadsDifferIsShapeKvHeads) {
    const auto x = make(2, 2, 2, 4, 5, 3, 6);
    const auto v = random4<4>(4, {2, 1, 5, 6});
    expect_call_error<attend::shape_error>(x.q, x.k, v, {}, "attend.shape.kv_heads",
                                           {"key kv_heads 2 != value kv_heads 1", "[2,2,5,3]", "[2,1,5,6]"});
}

TEST(SdpaErrors, KeyAndValueLengthsDifferIsShapeKeyLen) {
    const auto x = make(1, 2, 2, 4, 5, 3, 6);
    const auto v = random4<4>(4, {1, 2, 6, 6});
    expect_call_error<attend::shape_error>(x.q, x.k, v, {}, "attend.shape.key_len",
                                           {"key key_len 5 != value key_len 6", "[1,2,5,3]", "[1,2,6,6]"});
}

TEST(SdpaErrors, QueryAndKeyHeadDimsDifferIsShapeKeyDim) {
    const auto x = make(2, 8, 8, 4, 6, 4, 4);
    const auto k = random4<4>(4, {2, 8, 6, 3});
    const auto v = random4<4>(5, {2, 8, 6, 4});
    expect_call_error<attend::shape_error>(x.q, k, v, {}, "attend.shape.key_dim",
                                           {"query head_dim 4 != key head_dim 3", "[2,8,4,4]", "[2,8,6,3]"});
    // Rank 3 spells rank-3 shapes.
    const auto q3 = random4<3>(6, {2, 4, 5}), k3 = random4<3>(7, {2, 6, 3}), v3 = random4<3>(8, {2, 6, 2});
    expect_call_error<attend::shape_error>(q3, k3, v3, {}, "attend.shape.key_dim", {"[2,4,5]", "[2,6,3]"});
}

TEST(SdpaErrors, ZeroHeadsOrZeroKvHeadsIsShapeEmptyHeads) {
    const auto a = make(2, 0, 1, 4, 5, 3, 3);
    expect_call_error<attend::shape_error>(a.q, a.k, a.v, {}, "attend.shape.empty_heads",
                                           {"heads 0, kv_heads 1", "[2,0,4,3]", "[2,1,5,3]"});
    const auto b = make(2, 2, 0, 4, 5, 3, 3);
    expect_call_error<attend::shape_error>(b.q, b.k, b.v, {}, "attend.shape.empty_heads",
                                           {"heads 2, kv_heads 0", "[2,2,4,3]", "[2,0,5,3]"});
}

TEST(SdpaErrors, HeadsNotAMultipleOfKvHeadsIsShapeGqa) {
    const auto x = make(1, 3, 2, 4, 5, 3, 3);
    expect_call_error<attend::shape_error>(x.q, x.k, x.v, {}, "attend.shape.gqa",
                                           {"heads 3 is not a multiple of kv_heads 2", "[1,3,4,3]", "[1,2,5,3]"});
}

TEST(SdpaErrors, ZeroKeyLenIsShapeEmptyKeys) {
    const auto x = make(2, 2, 1, 4, 0, 3, 3);
    expect_call_error<attend::shape_error>(x.q, x.k, x.v, {}, "attend.shape.empty_keys",
                                           {"key_len is 0", "[2,2,4,3]", "[2,1,0,3]"});
}

TEST(SdpaErrors, ZeroHeadDimIsShapeEmptyHeadDim) {
    const auto x = make(2, 2, 2, 4, 5, 0, 3);
    expect_call_error<attend::shape_error>(x.q, x.k, x.v, {}, "attend.shape.empty_head_dim",
                                           {"head_dim is 0", "[2,2,4,0]", "[2,2,5,0]"});
}

// TensorMaps whose dims claim 2^63 elements over a 64-float buffer: check_shapes must reject them from the dims
// alone, before reading or writing any element (ASan would report a read past the buffer).
TEST(SdpaErrors, ElementCountsBeyondEigenIndexAreShapeOverflowBeforeAnyMemoryIsTouched) {
    std::vector<float> buffer(64, 0.5f), out_buffer(64, sentinel);
    const index_t huge_batch = index_t(1) << 40;
    {
        // query: 2^40 * 1 * 2^20 * 8 = 2^63 elements.
        const attend::const_tensor_view<float, 4> q(buffer.data(), huge_batch, 1, index_t(1) << 20, 8),
            k(buffer.data(), huge_batch, 1, 4, 8), v(buffer.data(), huge_batch, 1, 4, 8);
        expect_error<attend::shape_error>([&] { (void)attend::check_shapes(q, k, v); }, "attend.shape.overflow",
                                          {"[1099511627776,1,1048576,8]", "[1099511627776,1,4,8]"});
        attend::tensor_view<float, 4> out(out_buffer.data(), huge_batch, 1, index_t(1) << 20, 8);
        expect_error<attend::shape_error>(
            [&] { attend::scaled_dot_product_attention_into(q, k, v, attend::no_mask{}, out); },
            "attend.shape.overflow", {"[1099511627776,1,1048576,8]"});
        expect_error<attend::shape_error>([&] { (void)attend::scaled_dot_product_attention(q, k, v); },
                                          "attend.shape.overflow", {"[1099511627776,1,1048576,8]"});
    }
    {
        // Every tensor fits, the scores [2^20, 1, 2^21, 2^22] = 2^63 do not.
        const attend::const_tensor_view<float, 4> q(buffer.data(), index_t(1) << 20, 1, index_t(1) << 21, 1),
            k(buffer.data(), index_t(1) << 20, 1, index_t(1) << 22, 1),
            v(buffer.data(), index_t(1) << 20, 1, index_t(1) << 22, 1);
        expect_error<attend::shape_error>([&] { (void)attend::check_shapes(q, k, v); }, "attend.shape.overflow",
                                          {"scores [1048576,1,2097152,4194304]"});
        attend::tensor_view<float, 4> out(out_buffer.data(), index_t(1) << 20, 1, index_t(1) << 21, 1);
        expect_error<attend::shape_error>(
            [&] {
                attend::scaled_dot_product_attention_into(q, k, v, attend::causal(attend::alignment::top_left), out);
            },
            "attend.shape.overflow", {"scores"});
    }
    for (const float x : out_buffer) ASSERT_EQ(x, sentinel);
}

// Same rule, but the overflowing product is within one batch entry (heads * len * dim = 2^63). Turning dims
// into strides must not itself overflow (signed overflow is undefined behaviour; UBSan aborts on it). Run in a
// child process so that such an abort fails this test only.
/// 0 when check_shapes throws attend.shape.overflow for q [1, 2^21, 2^21, 2^21] (2^63 elements in one batch entry).
int per_batch_overflow_exit_code() {
    std::vector<float> buffer(64, 0.5f);
    const index_t n = index_t(1) << 21;
    const attend::const_tensor_view<float, 4> q(buffer.data(), 1, n, n, n);
    const attend::const_tensor_view<float, 4> k(buffer.data(), 1, n, 4, n);
    const attend::const_tensor_view<float, 4> v(buffer.data(), 1, n, 4, 4);
    try {
        (void)attend::check_shapes(q, k, v);
    } catch (const attend::shape_error& e) {
        return e.id() == "attend.shape.overflow" ? 0 : 2;
    }
    return 1;
}

TEST(SdpaErrors, PerBatchElementCountBeyondEigenIndexIsShapeOverflowWithoutUndefinedBehaviour) {
    GTEST_FLAG_SET(death_test_style, "threadsafe");
    EXPECT_EXIT(std::exit(per_batch_overflow_exit_code()), ::testing::ExitedWithCode(0), "")
        << "check_shapes must throw attend.shape.overflow for q [1,2^21,2^21,2^21] without computing an "
           "overflowing stride";
}

// ---------------------------------------------------------------------------------------------------------------
// Caller-owned outputs (_into)
// ---------------------------------------------------------------------------------------------------------------

TEST(SdpaErrors, OutputOfWrongShapeIsShapeOutput) {
    const auto x = make(2, 2, 2, 4, 5, 3, 6);
    auto s = outputs_for(x.q, x.k, x.v);
    tensor<float, 4> bad(2, 2, 4, 5);  // value_dim 5 instead of 6
    bad.setConstant(sentinel);
    expect_error<attend::shape_error>(
        [&] { attend::scaled_dot_product_attention_into(x.q, x.k, x.v, attend::no_mask{}, {}, bad, s.weights, s.lse); },
        "attend.shape.output", {"out [2,2,4,5] != expected [2,2,4,6]"});
    EXPECT_TRUE(s.untouched());
    for (index_t n = 0; n < bad.size(); ++n) ASSERT_EQ(bad.data()[n], sentinel);
}

TEST(SdpaErrors, WeightsOutputOfWrongShapeIsShapeWeightsOutput) {
    const auto x = make(2, 2, 2, 4, 5, 3, 6);
    auto s = outputs_for(x.q, x.k, x.v);
    tensor<float, 4> bad(2, 2, 5, 4);  // [L, S] swapped
    bad.setConstant(sentinel);
    expect_error<attend::shape_error>(
        [&] { attend::scaled_dot_product_attention_into(x.q, x.k, x.v, attend::no_mask{}, {}, s.out, bad, s.lse); },
        "attend.shape.weights_output", {"weights [2,2,5,4] != expected [2,2,4,5]"});
    EXPECT_TRUE(s.untouched());
    for (index_t n = 0; n < bad.size(); ++n) ASSERT_EQ(bad.data()[n], sentinel);
}

TEST(SdpaErrors, LseOutputOfWrongShapeIsShapeLseOutput) {
    const auto x = make(2, 2, 2, 4, 5, 3, 6);
    auto s = outputs_for(x.q, x.k, x.v);
    tensor<float, 3> bad(2, 4, 2);  // [B, L, H] instead of [B, H, L]
    bad.setConstant(sentinel);
    expect_error<attend::shape_error>(
        [&] { attend::scaled_dot_product_attention_into(x.q, x.k, x.v, attend::no_mask{}, {}, s.out, s.weights, bad); },
        "attend.shape.lse_output", {"lse [2,4,2] != expected [2,2,4]"});
    EXPECT_TRUE(s.untouched());
    for (index_t n = 0; n < bad.size(); ++n) ASSERT_EQ(bad.data()[n], sentinel);
}

// ---------------------------------------------------------------------------------------------------------------
// Masks (mask.hpp)
// ---------------------------------------------------------------------------------------------------------------

TEST(SdpaErrors, DenseMaskThatDoesNotBroadcastIsMaskBroadcast) {
    const auto x = make(2, 2, 2, 4, 5, 3, 3);
    tensor<bool, 2> wrong_len(3, 5);  // query_len 3, the call has 4
    wrong_len.setConstant(true);
    expect_call_error<attend::mask_error>(x.q, x.k, x.v, attend::allowed_mask::query_key_grid(wrong_len), {},
                                          "attend.mask.broadcast", {"[3,5]", "[2,2,4,5]"});
    tensor<bool, 4> wrong_batch(3, 1, 1, 5);  // key padding for 3 sequences, the batch is 2
    wrong_batch.setConstant(false);
    expect_call_error<attend::mask_error>(x.q, x.k, x.v,
                                          attend::to_allowed(attend::forbidden_mask::from_torch_mha(wrong_batch)), {},
                                          "attend.mask.broadcast", {"[3,1,1,5]", "[2,2,4,5]"});
    tensor<float, 2> wrong_keys(4, 6);
    wrong_keys.setZero();
    expect_call_error<attend::mask_error>(x.q, x.k, x.v, attend::additive_mask<float>::query_key_grid(wrong_keys), {},
                                          "attend.mask.broadcast", {"[4,6]", "[2,2,4,5]"});
}

TEST(SdpaErrors, DenseMaskOfHigherRankThanTheScoresIsMaskRank) {
    const auto q = random4<3>(1, {2, 4, 3}), k = random4<3>(2, {2, 5, 3}), v = random4<3>(3, {2, 5, 3});
    tensor<bool, 4> m(2, 1, 4, 5);  // rank 4 for rank-3 scores [2,4,5]
    m.setConstant(true);
    expect_call_error<attend::mask_error>(q, k, v, attend::allowed_mask::from_torch_sdpa(m), {}, "attend.mask.rank",
                                          {"[2,1,4,5]", "[2,4,5]"});
}

TEST(SdpaErrors, PaddingLengthsNotOnePerBatchEntryIsMaskLengthsBatch) {
    const auto x = make(2, 2, 2, 4, 5, 3, 3);
    expect_call_error<attend::mask_error>(x.q, x.k, x.v, attend::key_padding({3}), {}, "attend.mask.lengths_batch",
                                          {"1 lengths for batch 2"});
    expect_call_error<attend::mask_error>(x.q, x.k, x.v, attend::query_padding({1, 2, 3}), {},
                                          "attend.mask.lengths_batch", {"3 lengths for batch 2"});
}

TEST(SdpaErrors, PaddingLengthOutsideZeroToLenIsMaskLengthRange) {
    const auto x = make(2, 2, 2, 4, 5, 3, 3);
    expect_call_error<attend::mask_error>(x.q, x.k, x.v, attend::key_padding({3, 6}), {}, "attend.mask.length_range",
                                          {"6", "batch 1", "key_len = 5"});
    expect_call_error<attend::mask_error>(x.q, x.k, x.v, attend::key_padding({-1, 2}), {}, "attend.mask.length_range",
                                          {"-1", "batch 0"});
    expect_call_error<attend::mask_error>(x.q, x.k, x.v,
                                          attend::query_padding({5, 2}) && attend::causal(attend::alignment::top_left),
                                          {}, "attend.mask.length_range", {"5", "query_len = 4"});
}

TEST(SdpaErrors, NegativeSlidingWindowIsMaskWindow) {
    expect_error<attend::mask_error>([] { (void)attend::sliding_window(-1, 2, attend::alignment::top_left); },
                                     "attend.mask.window", {"left -1", "right 2"});
    expect_error<attend::mask_error>([] { (void)attend::sliding_window(3, -2, attend::alignment::bottom_right); },
                                     "attend.mask.window", {"left 3", "right -2"});
}

TEST(SdpaErrors, PrefixLongerThanKeysOrNegativeIsMaskPrefixLen) {
    expect_error<attend::mask_error>([] { (void)attend::prefix_lm(-1, attend::alignment::top_left); },
                                     "attend.mask.prefix_len", {"-1"});
    const auto x = make(2, 2, 2, 4, 5, 3, 3);
    expect_call_error<attend::mask_error>(x.q, x.k, x.v, attend::prefix_lm(6, attend::alignment::top_left), {},
                                          "attend.mask.prefix_len", {"prefix_len 6", "key_len 5"});
}

TEST(SdpaErrors, BlockDiagonalLengthsNotMatchingTheSequenceIsMaskBlockLengths) {
    const auto x = make(1, 2, 2, 5, 5, 3, 3);
    expect_call_error<attend::mask_error>(x.q, x.k, x.v, attend::block_diagonal(attend::segment_lengths({2, 2})), {},
                                          "attend.mask.block_lengths", {"sum to 4", "query_len is 5", "key_len is 5"});
    expect_call_error<attend::mask_error>(x.q, x.k, x.v, attend::block_diagonal(attend::segment_lengths({3, -1, 3})),
                                          {}, "attend.mask.block_lengths", {"-1"});
    const auto y = make(1, 2, 2, 4, 5, 3, 3);  // packed sequences need query_len == key_len
    expect_call_error<attend::mask_error>(y.q, y.k, y.v, attend::block_diagonal(attend::segment_lengths({4})), {},
                                          "attend.mask.block_lengths", {"query_len is 4", "key_len is 5"});
}

TEST(SdpaErrors, QueryWithoutAllowedKeyIsMaskEmptyRow) {
    const auto x = make(2, 3, 3, 4, 5, 3, 3);
    tensor<bool, 4> m(2, 3, 4, 5);
    m.setConstant(true);
    for (index_t j = 0; j < 5; ++j) m(1, 2, 3, j) = false;  // the one empty row: batch 1, head 2, query 3
    expect_call_error<attend::mask_error>(x.q, x.k, x.v, attend::allowed_mask::from_torch_sdpa(m), {},
                                          "attend.mask.empty_row", {"query 3", "batch 1", "head 2"});
    // A structured rule too: bottom_right causal with query_len > key_len leaves the first queries empty.
    const auto y = make(1, 1, 1, 6, 4, 3, 3);
    expect_call_error<attend::mask_error>(y.q, y.k, y.v, attend::causal(attend::alignment::bottom_right), {},
                                          "attend.mask.empty_row", {"query 0", "batch 0", "head 0"});
}

TEST(SdpaErrors, AdditiveMaskWithNaNOrPlusInfinityIsValueAdditiveMask) {
    for (const float bad : {nan_f, inf_f}) {
        tensor<float, 2> m(3, 4);
        m.setZero();
        m(1, 2) = bad;
        expect_error<attend::value_error>([&] { (void)attend::additive_mask<float>::query_key_grid(m); },
                                          "attend.value.additive_mask", {"[3,4]", "flat index 6"});
    }
    tensor<double, 2> ok(3, 4);  // -inf is the one allowed infinity
    ok.setConstant(-std::numeric_limits<double>::infinity());
    EXPECT_NO_THROW((void)attend::additive_mask<double>::query_key_grid(ok));
}

// ---------------------------------------------------------------------------------------------------------------
// Values (sdpa.hpp, score_bias.hpp)
// ---------------------------------------------------------------------------------------------------------------

TEST(SdpaErrors, NaNOrInfinityInQueryKeyOrValueIsValueNonFinite) {
    const char* names[] = {"query", "key", "value"};
    for (int which = 0; which < 3; ++which)
        for (const float bad : {nan_f, inf_f, -inf_f}) {
            SCOPED_TRACE(std::string(names[which]) + " holds " + std::to_string(bad));
            auto x = make(2, 2, 1, 4, 5, 3, 6);
            tensor<float, 4>& t = which == 0 ? x.q : which == 1 ? x.k : x.v;
            t(1, 0, 2, 1) = bad;
            expect_call_error<attend::value_error>(x.q, x.k, x.v, {}, "attend.value.non_finite",
                                                   {names[which], "[1,0,2,1]"});
            // check_finite = false skips the scan: no throw (the numbers are then the caller's business).
            attend::sdpa_options unchecked;
            unchecked.check_finite = false;
            auto s = outputs_for(x.q, x.k, x.v);
            EXPECT_NO_THROW(attend::scaled_dot_product_attention_into(x.q, x.k, x.v, attend::no_mask{}, unchecked,
                                                                      s.out, s.weights, s.lse));
        }
    // Rank 3 names the rank-3 position.
    auto q3 = random4<3>(1, {2, 4, 3});
    const auto k3 = random4<3>(2, {2, 5, 3}), v3 = random4<3>(3, {2, 5, 3});
    q3(1, 3, 2) = nan_f;
    expect_call_error<attend::value_error>(q3, k3, v3, {}, "attend.value.non_finite", {"query", "[1,3,2]"});
}

// Large inputs are scanned a (batch, head) per unit on the call's threads (input_scan.hpp). Worker 1 takes head
// 1 and worker 0 head 2: the first bad element sits in head 1 and a later one in head 2, so an error taken from
// whichever worker stops first would name the wrong one. Every thread count names the first, with one message.
TEST(SdpaErrors, ParallelScansNameTheFirstBadElementAsOneThreadDoes) {
    const char* names[] = {"query", "key", "value"};
    for (int which = 0; which < 3; ++which) {
        SCOPED_TRACE(names[which]);
        auto x = make(1, 4, 4, 1024, 1024, 64, 64);  // 2^18 values per tensor: scanned in parallel
        tensor<float, 4>& t = which == 0 ? x.q : which == 1 ? x.k : x.v;
        t(0, 1, 300, 5) = nan_f;
        t(0, 2, 7, 1) = inf_f;
        std::string first;
        for (const int threads : {1, 2, 3}) {
            attend::sdpa_options o;
            o.threads = threads;
            expect_call_error<attend::value_error>(x.q, x.k, x.v, o, "attend.value.non_finite",
                                                   {names[which], "[0,1,300,5]"});
            const std::string text = value_error_text(
                [&] { (void)attend::scaled_dot_product_attention(x.q, x.k, x.v, attend::no_mask{}, o); });
            if (threads == 1) first = text;
            EXPECT_EQ(text, first) << threads << " threads";
        }
    }
    // A score that overflows comes before a non-finite value in the scan's order, on any number of threads.
    auto y = make(1, 4, 4, 1024, 1024, 64, 64);
    for (index_t d = 0; d < 64; ++d) y.q(0, 3, 10, d) = y.k(0, 3, 20, d) = 1e19f;
    y.v(0, 0, 0, 0) = nan_f;
    for (const int threads : {1, 2}) {
        attend::sdpa_options o;
        o.threads = threads;
        expect_call_error<attend::value_error>(y.q, y.k, y.v, o, "attend.value.score_overflow",
                                               {"query 10 and key 20", "head 3"});
    }
}

// The decode path (one query per head, no weights asked; with check_finite on, within one decode chunk too) scans
// k and v in its own pass instead of before it (tiled_kernel.hpp, deferred_kv_scan). It must reject what the scan
// before the kernel rejects, with the same message, before writing out or lse, also where the mask makes it skip
// the rows.

/// q [1, 4, 1, 8] over k, v [1, 2, key_len, 8]: 2600 keys are two decode chunks (2048 keys at this size).
qkv decode_inputs(index_t key_len = 2600) { return make(1, 4, 2, 1, key_len, 8, 8); }

/// Runs a decode call with `mask` in both kernels (the reference scans before it computes) and expects the same
/// value error from both, `id` with `fragment`, and nothing written by the tiled kernel's decode path.
template <class T, class K, class Mask>
void expect_decode_error(const tensor<T, 4>& q, const K& k, const K& v, const Mask& mask, const std::string& id,
                         const std::string& fragment) {
    tensor<T, 4> out(q.dimension(0), q.dimension(1), q.dimension(2), v.dimension(3));
    tensor<T, 3> lse(q.dimension(0), q.dimension(1), q.dimension(2));
    out.setConstant(T(sentinel));
    lse.setConstant(T(sentinel));
    attend::sdpa_options decode, reference;
    reference.kernel = attend::kernel::reference;
    const std::string found =
        value_error_text([&] { attend::scaled_dot_product_attention_into(q, k, v, mask, decode, out, nullptr, lse); });
    const std::string scanned =
        value_error_text([&] { (void)attend::scaled_dot_product_attention(q, k, v, mask, reference); });
    EXPECT_NE(found.find(" [" + id + "]"), std::string::npos) << found;
    EXPECT_NE(found.find(fragment), std::string::npos) << found;
    EXPECT_EQ(found, scanned);
    for (index_t n = 0; n < out.size(); ++n) ASSERT_EQ(out.data()[n], T(sentinel)) << "out written before the error";
    for (index_t n = 0; n < lse.size(); ++n) ASSERT_EQ(lse.data()[n], T(sentinel)) << "lse written before the error";
}

TEST(SdpaErrors, DecodeRejectsANonFiniteKeyOrValueItsPassMetOrSkippedWithTheScansMessageBeforeWriting) {
    const auto masks = [](const auto& check) {
        check(attend::no_mask{});
        check(attend::key_padding({700}));  // keys >= 700 skipped: a trimmed tile, then empty tiles and chunks
        check(attend::sliding_window(100, 0, attend::alignment::bottom_right));  // only the last 101 keys read
    };
    // 2600 keys: two chunks; 1000: one.
    const std::vector<std::pair<index_t, std::vector<index_t>>> lengths{{2600, {5, 1023, 2048, 2599}},
                                                                        {1000, {5, 699, 999}}};
    for (const auto& [key_len, bad_keys] : lengths)
        for (const bool in_values : {false, true})
            for (const index_t key : bad_keys)
                for (const float bad : {nan_f, inf_f, -inf_f}) {
                    SCOPED_TRACE((in_values ? "value " : "key ") + std::to_string(key) + " of " +
                                 std::to_string(key_len) + " holds " + std::to_string(bad));
                    auto x = decode_inputs(key_len);
                    (in_values ? x.v : x.k)(0, 1, key, 3) = bad;
                    (in_values ? x.v : x.k)(0, 1, key_len - 1, 7) = bad;  // a later one is not the one named
                    masks([&](const auto& mask) {
                        expect_decode_error(x.q, x.k, x.v, mask, "attend.value.non_finite",
                                            "[0,1," + std::to_string(key) + ",3]");
                    });
                }
    // Keys and values in 16 bits are scanned after they are widened, also where the mask skips them (head_dim 4:
    // a slice of the scan is as long as a key tile); the error names the same element.
    auto x = make(1, 4, 2, 1, 2600, 4, 4);
    tensor<Eigen::bfloat16, 4> k = x.k.cast<Eigen::bfloat16>(), v = x.v.cast<Eigen::bfloat16>();
    v(0, 0, 2300, 2) = Eigen::bfloat16(nan_f);
    expect_decode_error(x.q, k, v, attend::no_mask{}, "attend.value.non_finite", "[0,0,2300,2]");
    expect_decode_error(x.q, k, v, attend::key_padding({700}), "attend.value.non_finite", "[0,0,2300,2]");
}

TEST(SdpaErrors, DecodeRejectsScoresThatOverflowAsTheScanDoesAndComputesPairsThatFit) {
    // q.k = 8 x 1e19 x 1e19 x scale 1/sqrt(8) = 2.8e38, beyond half of float's range, for key 2400 only; the
    // sliding window never reads that key, and the rule holds for every pair, masked or not.
    // Also key 800 of 1000: one chunk.
    for (const auto& [key_len, key] :
         {std::pair<index_t, index_t>{2600, 2400}, std::pair<index_t, index_t>{1000, 800}}) {
        auto x = decode_inputs(key_len);
        x.q.setConstant(1e19f);
        for (index_t d = 0; d < 8; ++d) x.k(0, 0, key, d) = 1e19f;
        const std::string named = "key " + std::to_string(key);
        expect_decode_error(x.q, x.k, x.v, attend::no_mask{}, "attend.value.score_overflow", named);
        expect_decode_error(x.q, x.k, x.v, attend::sliding_window(10, 0, attend::alignment::bottom_right),
                            "attend.value.score_overflow", named);
    }
    // Rows that look dangerous by their magnitudes (||q||_1 max|k| = 2.25e38) but never meet: q on feature 0, the
    // large key on feature 1 only. Computed, and as the reference computes it.
    auto y = decode_inputs();
    y.q.setZero();
    for (index_t h = 0; h < 4; ++h) y.q(0, h, 0, 0) = 1.5e19f;
    for (index_t d = 0; d < 8; ++d) y.k(0, 1, 2400, d) = d == 1 ? 1.5e19f : 0.0f;
    attend::sdpa_options reference;
    reference.kernel = attend::kernel::reference;
    const auto decoded = attend::scaled_dot_product_attention(y.q, y.k, y.v);
    const auto expected = attend::scaled_dot_product_attention(y.q, y.k, y.v, reference);
    for (index_t n = 0; n < expected.out.size(); ++n) EXPECT_NEAR(decoded.out.data()[n], expected.out.data()[n], 1e-5);
}

// A decode of 16 queries on 2 query heads per kv head has 32 rows per block, more than the row kernels take: its
// slabs copy or map keys and values into the float panels and note them for the deferred scan there. A NaN or inf
// in a key or a value, and a key whose scores overflow, are found in that pass, in float and in double, before
// anything is written.
TEST(SdpaErrors, ADecodeOfManyRowsRejectsWhatItsPanelsHoldBeforeWriting) {
    const auto check = [](const auto& x) {
        using T = typename std::decay_t<decltype(x.k)>::Scalar;
        for (const bool in_values : {false, true}) {
            auto k = x.k, v = x.v;
            (in_values ? v : k)(0, 1, 2048, 3) = T(nan_f);
            expect_decode_error(x.q, k, v, attend::no_mask{}, "attend.value.non_finite", "[0,1,2048,3]");
        }
        // 8 x big^2 / sqrt(8): beyond half of T's range for key 2400 only.
        const T big = sizeof(T) == 4 ? T(1e19) : T(1e160);
        auto q = x.q, k = x.k;
        q.setConstant(big);
        for (index_t d = 0; d < 8; ++d) k(0, 0, 2400, d) = big;
        expect_decode_error(q, k, x.v, attend::no_mask{}, "attend.value.score_overflow", "key 2400");
    };
    const auto x = make(1, 4, 2, 16, 2600, 8, 8);
    check(x);
    struct {
        tensor<double, 4> q, k, v;
    } wide{x.q.cast<double>(), x.k.cast<double>(), x.v.cast<double>()};
    check(wide);
}

TEST(SdpaErrors, ScaleZeroNegativeNaNOrInfiniteIsValueScale) {
    const auto x = make(2, 2, 2, 4, 5, 3, 3);
    for (const double bad : {0.0, -0.0, -0.5, std::nan(""), std::numeric_limits<double>::infinity(),
                             -std::numeric_limits<double>::infinity()}) {
        SCOPED_TRACE("scale " + std::to_string(bad));
        attend::sdpa_options o;
        o.scale = bad;
        expect_call_error<attend::value_error>(x.q, x.k, x.v, o, "attend.value.scale", {"scale"});
    }
}

TEST(SdpaErrors, DropoutProbabilityOutsideZeroToOneIsValueDropout) {
    const auto x = make(2, 2, 2, 4, 5, 3, 3);
    for (const double bad : {-0.1, 1.0, 1.5, std::nan("")}) {
        SCOPED_TRACE("probability " + std::to_string(bad));
        attend::sdpa_options o;
        o.dropout = {bad, 7, true};
        expect_call_error<attend::value_error>(x.q, x.k, x.v, o, "attend.value.dropout", {"dropout probability"});
    }
    attend::sdpa_options o;
    o.dropout = {-0.1, 7, true};
    expect_call_error<attend::value_error>(x.q, x.k, x.v, o, "attend.value.dropout", {"-0.1"});
}

TEST(SdpaErrors, NegativeThreadCountIsValueThreads) {
    const auto x = make(2, 2, 2, 4, 5, 3, 3);
    attend::sdpa_options o;
    o.threads = -1;
    expect_call_error<attend::value_error>(x.q, x.k, x.v, o, "attend.value.threads", {"threads -1"});
}

TEST(SdpaErrors, ScoreBiasForAnotherHeadCountIsShapeScoreBiasHeads) {
    const auto x = make(2, 2, 1, 4, 5, 3, 3);
    attend::sdpa_options o;
    o.score_bias =
        attend::score_bias::alibi({0.5, 0.25, 0.125}, attend::alignment::top_left);  // three slopes, two heads
    expect_call_error<attend::shape_error>(x.q, x.k, x.v, o, "attend.shape.score_bias_heads", {"3 slopes", "2 heads"});
    expect_error<attend::value_error>(
        [] {
            (void)attend::score_bias::alibi({0.5, std::numeric_limits<double>::infinity()},
                                            attend::alignment::top_left);
        },
        "attend.value.alibi_slopes", {"head 1"});
}

// ---------------------------------------------------------------------------------------------------------------
// The hierarchy
// ---------------------------------------------------------------------------------------------------------------

TEST(SdpaErrors, EveryErrorIsAnAttendErrorAndAnInvalidArgument) {
    const auto x = make(2, 2, 2, 4, 5, 3, 3);
    const auto k = random4<4>(4, {2, 2, 5, 2});
    attend::sdpa_options bad_scale;
    bad_scale.scale = 0.0;
    int caught = 0;
    const auto expect_base = [&](auto&& f) {
        try {
            f();
        } catch (const attend::error& e) {
            ++caught;
            EXPECT_NE(dynamic_cast<const std::invalid_argument*>(&e), nullptr);
            EXPECT_FALSE(e.id().empty());
        }
    };
    expect_base([&] { (void)attend::scaled_dot_product_attention(x.q, k, x.v); });
    expect_base([&] { (void)attend::scaled_dot_product_attention(x.q, x.k, x.v, attend::key_padding({1}), {}); });
    expect_base([&] { (void)attend::scaled_dot_product_attention(x.q, x.k, x.v, bad_scale); });
    EXPECT_EQ(caught, 3);
}

}  // namespace
