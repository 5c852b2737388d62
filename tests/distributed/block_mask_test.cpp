// SPDX-License-Identifier: MIT
// The block mechanism of ring attention (distributed/detail/block_mask.hpp, and dropout offsets in sdpa.hpp):
// a mask of the whole sequence read on a block is the whole mask's sub-grid, and attention of a run of queries
// computed block by block over runs of keys and merged by lse equals those rows of one call over the whole
// sequence, dropout included. No MPI needed: this is what every rank of the ring does with its blocks.

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <attend/attend.hpp>
#include <attend/distributed/detail/block_mask.hpp>

#include "support/compare.hpp"
#include "support/random.hpp"

namespace {

using attend::index_t;
using attend_test::max_rel_diff;
namespace dd = attend::distributed::detail;

struct block {
    index_t q0, q1, k0, k1;
};

/// Checks that every block of `mask` (bound to [batch, heads, total, total]) is its sub-grid, and that
/// block_is_empty says "empty" exactly when the sub-grid allows nothing.
template <class Mask>
void expect_blocks_are_sub_grids(const Mask& mask, index_t batch, index_t heads, index_t total, attend_test::rng& g,
                                 const std::string& what) {
    attend::attention_shape global;
    global.batch = batch;
    global.heads = heads;
    global.kv_heads = heads;
    global.query_len = global.key_len = total;
    global.head_dim = global.value_dim = 1;
    const auto bound = mask.bind(global);
    const auto whole = attend::materialize(mask, {batch, heads, total, total});
    for (int n = 0; n < 20; ++n) {
        const index_t q0 = g.uniform_int(0, total - 1), q1 = g.uniform_int(q0 + 1, total);
        const index_t k0 = g.uniform_int(0, total - 1), k1 = g.uniform_int(k0 + 1, total);
        const auto part = attend::materialize(dd::block_of<Mask>(bound, q0, k0), {batch, heads, q1 - q0, k1 - k0});
        bool any = false;
        for (index_t b = 0; b < batch; ++b)
            for (index_t h = 0; h < heads; ++h)
                for (index_t i = q0; i < q1; ++i)
                    for (index_t j = k0; j < k1; ++j) {
                        ASSERT_EQ(part(b, h, i - q0, j - k0), whole(b, h, i, j))
                            << what << " block [" << q0 << ',' << q1 << ") x [" << k0 << ',' << k1 << ") at (" << b
                            << ',' << h << ',' << i << ',' << j << ')';
                        any = any || whole(b, h, i, j);
                    }
        EXPECT_EQ(dd::block_is_empty(bound, batch, heads, q0, q1, k0, k1), !any) << what;
    }
}

TEST(BlockMask, EveryBlockOfAMaskOfTheWholeSequenceIsItsSubGrid) {
    attend_test::rng g(21);
    for (int n = 0; n < attend_test::repeat(10); ++n) {
        const index_t batch = g.uniform_int(1, 3), heads = g.uniform_int(1, 3), total = g.uniform_int(1, 40);
        std::vector<index_t> lengths;
        for (index_t b = 0; b < batch; ++b) lengths.push_back(g.uniform_int(0, total));
        const index_t left = g.uniform_int(0, 6), right = g.uniform_int(0, 6);
        attend::tensor<bool, 4> dense(batch, heads, total, total);
        for (index_t e = 0; e < dense.size(); ++e) dense.data()[e] = g.bernoulli(0.6);
        expect_blocks_are_sub_grids(attend::causal(attend::alignment::top_left), batch, heads, total, g, "causal");
        expect_blocks_are_sub_grids(attend::sliding_window(left, right, attend::alignment::top_left), batch, heads,
                                    total, g, "sliding_window");
        expect_blocks_are_sub_grids(attend::key_padding(lengths), batch, heads, total, g, "key_padding");
        expect_blocks_are_sub_grids(attend::causal(attend::alignment::top_left) && attend::key_padding(lengths), batch,
                                    heads, total, g, "causal && key_padding");
        expect_blocks_are_sub_grids(attend::allowed_mask::true_means_allowed(dense), batch, heads, total, g, "dense");
        expect_blocks_are_sub_grids(!attend::sliding_window(left, right, attend::alignment::top_left) ||
                                        attend::prefix_lm(left, attend::alignment::top_left),
                                    batch, heads, total, g, "union and complement");
    }
}

TEST(BlockMask, QueryRowsComputedBlockByBlockAndMergedByLseEqualOneCallOverTheWholeSequenceWithDropout) {
    attend_test::rng g(22);
    for (int n = 0; n < attend_test::repeat(20); ++n) {
        const index_t batch = 2, heads = 4, kv_heads = 2, total = g.uniform_int(4, 40), dim = 5;
        attend::tensor<double, 4> q(batch, heads, total, dim), k(batch, kv_heads, total, dim),
            v(batch, kv_heads, total, dim);
        attend_test::fill_uniform(q, g.next());
        attend_test::fill_uniform(k, g.next());
        attend_test::fill_uniform(v, g.next());
        const auto mask = attend::sliding_window(g.uniform_int(0, total), 0, attend::alignment::top_left) &&
                          attend::key_padding({total, g.uniform_int(1, total)});
        attend::sdpa_options o;
        o.dropout = {0.3, g.next(), true};
        o.need_lse = true;
        o.empty_rows = attend::empty_rows::zero;
        const auto whole = attend::scaled_dot_product_attention(q, k, v, mask, o);

        attend::attention_shape global = attend::check_shapes(q, k, v);
        const auto bound = mask.bind(global);
        const index_t q0 = g.uniform_int(0, total - 1), q1 = g.uniform_int(q0 + 1, total);
        const index_t cut = g.uniform_int(1, total);  // key runs [0, cut) and [cut, total)
        const attend::tensor<double, 4> rows =
            q.slice(std::array<index_t, 4>{0, 0, q0, 0}, std::array<index_t, 4>{batch, heads, q1 - q0, dim});
        std::vector<attend::partial_attention<double, 4>> parts;
        for (auto [k0, k1] : {std::pair<index_t, index_t>{0, cut}, std::pair<index_t, index_t>{cut, total}}) {
            if (k0 == k1) continue;
            const std::array<index_t, 4> from{0, 0, k0, 0}, extent{batch, kv_heads, k1 - k0, dim};
            const attend::tensor<double, 4> kb = k.slice(from, extent), vb = v.slice(from, extent);
            attend::sdpa_options bo = o;
            bo.dropout.query_offset = q0;
            bo.dropout.key_offset = k0;
            auto r =
                attend::scaled_dot_product_attention(rows, kb, vb, dd::block_of<decltype(mask)>(bound, q0, k0), bo);
            parts.push_back({std::move(r.out), std::move(r.lse)});
        }
        auto merged = parts[0];
        for (std::size_t p = 1; p < parts.size(); ++p)
            merged = attend::merge_partials(merged.out, merged.lse, parts[p].out, parts[p].lse);
        const attend::tensor<double, 4> expected =
            whole.out.slice(std::array<index_t, 4>{0, 0, q0, 0}, std::array<index_t, 4>{batch, heads, q1 - q0, dim});
        EXPECT_LE(max_rel_diff(merged.out, expected, 0.0), 1e-12)
            << "total " << total << ", rows [" << q0 << ',' << q1 << "), cut " << cut;
    }
}

}  // namespace
