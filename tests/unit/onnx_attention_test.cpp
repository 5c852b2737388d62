// SPDX-License-Identifier: MIT
// ONNX's Attention operator (opsets 24 and 25), one test per attribute: each case of tests/data/onnx_attention.json
// (ONNX's own reference implementation in float64) is one documented attend call, with no hand-written mask_mod,
// in double, float, half and bfloat16 storage. The case names say the ONNX attribute; the test names say the
// attend form it maps to.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <vector>

#include <attend/attend.hpp>

#include "support/golden.hpp"

namespace {

using attend::alignment;
using attend::index_t;
using attend_test::json;

const json& onnx_cases() {
    static const json doc = attend_test::load_golden("onnx_attention.json");
    return doc;
}

/// One case of the file: its inputs in float64 (exact in every storage type) and the reference outputs.
struct onnx_case {
    const json& c;
    explicit onnx_case(const std::string& name) : c(attend_test::find_case(onnx_cases(), name)) {}
    template <int Rank>
    attend::tensor<double, Rank> input(const std::string& key) const {
        return attend_test::tensor_at<double, Rank>(c.at("inputs"), key);
    }
    template <int Rank>
    attend::tensor<double, Rank> output(const std::string& key) const {
        return attend_test::tensor_at<double, Rank>(c.at("outputs"), key);
    }
    std::vector<index_t> lengths() const {
        const auto t = attend_test::tensor_at<long long, 1>(c.at("inputs"), "nonpad_kv_seqlen");
        return std::vector<index_t>(t.data(), t.data() + t.size());
    }
    index_t past() const { return input<4>("past_key").dimension(2); }
    double attribute(const std::string& name) const { return c.at("attributes").at(name).get<double>(); }
};

/// |got - want| <= tolerance * max(1, |want|) everywhere; -inf exactly where want is -inf.
template <class T, int Rank>
void expect_close(const attend::tensor<T, Rank>& got, const attend::tensor<double, Rank>& want, double tolerance,
                  const std::string& what) {
    ASSERT_EQ(got.dimensions(), want.dimensions()) << what;
    for (index_t n = 0; n < want.size(); ++n) {
        const double g = static_cast<double>(got.data()[n]), w = want.data()[n];
        if (std::isinf(w)) {
            ASSERT_EQ(g, w) << what << " element " << n;
            continue;
        }
        ASSERT_NEAR(g, w, tolerance * std::max(1.0, std::abs(w))) << what << " element " << n;
    }
}

/// Rounding of a result in T plus the accumulation's: 16-bit outputs are rounded once from float.
template <class T>
double tolerance_of() {
    if constexpr (std::is_same_v<T, double>) return 1e-12;
    else if constexpr (std::is_same_v<T, float>) return 2e-6;
    else if constexpr (std::is_same_v<T, Eigen::half>) return 2e-3;
    else return 1.6e-2;
}

template <class T, int Rank>
attend::tensor<T, Rank> stored_as(const attend::tensor<double, Rank>& x) {
    return x.template cast<T>();
}

/// The case's 4-D Q, K, V as T under `mask` and `options` against Y (and qk_matmul_output when the case has it,
/// as result.scores or, for mode 3, result.weights), for every storage type.
template <class MakeMask>
void expect_onnx_result(const onnx_case& c, const MakeMask& make_mask, attend::sdpa_options options) {
    const auto q = c.input<4>("Q"), k = c.input<4>("K"), v = c.input<4>("V");
    const auto y = c.output<4>("Y");
    const bool has_qk = c.c.at("outputs").contains("qk_matmul_output");
    const int mode = has_qk ? static_cast<int>(c.attribute("qk_matmul_output_mode")) : -1;
    if (mode == 3) options.need_weights = true;
    else if (mode >= 0) options.need_scores = static_cast<attend::score_stage>(mode);
    const auto each = [&](auto type) {
        using T = decltype(type);
        const auto r = attend::scaled_dot_product_attention(stored_as<T>(q), stored_as<T>(k), stored_as<T>(v),
                                                            make_mask(type), options);
        const std::string what = std::string(c.c.at("name").get<std::string>()) + " in " + typeid(T).name();
        expect_close(r.out, y, tolerance_of<T>(), what + ": Y");
        if (mode >= 0)
            expect_close(mode == 3 ? r.weights : r.scores, c.output<4>("qk_matmul_output"), tolerance_of<T>(),
                         what + ": qk_matmul_output");
    };
    each(double{});
    each(float{});
    each(Eigen::half{});
    each(Eigen::bfloat16{});
}

/// A mask that does not depend on the storage type.
template <class Mask>
auto same_for_all(Mask mask) {
    return [mask](auto) { return mask; };
}

TEST(OnnxAttention, PlainAttentionIsScaledDotProductAttentionWithoutAMask) {
    expect_onnx_result(onnx_case("plain"), same_for_all(attend::no_mask{}), {});
}

TEST(OnnxAttention, ScaleIsOptionsScale) {
    const onnx_case c("scale");
    attend::sdpa_options o;
    o.scale = c.attribute("scale");
    expect_onnx_result(c, same_for_all(attend::no_mask{}), o);
}

TEST(OnnxAttention, KvNumHeadsBelowQNumHeadsIsGroupedQueryAttention) {
    expect_onnx_result(onnx_case("gqa"), same_for_all(attend::no_mask{}), {});
}

TEST(OnnxAttention, IsCausalWithoutACacheIsCausalTopLeft) {
    expect_onnx_result(onnx_case("is_causal"), same_for_all(attend::causal(alignment::top_left)), {});
}

TEST(OnnxAttention, NonpadKvSeqlenIsKeyPaddingByLengths) {
    const onnx_case c("nonpad_kv_seqlen");
    expect_onnx_result(c, same_for_all(attend::key_padding(c.lengths())), {});
}

TEST(OnnxAttention, IsCausalWithNonpadKvSeqlenIsCausalAlignedToKeyLengths) {
    const onnx_case c("is_causal_nonpad_kv_seqlen");
    const auto lengths = c.lengths();
    expect_onnx_result(
        c, same_for_all(attend::causal(attend::aligned_to_key_lengths(lengths)) && attend::key_padding(lengths)), {});
}

TEST(OnnxAttention, SoftcapIsOptionsSoftcap) {
    const onnx_case c("softcap");
    attend::sdpa_options o;
    o.softcap = c.attribute("softcap");
    expect_onnx_result(c, same_for_all(attend::causal(alignment::top_left)), o);
}

TEST(OnnxAttention, BoolMasksOfRankOneToFourAreAllowedMaskFromOnnx) {
    const auto rank_case = [](auto rank) {
        constexpr int R = decltype(rank)::value;
        const onnx_case c("bool_mask_rank_" + std::to_string(R));
        const auto grid = attend_test::tensor_at<bool, R>(c.c.at("inputs"), "attn_mask");
        expect_onnx_result(c, same_for_all(attend::allowed_mask::from_onnx(grid)), {});
    };
    rank_case(std::integral_constant<int, 1>{});
    rank_case(std::integral_constant<int, 2>{});
    rank_case(std::integral_constant<int, 3>{});
    rank_case(std::integral_constant<int, 4>{});
}

/// additive_mask::from_onnx in the scores' type of the storage type.
template <int R>
auto additive_from(const onnx_case& c) {
    const auto values = c.input<R>("attn_mask");
    return [values](auto type) {
        using Acc = attend::accumulator_t<decltype(type)>;
        return attend::additive_mask<Acc>::from_onnx(attend::tensor<Acc, R>(values.template cast<Acc>()));
    };
}

TEST(OnnxAttention, FloatMasksOfRankOneToFourAreAdditiveMaskFromOnnx) {
    expect_onnx_result(onnx_case("float_mask_rank_1"), additive_from<1>(onnx_case("float_mask_rank_1")), {});
    expect_onnx_result(onnx_case("float_mask_rank_2"), additive_from<2>(onnx_case("float_mask_rank_2")), {});
    expect_onnx_result(onnx_case("float_mask_rank_3"), additive_from<3>(onnx_case("float_mask_rank_3")), {});
    expect_onnx_result(onnx_case("float_mask_rank_4"), additive_from<4>(onnx_case("float_mask_rank_4")), {});
}

TEST(OnnxAttention, MasksShorterThanKeyLenForbidTheKeysPastThem) {
    const onnx_case b("bool_mask_shorter_than_key_len");
    expect_onnx_result(
        b,
        same_for_all(attend::allowed_mask::from_onnx(attend_test::tensor_at<bool, 2>(b.c.at("inputs"), "attn_mask"))),
        {});
    const onnx_case f("float_mask_shorter_than_key_len");
    expect_onnx_result(f, additive_from<4>(f), {});
}

TEST(OnnxAttention, ABoolMaskWithIsCausalIsTheirIntersection) {
    const onnx_case c("bool_mask_with_is_causal");
    const auto grid = attend::allowed_mask::from_onnx(attend_test::tensor_at<bool, 4>(c.c.at("inputs"), "attn_mask"));
    expect_onnx_result(c, same_for_all(grid && attend::causal(alignment::top_left)), {});
}

TEST(OnnxAttention, AFullyMaskedRowIsZeroUnderEmptyRowsZero) {
    const onnx_case c("fully_masked_row");
    attend::sdpa_options o;
    o.empty_rows = attend::empty_rows::zero;
    expect_onnx_result(
        c,
        same_for_all(attend::allowed_mask::from_onnx(attend_test::tensor_at<bool, 2>(c.c.at("inputs"), "attn_mask"))),
        o);
}

TEST(OnnxAttention, QkMatmulOutputModesZeroToTwoAreNeedScoresAndModeThreeNeedWeights) {
    const onnx_case zero("qk_matmul_output_mode_0");
    expect_onnx_result(zero, additive_from<2>(zero), {});
    const onnx_case one("qk_matmul_output_mode_1");
    attend::sdpa_options capped;
    capped.softcap = one.attribute("softcap");
    expect_onnx_result(one, additive_from<2>(one), capped);
    const onnx_case two("qk_matmul_output_mode_2");
    const auto two_mask = additive_from<2>(two);
    capped.softcap = two.attribute("softcap");
    expect_onnx_result(
        two, [&](auto type) { return two_mask(type) + attend::causal(alignment::top_left); }, capped);
    const onnx_case three("qk_matmul_output_mode_3");
    const auto grid =
        attend::allowed_mask::from_onnx(attend_test::tensor_at<bool, 2>(three.c.at("inputs"), "attn_mask"));
    expect_onnx_result(three, same_for_all(grid && attend::causal(alignment::top_left)), {});
}

TEST(OnnxAttention, SlidingWindowsAreSlidingWindowWithUnboundedForMinusOne) {
    const onnx_case both("window_left_right");
    expect_onnx_result(both, same_for_all(attend::sliding_window(1, 1, alignment::top_left)), {});
    const onnx_case open("window_left_unbounded_right");
    expect_onnx_result(open, same_for_all(attend::sliding_window(attend::unbounded, 0, alignment::top_left)), {});
    const onnx_case padded("window_with_nonpad_kv_seqlen");
    const auto lengths = padded.lengths();
    const auto d = attend::aligned_to_key_lengths(lengths);
    expect_onnx_result(padded,
                       same_for_all(attend::causal(d) && attend::sliding_window(1, attend::unbounded, d) &&
                                    attend::key_padding(lengths)),
                       {});
}

TEST(OnnxAttention, SoftmaxPrecisionDoubleIsAccumulationFloat64) {
    const onnx_case c("softmax_precision_double");
    const auto q = stored_as<float>(c.input<4>("Q")), k = stored_as<float>(c.input<4>("K")),
               v = stored_as<float>(c.input<4>("V"));
    attend::sdpa_options o;
    o.accumulation = attend::accumulation::float64;
    const auto r = attend::scaled_dot_product_attention(q, k, v, attend::causal(alignment::top_left), o);
    // within half an ulp of float: the double result rounded once
    expect_close(r.out, c.output<4>("Y"), 6.0e-8, "softmax_precision_double: Y");
}

/// Packed `[batch, len, heads * dim]` buffers as the split_heads views attend reads in place, and the output
/// written through one into a `[batch, query_len, heads * value_dim]` buffer.
template <class T>
attend::tensor<double, 3> packed_attention(const onnx_case& c) {
    const index_t H = static_cast<index_t>(c.attribute("q_num_heads")),
                  Hkv = static_cast<index_t>(c.attribute("kv_num_heads"));
    const auto q = stored_as<T>(c.input<3>("Q")), k = stored_as<T>(c.input<3>("K")), v = stored_as<T>(c.input<3>("V"));
    const index_t B = q.dimension(0), L = q.dimension(1), S = k.dimension(1);
    const index_t D = q.dimension(2) / H, Dv = v.dimension(2) / Hkv;
    attend::tensor<T, 3> y(B, L, H * Dv);
    attend::scaled_dot_product_attention_into(attend::split_heads(q.data(), B, L, H, D),
                                              attend::split_heads(k.data(), B, S, Hkv, D),
                                              attend::split_heads(v.data(), B, S, Hkv, Dv), attend::sdpa_options{},
                                              attend::split_heads(y.data(), B, L, H, Dv));
    return y.template cast<double>();
}

TEST(OnnxAttention, ThreeDimensionalInputsWithHeadCountsAreSplitHeadsViews) {
    const onnx_case c("packed_3d_gqa");
    const auto y = c.output<3>("Y");
    expect_close(packed_attention<double>(c), y, tolerance_of<double>(), "packed double");
    expect_close(packed_attention<float>(c), y, tolerance_of<float>(), "packed float");
    expect_close(packed_attention<Eigen::half>(c), y, tolerance_of<Eigen::half>(), "packed half");
    expect_close(packed_attention<Eigen::bfloat16>(c), y, tolerance_of<Eigen::bfloat16>(), "packed bfloat16");
}

/// past_key / past_value and the new K / V appended to a kv_cache (present_key / present_value are its keys
/// and values), Q attending over it under mask_of(past).
template <class T, class MaskOf>
void expect_cached_result(const onnx_case& c, const MaskOf& mask_of) {
    const auto pk = stored_as<T>(c.input<4>("past_key")), pv = stored_as<T>(c.input<4>("past_value"));
    const auto k = stored_as<T>(c.input<4>("K")), v = stored_as<T>(c.input<4>("V"));
    attend::kv_cache<T> cache(attend::kv_cache_config{}
                                  .with_batch(k.dimension(0))
                                  .with_kv_heads(k.dimension(1))
                                  .with_capacity(pk.dimension(2) + k.dimension(2))
                                  .with_head_dim(k.dimension(3))
                                  .with_value_dim(v.dimension(3)));
    cache.append(pk, pv);
    const index_t past = cache.length();
    cache.append(k, v);
    const auto r = attend::scaled_dot_product_attention(stored_as<T>(c.input<4>("Q")), cache.keys(), cache.values(),
                                                        mask_of(past), attend::sdpa_options{});
    const std::string what = c.c.at("name").get<std::string>() + " in " + typeid(T).name();
    expect_close(r.out, c.output<4>("Y"), tolerance_of<T>(), what + ": Y");
    const auto dense = [](const attend::strided_view<const T>& x) {
        attend::tensor<double, 4> t(x.dims[0], x.dims[1], x.dims[2], x.dims[3]);
        for (index_t b = 0; b < x.dims[0]; ++b)
            for (index_t h = 0; h < x.dims[1]; ++h)
                for (index_t i = 0; i < x.dims[2]; ++i)
                    for (index_t d = 0; d < x.dims[3]; ++d) t(b, h, i, d) = static_cast<double>(x.row(b, h, i)[d]);
        return t;
    };
    expect_close(dense(cache.keys()), c.output<4>("present_key"), 0, what + ": present_key");
    expect_close(dense(cache.values()), c.output<4>("present_value"), 0, what + ": present_value");
}

template <class MaskOf>
void expect_cached_for_all(const onnx_case& c, const MaskOf& mask_of) {
    expect_cached_result<double>(c, mask_of);
    expect_cached_result<float>(c, mask_of);
    expect_cached_result<Eigen::half>(c, mask_of);
    expect_cached_result<Eigen::bfloat16>(c, mask_of);
}

TEST(OnnxAttention, PastAndPresentKvAreAKvCacheAndIsCausalWithPastIsCausalAtThePastLength) {
    expect_cached_for_all(onnx_case("past_without_causal"), [](index_t) { return attend::no_mask{}; });
    expect_cached_for_all(onnx_case("is_causal_with_past"),
                          [](index_t past) { return attend::causal(attend::diagonal_offset(past)); });
    expect_cached_for_all(onnx_case("window_with_causal_and_past"), [](index_t past) {
        const auto d = attend::diagonal_offset(past);
        return attend::causal(d) && attend::sliding_window(2, attend::unbounded, d);
    });
}

}  // namespace
