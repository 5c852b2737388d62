// SPDX-License-Identifier: MIT
// dropout_options::query_offset / key_offset (sdpa.hpp): a call over part of a sequence drops exactly what one
// call over the whole sequence drops at those positions, in the forward and in the backward. This is what lets
// ring attention replay the single-process dropout shard by shard.

#include <array>
#include <cmath>

#include <gtest/gtest.h>

#include <attend/attend.hpp>

#include "support/errors.hpp"
#include "support/random.hpp"

namespace {

using attend::index_t;

TEST(DropoutOffset, RowsOfACallWithAQueryOffsetEqualThoseRowsOfTheWholeCall) {
    attend_test::rng g(31);
    for (int n = 0; n < attend_test::repeat(20); ++n) {
        const index_t total = g.uniform_int(2, 50), dim = 4, q0 = g.uniform_int(0, total - 1);
        attend::tensor<double, 4> q(2, 2, total, dim), k(2, 2, total, dim), v(2, 2, total, dim);
        attend_test::fill_uniform(q, g.next());
        attend_test::fill_uniform(k, g.next());
        attend_test::fill_uniform(v, g.next());
        attend::sdpa_options o;
        o.dropout = {0.4, g.next(), true};
        o.kernel = g.bernoulli(0.5) ? attend::kernel::reference : attend::kernel::tiled;
        const auto whole = attend::scaled_dot_product_attention(q, k, v, o);
        const std::array<index_t, 4> from{0, 0, q0, 0}, extent{2, 2, total - q0, dim};
        const attend::tensor<double, 4> rows = q.slice(from, extent);
        o.dropout.query_offset = q0;
        const auto part = attend::scaled_dot_product_attention(rows, k, v, o);
        const attend::tensor<double, 4> expected = whole.out.slice(from, extent);
        // Not bit for bit: the kernel's query tiles start elsewhere. Dropping one more or one fewer weight would
        // move a row by about a weight, far more than 1e-13.
        for (index_t e = 0; e < expected.size(); ++e) ASSERT_NEAR(part.out.data()[e], expected.data()[e], 1e-13) << e;
    }
}

TEST(DropoutOffset, AKeyOffsetDropsTheWeightsTheWholeCallDropsAtThoseKeys) {
    attend_test::rng g(32);
    const index_t total = 40, dim = 3, k0 = 13;
    attend::tensor<double, 4> q(1, 2, total, dim), k(1, 2, total, dim), v(1, 2, total, dim);
    attend_test::fill_uniform(q, 1);
    attend_test::fill_uniform(k, 2);
    attend_test::fill_uniform(v, 3);
    attend::sdpa_options o;
    o.dropout = {0.5, 77, true};
    o.need_weights = true;
    o.weights_after_dropout = true;
    const auto whole = attend::scaled_dot_product_attention(q, k, v, o);
    const std::array<index_t, 4> from{0, 0, k0, 0}, extent{1, 2, total - k0, dim};
    const attend::tensor<double, 4> kb = k.slice(from, extent), vb = v.slice(from, extent);
    o.dropout.key_offset = k0;
    const auto part = attend::scaled_dot_product_attention(q, kb, vb, o);
    index_t dropped = 0;
    for (index_t h = 0; h < 2; ++h)
        for (index_t i = 0; i < total; ++i)
            for (index_t j = k0; j < total; ++j) {
                ASSERT_EQ(part.weights(0, h, i, j - k0) == 0, whole.weights(0, h, i, j) == 0)
                    << h << ',' << i << ',' << j;
                dropped += whole.weights(0, h, i, j) == 0;
            }
    EXPECT_GT(dropped, 0);
}

TEST(DropoutOffset, TheBackwardOfACallWithOffsetsEqualsTheRowsOfTheWholeBackward) {
    attend_test::rng g(33);
    const index_t total = 30, dim = 4, q0 = 11;
    attend::tensor<double, 4> q(1, 2, total, dim), k(1, 2, total, dim), v(1, 2, total, dim), d_out(1, 2, total, dim);
    attend_test::fill_uniform(q, 4);
    attend_test::fill_uniform(k, 5);
    attend_test::fill_uniform(v, 6);
    attend_test::fill_uniform(d_out, 7);
    attend::sdpa_options o;
    o.dropout = {0.3, 99, true};
    o.need_lse = true;
    const auto causal = attend::causal(attend::alignment::top_left);
    const auto fwd = attend::scaled_dot_product_attention(q, k, v, causal, o);
    const auto whole = attend::scaled_dot_product_attention_backward(q, k, v, causal, fwd.out, fwd.lse, d_out, o);
    // Queries [q0, total) against every key: with bottom_right the causal diagonal of this block is the whole's.
    const std::array<index_t, 4> from{0, 0, q0, 0}, extent{1, 2, total - q0, dim};
    const attend::tensor<double, 4> qb = q.slice(from, extent), ob = fwd.out.slice(from, extent),
                                    db = d_out.slice(from, extent);
    const attend::tensor<double, 3> lb =
        fwd.lse.slice(std::array<index_t, 3>{0, 0, q0}, std::array<index_t, 3>{1, 2, total - q0});
    o.dropout.query_offset = q0;
    const auto part = attend::scaled_dot_product_attention_backward(
        qb, k, v, attend::causal(attend::alignment::bottom_right), ob, lb, db, o);
    const attend::tensor<double, 4> expected = whole.d_query.slice(from, extent);
    for (index_t e = 0; e < expected.size(); ++e) EXPECT_NEAR(part.d_query.data()[e], expected.data()[e], 1e-13) << e;
}

TEST(DropoutOffset, NegativeOffsetsAreValueErrors) {
    attend::tensor<float, 4> q(1, 1, 2, 2);
    q.setZero();
    attend::sdpa_options o;
    o.dropout.query_offset = -1;
    attend_test::expect_error<attend::value_error>([&] { attend::scaled_dot_product_attention(q, q, q, o); },
                                                   "attend.value.dropout");
}

}  // namespace
