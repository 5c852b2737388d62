// SPDX-License-Identifier: MIT
// The backward of 16-bit attention (Eigen::half, Eigen::bfloat16 q, k, v, out, d_out with the forward's float lse;
// backward.hpp). The invariants:
// - the gradients are the float backward's on the same (already rounded) values, rounded to 16 bits once, bit for
//   bit, in both kernels and with sinks, soft-capping, a score bias, dropout, GQA and keys split over chunks; float
//   outputs passed to the _into form get the float gradients themselves, unrounded (the tiled kernel reads the
//   16-bit inputs in place, tests/unit/backward_memory_test.cpp shows it makes no float copies);
// - against double on the same rounded inputs that is within one 16-bit rounding of each gradient row's largest
//   magnitude (bf16 2^-7, fp16 2^-10), and not better than float would be (the rounding is really 16-bit);
// - bad input is rejected as in float, naming the same element, before any gradient is written.

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include <attend/attend.hpp>

#include "support/compare.hpp"
#include "support/errors.hpp"
#include "support/random.hpp"
#include "support/storage16.hpp"

namespace {

using attend::index_t;
using attend_test::bit_equal;
using attend_test::random16;
using attend_test::worst_row_error;
using bf16 = Eigen::bfloat16;
using half = Eigen::half;

/// A backward case in storage type T: inputs, the 16-bit forward's out and float lse, and d_out.
template <class T>
struct case16 {
    attend::tensor<T, 4> q, k, v, out, d_out;
    attend::tensor<float, 3> lse;

    case16(index_t heads, index_t kv_heads, index_t L, index_t S, index_t dim, std::uint64_t seed,
           const attend::sdpa_options& options)
        : q(random16<T>(seed, 2, heads, L, dim)),
          k(random16<T>(seed + 1, 2, kv_heads, S, dim)),
          v(random16<T>(seed + 2, 2, kv_heads, S, dim)),
          d_out(random16<T>(seed + 3, 2, heads, L, dim)) {
        auto forward = attend::scaled_dot_product_attention(q, k, v, mask(), options);
        out = forward.out;
        lse = forward.lse;
    }
    static auto mask() { return attend::causal(attend::alignment::bottom_right); }
    /// The _into form's gradients in caller-owned tensors of type G (the heads' bias and sink gradients too).
    template <class G>
    attend::attention_gradients<G, 4> gradients_into(const attend::sdpa_options& options) const {
        attend::attention_gradients<G, 4> g{attend::tensor<G, 4>(q.dimensions()), attend::tensor<G, 4>(k.dimensions()),
                                            attend::tensor<G, 4>(v.dimensions()),
                                            attend::tensor<G, 2>(q.dimension(1), q.dimension(2) + k.dimension(2) - 1),
                                            attend::tensor<G, 1>(q.dimension(1))};
        attend::scaled_dot_product_attention_backward_into(q, k, v, mask(), out, lse, d_out, options, g.d_query,
                                                           g.d_key, g.d_value, g.d_score_bias, g.d_sinks);
        return g;
    }
    template <class U>
    static attend::tensor<U, 4> as(const attend::tensor<T, 4>& x) {
        return x.template cast<U>();
    }
};

/// Plain; sinks with soft-capping on the reference kernel at 2 threads; an ALiBi score bias with dropout and
/// sinks on the tiled kernel at 3 threads.
std::vector<attend::sdpa_options> option_sets(index_t heads) {
    std::vector<attend::sdpa_options> sets(3);
    sets[1].softcap = 5.0;
    std::vector<double> sinks;
    for (index_t h = 0; h < heads; ++h) sinks.push_back(0.25 * static_cast<double>(h));
    sets[1].sinks = attend::attention_sinks(sinks);
    sets[1].kernel = attend::kernel::reference;
    sets[1].threads = 2;
    sets[2].score_bias = attend::score_bias::alibi(attend::alibi_slopes(heads), attend::alignment::top_left);
    sets[2].dropout = {0.25, 99, true};
    sets[2].sinks = sets[1].sinks;
    sets[2].threads = 3;
    return sets;
}

/// Bit equality of two rank-1 or rank-2 gradient tensors (the bias and sink gradients).
template <class X, class Y>
bool same_values(const X& got, const Y& want) {
    if (got.size() != want.size()) return false;
    for (index_t n = 0; n < got.size(); ++n)
        if (!(got.data()[n] == want.data()[n])) return false;
    return true;
}

template <class T>
class Backward16 : public ::testing::Test {};
TYPED_TEST_SUITE(Backward16, attend_test::storage16_types, attend_test::storage16_names);

TYPED_TEST(Backward16, GradientsAreTheFloatBackwardOnTheSameValuesRoundedOnce) {
    using T = TypeParam;
    struct shape {
        index_t heads, kv_heads, L, S, dim;
    };
    // The second shape splits each (batch, kv head)'s 300 keys over three chunks, whose dq partials are added in
    // chunk order before the one rounding.
    for (const shape sh : {shape{4, 2, 40, 70, 16}, shape{4, 1, 50, 300, 16}})
        for (const auto& options : option_sets(sh.heads)) {
            const case16<T> c(sh.heads, sh.kv_heads, sh.L, sh.S, sh.dim, 5, options);
            const auto got =
                attend::scaled_dot_product_attention_backward(c.q, c.k, c.v, c.mask(), c.out, c.lse, c.d_out, options);
            const auto want = attend::scaled_dot_product_attention_backward(
                c.template as<float>(c.q), c.template as<float>(c.k), c.template as<float>(c.v), c.mask(),
                c.template as<float>(c.out), c.lse, c.template as<float>(c.d_out), options);
            EXPECT_TRUE(bit_equal(got.d_query, attend::tensor<T, 4>(want.d_query.template cast<T>())));
            EXPECT_TRUE(bit_equal(got.d_key, attend::tensor<T, 4>(want.d_key.template cast<T>())));
            EXPECT_TRUE(bit_equal(got.d_value, attend::tensor<T, 4>(want.d_value.template cast<T>())));
            EXPECT_TRUE(same_values(got.d_score_bias, attend::tensor<T, 2>(want.d_score_bias.template cast<T>())));
            EXPECT_TRUE(same_values(got.d_sinks, attend::tensor<T, 1>(want.d_sinks.template cast<T>())));
            EXPECT_EQ(got.d_score_bias.size() != 0, !options.score_bias.empty());
            EXPECT_EQ(got.d_sinks.size() != 0, !options.sinks.empty());

            // Float outputs on request: the float gradients themselves; 16-bit outputs: the allocating form's.
            const auto f = c.template gradients_into<float>(options);
            EXPECT_TRUE(bit_equal(f.d_query, want.d_query));
            EXPECT_TRUE(bit_equal(f.d_key, want.d_key));
            EXPECT_TRUE(bit_equal(f.d_value, want.d_value));
            const auto h = c.template gradients_into<T>(options);
            EXPECT_TRUE(bit_equal(h.d_query, got.d_query));
            EXPECT_TRUE(bit_equal(h.d_key, got.d_key));
            EXPECT_TRUE(bit_equal(h.d_value, got.d_value));
            if (!options.score_bias.empty()) {
                EXPECT_TRUE(same_values(f.d_score_bias, want.d_score_bias));
                EXPECT_TRUE(same_values(h.d_score_bias, got.d_score_bias));
            }
            if (!options.sinks.empty()) {
                EXPECT_TRUE(same_values(f.d_sinks, want.d_sinks));
                EXPECT_TRUE(same_values(h.d_sinks, got.d_sinks));
            }
        }
}

TYPED_TEST(Backward16, MeetsItsAccuracyTargetAgainstDoubleOnTheSameInputs) {
    using T = TypeParam;
    const double target = std::is_same_v<T, bf16> ? std::ldexp(1.0, -7) : std::ldexp(1.0, -10);
    const attend::sdpa_options options;
    const case16<T> c(4, 2, 60, 130, 32, 9, options);
    const auto got =
        attend::scaled_dot_product_attention_backward(c.q, c.k, c.v, c.mask(), c.out, c.lse, c.d_out, options);
    const attend::tensor<double, 3> lse = c.lse.template cast<double>();
    const auto want = attend::scaled_dot_product_attention_backward(
        c.template as<double>(c.q), c.template as<double>(c.k), c.template as<double>(c.v), c.mask(),
        c.template as<double>(c.out), lse, c.template as<double>(c.d_out), options);
    for (const auto& [name, error] : {std::pair<const char*, double>{"dq", worst_row_error(got.d_query, want.d_query)},
                                      {"dk", worst_row_error(got.d_key, want.d_key)},
                                      {"dv", worst_row_error(got.d_value, want.d_value)}}) {
        EXPECT_LE(error, target) << name;
        EXPECT_GE(error, target / 16) << name << ": a float-sized error would mean nothing was rounded to 16 bits";
    }
}

TYPED_TEST(Backward16, BadInputIsRejectedAsInFloatBeforeAnyGradientIsWritten) {
    using T = TypeParam;
    const T sentinel(0.75f);
    const attend::sdpa_options options;
    for (const int which : {0, 1, 2}) {
        case16<T> c(2, 1, 5, 7, 8, 31, options);
        attend::tensor<T, 4>& bad = which == 0 ? c.q : which == 1 ? c.v : c.d_out;
        bad(1, 0, 3, 2) = T(std::numeric_limits<float>::quiet_NaN());
        attend::tensor<T, 4> dq(c.q.dimensions()), dk(c.k.dimensions()), dv(c.v.dimensions());
        for (auto* g : {&dq, &dk, &dv}) g->setConstant(sentinel);
        const std::string message = attend_test::expect_error<attend::value_error>(
            [&] {
                attend::scaled_dot_product_attention_backward_into(c.q, c.k, c.v, c.mask(), c.out, c.lse, c.d_out,
                                                                   options, dq, dk, dv);
            },
            "attend.value.non_finite");
        EXPECT_NE(message.find(which == 0 ? "query" : which == 1 ? "value" : "d_out"), std::string::npos) << message;
        EXPECT_NE(message.find("[1,0,3,2]"), std::string::npos) << message;
        for (const auto* g : {&dq, &dk, &dv})
            for (index_t n = 0; n < g->size(); ++n) ASSERT_TRUE(g->data()[n] == sentinel);
    }
    // A dq of the wrong shape is the float backward's shape error, and a dq over the query is aliasing.
    case16<T> c(2, 1, 5, 7, 8, 41, options);
    attend::tensor<T, 4> dq(2, 2, 5, 9), dk(c.k.dimensions()), dv(c.v.dimensions());
    attend_test::expect_error<attend::shape_error>(
        [&] {
            attend::scaled_dot_product_attention_backward_into(c.q, c.k, c.v, c.mask(), c.out, c.lse, c.d_out, options,
                                                               dq, dk, dv);
        },
        "attend.shape.backward_dq");
    attend_test::expect_error<attend::shape_error>(
        [&] {
            attend::scaled_dot_product_attention_backward_into(c.q, c.k, c.v, c.mask(), c.out, c.lse, c.d_out, options,
                                                               c.q, dk, dv);
        },
        "attend.shape.aliasing");
}

}  // namespace
