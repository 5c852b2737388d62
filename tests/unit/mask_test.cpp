// SPDX-License-Identifier: MIT
// Tests of mask.hpp: each rule equals its definition, tile classification agrees with materialization, the
// algebra is set algebra, the two Boolean conventions convert exactly, dense masks broadcast like NumPy.
#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <attend/detail/empty_rows.hpp>
#include <attend/mask.hpp>

#include "support/random.hpp"

namespace {

using attend::index_t;
using predicate = std::function<bool(index_t b, index_t h, index_t i, index_t j)>;

attend::score_shape random_shape(attend_test::rng& g) {
    return {g.uniform_int(1, 3), g.uniform_int(1, 3), g.uniform_int(1, 40), g.uniform_int(1, 40)};
}

template <class Mask>
void expect_materializes_to(const Mask& mask, const attend::score_shape& s, const predicate& expected) {
    const auto dense = attend::materialize(mask, s);
    for (index_t b = 0; b < s.batch; ++b)
        for (index_t h = 0; h < s.heads; ++h)
            for (index_t i = 0; i < s.query_len; ++i)
                for (index_t j = 0; j < s.key_len; ++j)
                    ASSERT_EQ(dense(b, h, i, j), expected(b, h, i, j))
                        << "at [" << b << ',' << h << ',' << i << ',' << j << "] of [" << s.batch << ',' << s.heads
                        << ',' << s.query_len << ',' << s.key_len << ']';
}

/// Classification must never lie: empty means nothing allowed, full means everything allowed. With `exact`
/// (the primitive rules) mixed must also mean both kinds are present, so the kernel never tests a full tile.
template <class Mask>
void expect_classification_agrees(const Mask& mask, const attend::score_shape& s, attend_test::rng& g, bool exact) {
    const auto dense = attend::materialize(mask, s);
    for (int n = 0; n < 40; ++n) {
        attend::tile t;
        t.batch = g.uniform_int(0, s.batch - 1);
        t.head = g.uniform_int(0, s.heads - 1);
        t.query_begin = g.uniform_int(0, s.query_len - 1);
        t.query_end = g.uniform_int(t.query_begin + 1, s.query_len);
        t.key_begin = g.uniform_int(0, s.key_len - 1);
        t.key_end = g.uniform_int(t.key_begin + 1, s.key_len);
        bool any_allowed = false, any_forbidden = false;
        for (index_t i = t.query_begin; i < t.query_end; ++i)
            for (index_t j = t.key_begin; j < t.key_end; ++j)
                (dense(t.batch, t.head, i, j) ? any_allowed : any_forbidden) = true;
        const auto c = attend::classify(mask, s, t);
        if (c == attend::tile_class::empty) {
            ASSERT_FALSE(any_allowed);
        }
        if (c == attend::tile_class::full) {
            ASSERT_FALSE(any_forbidden);
        }
        if (exact && c == attend::tile_class::mixed) {
            ASSERT_TRUE(any_allowed && any_forbidden);
        }
    }
}

attend::tensor<bool, 4> random_bool(attend_test::rng& g, index_t b, index_t h, index_t l, index_t s, double p = 0.6) {
    attend::tensor<bool, 4> t(b, h, l, s);
    for (index_t n = 0; n < t.size(); ++n) t.data()[n] = g.bernoulli(p);
    return t;
}

std::vector<index_t> random_lengths(attend_test::rng& g, index_t batch, index_t limit) {
    std::vector<index_t> lengths;
    for (index_t b = 0; b < batch; ++b) lengths.push_back(g.uniform_int(0, limit));
    return lengths;
}

TEST(mask, causal_top_left_allows_keys_up_to_the_query_index) {
    attend_test::rng g(1);
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        const auto s = random_shape(g);
        const auto rule = attend::causal(attend::alignment::top_left);
        expect_materializes_to(rule, s, [](index_t, index_t, index_t i, index_t j) { return j <= i; });
        expect_classification_agrees(rule, s, g, true);
    }
}

TEST(mask, causal_bottom_right_aligns_the_last_query_with_the_last_key) {
    attend_test::rng g(2);
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        const auto s = random_shape(g);
        const auto rule = attend::causal(attend::alignment::bottom_right);
        const index_t offset = s.key_len - s.query_len;
        expect_materializes_to(rule, s, [&](index_t, index_t, index_t i, index_t j) { return j <= i + offset; });
        expect_classification_agrees(rule, s, g, true);
    }
}

TEST(mask, causal_alignments_agree_exactly_when_query_len_equals_key_len) {
    const attend::score_shape s{1, 1, 9, 9};
    const auto a = attend::to_string(attend::causal(attend::alignment::top_left), s);
    EXPECT_EQ(a, attend::to_string(attend::causal(attend::alignment::bottom_right), s));
    const attend::score_shape decode{1, 1, 2, 5};
    EXPECT_EQ(attend::to_string(attend::causal(attend::alignment::bottom_right), decode),
              "q0: k0 k1 k2 k3\nq1: k0 k1 k2 k3 k4\n");
    EXPECT_EQ(attend::to_string(attend::causal(attend::alignment::top_left), decode), "q0: k0\nq1: k0 k1\n");
}

TEST(mask, sliding_window_allows_a_band_around_the_aligned_diagonal) {
    attend_test::rng g(3);
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        const auto s = random_shape(g);
        const index_t left = g.uniform_int(0, 12), right = g.uniform_int(0, 12);
        const auto align = g.bernoulli(0.5) ? attend::alignment::top_left : attend::alignment::bottom_right;
        const index_t offset = align == attend::alignment::bottom_right ? s.key_len - s.query_len : 0;
        const auto rule = attend::sliding_window(left, right, align);
        expect_materializes_to(rule, s, [&](index_t, index_t, index_t i, index_t j) {
            return j >= i + offset - left && j <= i + offset + right;
        });
        expect_classification_agrees(rule, s, g, true);
    }
}

TEST(mask, prefix_lm_is_bidirectional_over_the_prefix_and_causal_after) {
    attend_test::rng g(4);
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        const auto s = random_shape(g);
        const index_t prefix = g.uniform_int(0, s.key_len);
        const auto rule = attend::prefix_lm(prefix, attend::alignment::top_left);
        expect_materializes_to(rule, s, [&](index_t, index_t, index_t i, index_t j) { return j < prefix || j <= i; });
        expect_classification_agrees(rule, s, g, true);
    }
}

TEST(mask, key_padding_forbids_keys_past_each_sequence_length) {
    attend_test::rng g(5);
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        const auto s = random_shape(g);
        const auto lengths = random_lengths(g, s.batch, s.key_len);
        const auto rule = attend::key_padding(lengths);
        expect_materializes_to(rule, s, [&](index_t b, index_t, index_t, index_t j) {
            return j < lengths[static_cast<std::size_t>(b)];
        });
        expect_classification_agrees(rule, s, g, true);
    }
}

TEST(mask, query_padding_removes_padded_queries_and_draws_them_as_padded) {
    attend_test::rng g(6);
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        const auto s = random_shape(g);
        const auto lengths = random_lengths(g, s.batch, s.query_len);
        const auto rule = attend::query_padding(lengths);
        expect_materializes_to(rule, s, [&](index_t b, index_t, index_t i, index_t) {
            return i < lengths[static_cast<std::size_t>(b)];
        });
        expect_classification_agrees(rule, s, g, true);
    }
    EXPECT_EQ(attend::to_string(attend::query_padding({2}) && attend::causal(attend::alignment::top_left),
                                {1, 1, 3, 3}),
              "q0: k0\nq1: k0 k1\nq2: (padded)\n");
}

TEST(mask, block_diagonal_keeps_packed_sequences_apart) {
    attend_test::rng g(7);
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        std::vector<index_t> lengths;
        std::vector<index_t> sequence_of;
        const index_t count = g.uniform_int(1, 6);
        for (index_t c = 0; c < count; ++c) {
            lengths.push_back(g.uniform_int(0, 9));
            for (index_t t = 0; t < lengths.back(); ++t) sequence_of.push_back(c);
        }
        const auto total = static_cast<index_t>(sequence_of.size());
        if (total == 0) continue;
        const attend::score_shape s{g.uniform_int(1, 2), g.uniform_int(1, 2), total, total};
        const auto rule = attend::block_diagonal(attend::segment_lengths(lengths));
        expect_materializes_to(rule, s, [&](index_t, index_t, index_t i, index_t j) {
            return sequence_of[static_cast<std::size_t>(i)] == sequence_of[static_cast<std::size_t>(j)];
        });
        expect_classification_agrees(rule, s, g, true);
    }
}

TEST(mask, dense_allowed_mask_classifies_tiles_exactly) {
    attend_test::rng g(8);
    for (int n = 0; n < attend_test::repeat(100); ++n) {
        const auto s = random_shape(g);
        const auto values = random_bool(g, s.batch, s.heads, s.query_len, s.key_len, g.uniform(0.0, 1.0));
        const auto mask = attend::allowed_mask::from_torch_sdpa(values);
        expect_materializes_to(mask, s, [&](index_t b, index_t h, index_t i, index_t j) { return values(b, h, i, j); });
        expect_classification_agrees(mask, s, g, true);
    }
}

TEST(mask, dense_forbidden_mask_classifies_tiles_exactly) {
    attend_test::rng g(18);
    for (int n = 0; n < attend_test::repeat(100); ++n) {
        const auto s = random_shape(g);
        const auto blocked = random_bool(g, s.batch, s.heads, s.query_len, s.key_len, g.uniform(0.0, 1.0));
        const auto mask = attend::to_allowed(attend::forbidden_mask::true_means_blocked(blocked));  // stored inverted
        expect_materializes_to(mask, s,
                               [&](index_t b, index_t h, index_t i, index_t j) { return !blocked(b, h, i, j); });
        expect_classification_agrees(mask, s, g, true);
    }
}

TEST(mask, algebra_is_set_algebra_and_classification_stays_sound) {
    attend_test::rng g(9);
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        const auto s = random_shape(g);
        const auto dense_values = random_bool(g, s.batch, s.heads, s.query_len, s.key_len);
        const auto dense = attend::allowed_mask::from_torch_sdpa(dense_values);
        const auto causal = attend::causal(attend::alignment::top_left);
        const index_t left = g.uniform_int(0, 6);
        const auto window = attend::sliding_window(left, 0, attend::alignment::top_left);
        const auto pad = attend::key_padding(random_lengths(g, s.batch, s.key_len));
        const auto a = attend::materialize(causal, s), w = attend::materialize(window, s);
        const auto d = attend::materialize(dense, s), p = attend::materialize(pad, s);

        const auto expr1 = (causal && pad) || !dense;
        expect_materializes_to(expr1, s, [&](index_t b, index_t h, index_t i, index_t j) {
            return (a(b, h, i, j) && p(b, h, i, j)) || !d(b, h, i, j);
        });
        expect_classification_agrees(expr1, s, g, false);

        const auto expr2 = !(window || dense) && !causal;
        expect_materializes_to(expr2, s, [&](index_t b, index_t h, index_t i, index_t j) {
            return !(w(b, h, i, j) || d(b, h, i, j)) && !a(b, h, i, j);
        });
        expect_classification_agrees(expr2, s, g, false);

        // De Morgan: !(x && y) == !x || !y.
        EXPECT_EQ(attend::to_string(!(causal && dense), s), attend::to_string(!causal || !dense, s));
    }
}

TEST(mask, forbidden_and_allowed_conventions_convert_exactly_and_round_trip) {
    attend_test::rng g(10);
    for (int n = 0; n < attend_test::repeat(50); ++n) {
        const auto s = random_shape(g);
        const auto blocked = random_bool(g, s.batch, s.heads, s.query_len, s.key_len);
        const auto forbidden = attend::forbidden_mask::from_torch_mha(blocked);
        expect_materializes_to(attend::to_allowed(forbidden), s,
                               [&](index_t b, index_t h, index_t i, index_t j) { return !blocked(b, h, i, j); });
        const auto allowed = attend::allowed_mask::from_torch_sdpa(blocked);
        expect_materializes_to(attend::to_allowed(attend::to_forbidden(allowed)), s,
                               [&](index_t b, index_t h, index_t i, index_t j) { return blocked(b, h, i, j); });
        // The trap of the seeds: the same tensor read in the other convention is the complement.
        EXPECT_EQ(attend::to_string(attend::to_allowed(forbidden), s), attend::to_string(!allowed, s));
    }
}

TEST(mask, key_padding_as_a_dense_mask_broadcasts_over_heads_and_queries) {
    attend_test::rng g(11);
    for (int n = 0; n < attend_test::repeat(50); ++n) {
        const auto s = random_shape(g);
        const auto lengths = random_lengths(g, s.batch, s.key_len);
        attend::tensor<bool, 4> pad(s.batch, 1, 1, s.key_len);  // [batch, 1, 1, key_len], true = blocked
        for (index_t b = 0; b < s.batch; ++b)
            for (index_t j = 0; j < s.key_len; ++j) pad(b, 0, 0, j) = j >= lengths[static_cast<std::size_t>(b)];
        EXPECT_EQ(attend::to_string(attend::to_allowed(attend::forbidden_mask::from_torch_mha(pad)), s),
                  attend::to_string(attend::key_padding(lengths), s));
    }
}

TEST(mask, dense_masks_align_from_the_right_like_numpy) {
    // Rank 2 [query_len, key_len] applies to every batch and head.
    attend::tensor<bool, 2> grid(2, 3);
    grid.setValues({{true, false, true}, {false, true, false}});
    EXPECT_EQ(attend::to_string(attend::allowed_mask::query_key_grid(grid), {2, 1, 2, 3}),
              "batch 0, head 0:\nq0: k0 k2\nq1: k1\nbatch 1, head 0:\nq0: k0 k2\nq1: k1\n");

    // Rank 3 against rank-4 scores [batch, heads, L, S] means [heads, L, S], as in PyTorch.
    attend::tensor<bool, 3> per_head(2, 1, 2);
    per_head.setValues({{{true, false}}, {{false, true}}});
    const auto mask = attend::allowed_mask::from_torch_sdpa(per_head);
    EXPECT_EQ(attend::to_string(mask, {1, 2, 1, 2}), "batch 0, head 0:\nq0: k0\nbatch 0, head 1:\nq0: k1\n");

    // With rank-3 inputs the scores are [batch, L, S], so the same mask means [batch, L, S].
    attend::attention_shape rank3;
    rank3.batch = 2;
    rank3.heads = 1;
    rank3.kv_heads = 1;
    rank3.query_len = 1;
    rank3.key_len = 2;
    rank3.head_dim = 1;
    rank3.value_dim = 1;
    rank3.rank = 3;
    const auto bound = mask.bind(rank3);
    EXPECT_TRUE(bound.allowed(0, 0, 0, 0));
    EXPECT_FALSE(bound.allowed(0, 0, 0, 1));
    EXPECT_FALSE(bound.allowed(1, 0, 0, 0));
    EXPECT_TRUE(bound.allowed(1, 0, 0, 1));
}

TEST(mask, additive_values_of_a_wider_type_saturate_at_the_narrower_range) {
    // -1e300 in a double tensor is a finite fill: as a float mask it must stay finite (lowest()), not become -inf
    // and empty the row; 1e300 saturates at max(); -inf keeps forbidding.
    attend::tensor<double, 2> values(1, 3);
    values(0, 0) = -1e300;
    values(0, 1) = 1e300;
    values(0, 2) = -std::numeric_limits<double>::infinity();
    const auto m = attend::additive_mask<float>::query_key_grid(values);
    EXPECT_EQ(attend::to_string(m, {1, 1, 1, 3}), "q0: k0 k1\n");
    const auto bound = m.bind(attend::attention_shape{1, 1, 1, 1, 3, 1, 1, 4});
    EXPECT_EQ(bound.value(0, 0, 0, 0), std::numeric_limits<float>::lowest());
    EXPECT_EQ(bound.value(0, 0, 0, 1), std::numeric_limits<float>::max());
    EXPECT_EQ(bound.value(0, 0, 0, 2), -std::numeric_limits<float>::infinity());
}

TEST(mask, additive_terms_add_and_boolean_terms_contribute_zero_or_minus_infinity) {
    attend::tensor<double, 2> bias(2, 3);
    const double inf = std::numeric_limits<double>::infinity();
    bias.setValues({{0.5, -inf, -1.0}, {2.0, 0.0, -inf}});
    const auto additive = attend::additive_mask<double>::query_key_grid(bias);
    const auto expr = additive + attend::causal(attend::alignment::top_left);
    EXPECT_EQ(attend::to_string(expr, {1, 1, 2, 3}), "q0: k0\nq1: k0 k1\n");

    attend::attention_shape s;
    s.batch = s.heads = s.kv_heads = s.head_dim = s.value_dim = 1;
    s.query_len = 2;
    s.key_len = 3;
    const auto bound = expr.bind(s);
    double scores[6] = {1, 1, 1, 1, 1, 1};
    bound.apply(attend::tile{0, 0, 0, 2, 0, 3}, scores, 3);
    EXPECT_EQ(scores[0], 1.5);
    EXPECT_EQ(scores[1], -inf);
    EXPECT_EQ(scores[2], -inf);  // finite bias, but causal forbids
    EXPECT_EQ(scores[3], 3.0);
    EXPECT_EQ(scores[4], 1.0);
    EXPECT_EQ(scores[5], -inf);
}

TEST(mask, to_string_draws_the_seed_causal_grid_and_rows_without_keys) {
    EXPECT_EQ(attend::to_string(attend::causal(attend::alignment::top_left), {1, 1, 3, 3}),
              "q0: k0\nq1: k0 k1\nq2: k0 k1 k2\n");
    EXPECT_EQ(attend::to_string(attend::key_padding({0}), {1, 1, 2, 2}), "q0: (none)\nq1: (none)\n");
}

/// The first (batch, head, query) that is not padded and has no allowed key, by asking about every element.
template <class Bound>
std::optional<std::array<index_t, 3>> first_empty_row_by_scan(const Bound& mask, const attend::attention_shape& s) {
    for (index_t b = 0; b < s.batch; ++b)
        for (index_t h = 0; h < s.heads; ++h)
            for (index_t i = 0; i < s.query_len; ++i) {
                if (mask.query_padded(b, i)) continue;
                bool any = false;
                for (index_t j = 0; j < s.key_len && !any; ++j) any = mask.allowed(b, h, i, j);
                if (!any) return std::array<index_t, 3>{b, h, i};
            }
    return std::nullopt;
}

template <class Mask>
void expect_first_empty_row_of_scan(const Mask& mask, const attend::score_shape& s) {
    const auto shape = attend::detail::scores_only(s);
    const auto bound = mask.bind(shape);
    const auto want = first_empty_row_by_scan(bound, shape), got = attend::detail::first_empty_row(bound, shape);
    ASSERT_EQ(got.has_value(), want.has_value()) << attend::to_string(mask, s);
    if (want) {
        ASSERT_EQ(*got, *want) << attend::to_string(mask, s);
    }
}

/// Offsets from 0 of `segments` slots within [0, len], some of them empty.
std::vector<index_t> random_offsets(attend_test::rng& g, index_t segments, index_t len) {
    std::vector<index_t> offsets{0};
    for (index_t n = 0; n < segments; ++n)
        offsets.push_back(
            std::min(len, offsets.back() + (g.bernoulli(0.15) ? 0 : g.uniform_int(1, len / segments + 8))));
    return offsets;
}

// The empty-row check settles whole blocks of queries by one fully allowed tile of keys and searches row by row
// only where that fails; it must name the same first row as asking every element, for rules whose empty rows
// come in runs (packed segments with empty key slots or padding, bottom-right causal, windows) and for dense
// masks with scattered ones, at lengths past its 16-query blocks and 32-key tiles.
TEST(mask, first_empty_row_equals_a_scan_of_every_row) {
    attend_test::rng g(31);
    for (int n = 0; n < attend_test::repeat(60); ++n) {
        const attend::score_shape s{g.uniform_int(1, 2), g.uniform_int(1, 2), g.uniform_int(1, 300),
                                    g.uniform_int(1, 300)};
        const auto align = g.bernoulli(0.5) ? attend::alignment::top_left : attend::alignment::bottom_right;
        const index_t segments = g.uniform_int(1, 6);
        const auto packed = attend::packed_segments(attend::segment_offsets(random_offsets(g, segments, s.query_len)),
                                                    attend::segment_offsets(random_offsets(g, segments, s.key_len)));
        expect_first_empty_row_of_scan(packed, s);
        expect_first_empty_row_of_scan(packed.causal(align), s);
        expect_first_empty_row_of_scan(packed.window(g.uniform_int(0, 40), g.uniform_int(0, 3), align), s);
        expect_first_empty_row_of_scan(
            attend::causal(align) && attend::key_padding(random_lengths(g, s.batch, s.key_len)), s);
        expect_first_empty_row_of_scan(attend::sliding_window(g.uniform_int(0, 9), g.uniform_int(0, 9), align) &&
                                           attend::query_padding(random_lengths(g, s.batch, s.query_len)),
                                       s);
        expect_first_empty_row_of_scan(attend::allowed_mask::from_torch_sdpa(random_bool(
                                           g, s.batch, s.heads, s.query_len, s.key_len, g.uniform(0.0, 0.03))),
                                       s);
    }
}

TEST(mask_errors, a_mask_that_does_not_broadcast_names_both_shapes) {
    attend::tensor<bool, 2> grid(3, 4);
    grid.setConstant(true);
    const auto mask = attend::allowed_mask::query_key_grid(grid);
    try {
        (void)attend::materialize(mask, {1, 1, 3, 5});
        FAIL() << "expected mask_error";
    } catch (const attend::mask_error& e) {
        EXPECT_EQ(e.id(), "attend.mask.broadcast");
        EXPECT_NE(std::string(e.what()).find("[3,4]"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("[1,1,3,5]"), std::string::npos) << e.what();
    }
}

TEST(mask_errors, a_rank_four_mask_over_rank_three_scores_is_rejected) {
    attend::tensor<bool, 4> grid(1, 1, 2, 2);
    grid.setConstant(true);
    attend::attention_shape s;
    s.batch = s.heads = s.kv_heads = s.head_dim = s.value_dim = 1;
    s.query_len = s.key_len = 2;
    s.rank = 3;
    try {
        (void)attend::allowed_mask::from_torch_sdpa(grid).bind(s);
        FAIL() << "expected mask_error";
    } catch (const attend::mask_error& e) {
        EXPECT_EQ(e.id(), "attend.mask.rank");
    }
}

template <class F>
void expect_mask_error(const char* id, F&& f) {
    try {
        f();
        FAIL() << "expected mask_error " << id;
    } catch (const attend::mask_error& e) {
        EXPECT_EQ(e.id(), id) << e.what();
        EXPECT_NE(std::string(e.what()).find(std::string("[") + id + "]"), std::string::npos);
    }
}

TEST(mask_errors, lengths_are_checked_against_batch_and_sequence_length) {
    const attend::score_shape s{2, 1, 3, 4};
    expect_mask_error("attend.mask.lengths_batch", [&] { (void)attend::materialize(attend::key_padding({1}), s); });
    expect_mask_error("attend.mask.length_range", [&] { (void)attend::materialize(attend::key_padding({1, 5}), s); });
    expect_mask_error("attend.mask.length_range", [&] { (void)attend::materialize(attend::key_padding({-1, 2}), s); });
    expect_mask_error("attend.mask.lengths_batch", [&] {
        (void)attend::materialize(attend::query_padding({1, 2, 3}), s);
    });
    expect_mask_error("attend.mask.length_range", [&] { (void)attend::materialize(attend::query_padding({4, 1}), s); });
}

TEST(mask_errors, structured_rule_parameters_are_checked) {
    expect_mask_error("attend.mask.window", [] { (void)attend::sliding_window(-1, 2, attend::alignment::top_left); });
    expect_mask_error("attend.mask.window", [] { (void)attend::sliding_window(1, -2, attend::alignment::top_left); });
    expect_mask_error("attend.mask.prefix_len", [] { (void)attend::prefix_lm(-1, attend::alignment::top_left); });
    expect_mask_error("attend.mask.prefix_len", [] {
        (void)attend::materialize(attend::prefix_lm(5, attend::alignment::top_left), {1, 1, 3, 4});
    });
    expect_mask_error("attend.mask.block_lengths", [] {
        (void)attend::materialize(attend::block_diagonal(attend::segment_lengths({2, 1})), {1, 1, 4, 4});
    });
    expect_mask_error("attend.mask.block_lengths", [] {
        (void)attend::materialize(attend::block_diagonal(attend::segment_lengths({2, -1, 3})), {1, 1, 4, 4});
    });
    expect_mask_error("attend.mask.block_lengths", [] {
        (void)attend::materialize(attend::block_diagonal(attend::segment_lengths({2, 2})), {1, 1, 4, 5});
    });
}

TEST(mask_packed, lengths_and_offsets_name_the_same_segments_in_both_packed_forms) {
    const attend::score_shape s{1, 1, 9, 9};
    const auto by_lengths = attend::materialize(attend::block_diagonal(attend::segment_lengths({2, 3, 4})), s);
    const auto by_offsets = attend::materialize(attend::block_diagonal(attend::segment_offsets({0, 2, 5, 9})), s);
    const auto packed_lengths = attend::materialize(
        attend::packed_segments(attend::segment_lengths({2, 3, 4}), attend::segment_lengths({2, 3, 4})), s);
    const auto packed_offsets = attend::materialize(
        attend::packed_segments(attend::segment_offsets({0, 2, 5, 9}), attend::segment_offsets({0, 2, 5, 9})), s);
    for (index_t i = 0; i < 9; ++i)
        for (index_t j = 0; j < 9; ++j) {
            const bool same_segment = (i < 2) == (j < 2) && (i < 5) == (j < 5);
            EXPECT_EQ(by_lengths(0, 0, i, j), same_segment) << i << ',' << j;
            EXPECT_EQ(by_offsets(0, 0, i, j), same_segment) << i << ',' << j;
            EXPECT_EQ(packed_lengths(0, 0, i, j), same_segment) << i << ',' << j;
            EXPECT_EQ(packed_offsets(0, 0, i, j), same_segment) << i << ',' << j;
        }
    // Offsets that do not start at 0 or descend, and negative lengths, are refused when bound.
    for (const auto& bad : {std::vector<index_t>{1, 9}, std::vector<index_t>{0, 5, 2, 9}, std::vector<index_t>{}})
        expect_mask_error("attend.mask.block_lengths",
                          [&] { (void)attend::materialize(attend::block_diagonal(attend::segment_offsets(bad)), s); });
    expect_mask_error("attend.mask.segments", [&] {
        (void)attend::materialize(
            attend::packed_segments(attend::segment_lengths({2, -1, 8}), attend::segment_lengths({9})), s);
    });
    expect_mask_error("attend.mask.segments", [&] {
        (void)attend::materialize(
            attend::packed_segments(attend::segment_lengths({4}), attend::segment_lengths({attend::unbounded, 1})), s);
    });
}

TEST(mask_errors, additive_masks_reject_nan_and_plus_infinity) {
    for (const double bad : {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
        attend::tensor<double, 2> bias(2, 2);
        bias.setZero();
        bias(1, 0) = bad;
        try {
            (void)attend::additive_mask<double>::query_key_grid(bias);
            FAIL() << "expected value_error";
        } catch (const attend::value_error& e) {
            EXPECT_EQ(e.id(), "attend.value.additive_mask");
        }
    }
}

// ---- 0.2: diagonals are named, never defaulted ----

TEST(mask, a_decode_window_sits_on_the_diagonal_it_names) {
    // One query over five cached keys, the trap of 0.1's default: a decode's window is bottom-right.
    const attend::score_shape decode{1, 1, 1, 5};
    EXPECT_EQ(attend::to_string(attend::sliding_window(2, 0, attend::alignment::bottom_right), decode),
              "q0: k2 k3 k4\n");
    EXPECT_EQ(attend::to_string(attend::sliding_window(2, 0, attend::alignment::top_left), decode), "q0: k0\n");
    EXPECT_EQ(attend::to_string(attend::prefix_lm(1, attend::alignment::bottom_right), decode), "q0: k0 k1 k2 k3 k4\n");
    EXPECT_EQ(attend::to_string(attend::prefix_lm(1, attend::alignment::top_left), decode), "q0: k0\n");
}

/// The band of a window around diagonal offsets[b], computed in long double so huge offsets cannot overflow.
predicate band_of(const std::vector<index_t>& offsets, index_t left, index_t right) {
    return [=](index_t b, index_t, index_t i, index_t j) {
        const long double d = static_cast<long double>(j) - static_cast<long double>(i) -
                              static_cast<long double>(offsets[static_cast<std::size_t>(b)]);
        return (left == attend::unbounded || d >= -static_cast<long double>(left)) &&
               (right == attend::unbounded || d <= static_cast<long double>(right));
    };
}

std::vector<index_t> random_diagonal_offsets(attend_test::rng& g, const attend::score_shape& s) {
    std::vector<index_t> offsets(static_cast<std::size_t>(s.batch));
    for (auto& x : offsets) {
        const double u = g.uniform();
        x = u < 0.05   ? std::numeric_limits<index_t>::max()
            : u < 0.1  ? std::numeric_limits<index_t>::min() + 1
            : u < 0.15 ? index_t(1) << 50
            : u < 0.2  ? -(index_t(1) << 50)
                       : g.uniform_int(-s.query_len - 2, s.key_len + 2);
    }
    return offsets;
}

TEST(mask, explicit_diagonal_offsets_place_each_batch_rows_band_exactly) {
    attend_test::rng g(68);
    for (int n = 0; n < attend_test::repeat(60); ++n) {
        const auto s = random_shape(g);
        const auto offsets = random_diagonal_offsets(g, s);
        const index_t left = g.bernoulli(0.2) ? attend::unbounded : g.uniform_int(0, 45);
        const index_t right = g.bernoulli(0.2) ? attend::unbounded : g.uniform_int(0, 45);
        const auto window = attend::sliding_window(left, right, attend::diagonal_offsets(offsets));
        expect_materializes_to(window, s, band_of(offsets, left, right));
        expect_classification_agrees(window, s, g, true);
        const auto causal = attend::causal(attend::diagonal_offsets(offsets));
        expect_materializes_to(causal, s, band_of(offsets, attend::unbounded, 0));
        expect_classification_agrees(causal, s, g, true);
        const index_t prefix = g.uniform_int(0, s.key_len);
        const auto prefix_lm = attend::prefix_lm(prefix, attend::diagonal_offsets(offsets));
        const auto causal_part = band_of(offsets, attend::unbounded, 0);
        expect_materializes_to(prefix_lm, s, [&](index_t b, index_t h, index_t i, index_t j) {
            return j < prefix || causal_part(b, h, i, j);
        });
        expect_classification_agrees(prefix_lm, s, g, false);
        // One offset for every row is the same as that offset per row.
        const index_t one = offsets[0];
        EXPECT_EQ(attend::to_string(attend::causal(attend::diagonal_offset(one)), s),
                  attend::to_string(attend::causal(attend::diagonal_offsets(
                                        std::vector<index_t>(static_cast<std::size_t>(s.batch), one))),
                                    s));
    }
}

TEST(mask, offsets_generalize_the_alignments_and_an_unbounded_side_is_causal) {
    attend_test::rng g(69);
    for (int n = 0; n < attend_test::repeat(40); ++n) {
        const auto s = random_shape(g);
        const auto text = [&](const auto& m) { return attend::to_string(m, s); };
        EXPECT_EQ(text(attend::causal(attend::diagonal_offset(0))), text(attend::causal(attend::alignment::top_left)));
        EXPECT_EQ(text(attend::causal(attend::diagonal_offset(s.key_len - s.query_len))),
                  text(attend::causal(attend::alignment::bottom_right)));
        EXPECT_EQ(text(attend::causal(attend::aligned_to_key_lengths(
                      std::vector<index_t>(static_cast<std::size_t>(s.batch), s.key_len)))),
                  text(attend::causal(attend::alignment::bottom_right)));
        for (const auto a : {attend::alignment::top_left, attend::alignment::bottom_right})
            EXPECT_EQ(text(attend::sliding_window(attend::unbounded, 0, a)), text(attend::causal(a)));
    }
}

TEST(mask, causal_aligned_to_key_lengths_is_onnx_causal_over_each_rows_real_keys) {
    // ONNX Attention's is_causal with nonpad_kv_seqlen: row b's last query sees its last real key.
    attend_test::rng g(70);
    for (int n = 0; n < attend_test::repeat(40); ++n) {
        const auto s = random_shape(g);
        const auto real = random_lengths(g, s.batch, s.key_len);
        const auto mask = attend::causal(attend::aligned_to_key_lengths(real)) && attend::key_padding(real);
        expect_materializes_to(mask, s, [&](index_t b, index_t, index_t i, index_t j) {
            const index_t n_keys = real[static_cast<std::size_t>(b)];
            return j < n_keys && j <= i + n_keys - s.query_len;
        });
        expect_classification_agrees(mask, s, g, false);
    }
}

TEST(mask, a_window_from_config_counts_the_querys_own_key_as_hugging_face_does) {
    // transformers' sliding_window_overlay: key j is seen by query i when i - W < j <= i.
    attend_test::rng g(72);
    for (int n = 0; n < attend_test::repeat(30); ++n) {
        const auto s = random_shape(g);
        const index_t w = g.uniform_int(1, 12);
        const index_t offset = s.key_len - s.query_len;
        expect_materializes_to(attend::sliding_window_from_config(w, attend::alignment::bottom_right), s,
                               [&](index_t, index_t, index_t i, index_t j) {
                                   return j > i + offset - w && j <= i + offset;
                               });
    }
    for (const index_t bad : {index_t(0), index_t(-3)})
        expect_mask_error("attend.mask.window_from_config",
                          [&] { (void)attend::sliding_window_from_config(bad, attend::alignment::top_left); });
}

TEST(mask, a_batch_by_key_padding_mask_is_per_sequence_even_when_batch_equals_query_len) {
    // The 0.1 trap: PyTorch's key_padding_mask [B, S] read as [L, S] when B == L. Built by name it is per sequence.
    attend::tensor<bool, 2> padding(3, 4);  // [batch 3, key_len 4], true = padding
    padding.setValues({{false, false, false, true}, {false, true, true, true}, {false, false, false, false}});
    const attend::score_shape s{3, 2, 3, 4};
    const auto per_sequence = attend::to_allowed(attend::forbidden_mask::key_padding(padding));
    expect_materializes_to(per_sequence, s, [&](index_t b, index_t, index_t, index_t j) { return !padding(b, j); });
    EXPECT_EQ(attend::to_string(per_sequence, s), attend::to_string(attend::key_padding({3, 1, 4}), s));
    const auto as_grid = attend::to_allowed(attend::forbidden_mask::query_key_grid(padding));
    EXPECT_NE(attend::to_string(as_grid, s), attend::to_string(per_sequence, s));
    // HF's attention_mask (true = real token) says the same with the other polarity.
    attend::tensor<bool, 2> real(3, 4);
    for (index_t n = 0; n < real.size(); ++n) real.data()[n] = !padding.data()[n];
    EXPECT_EQ(attend::to_string(attend::allowed_mask::key_padding(real), s), attend::to_string(per_sequence, s));
    attend::tensor<float, 2> additive(3, 4);
    for (index_t n = 0; n < additive.size(); ++n)
        additive.data()[n] = padding.data()[n] ? -std::numeric_limits<float>::infinity() : 0.f;
    EXPECT_EQ(attend::to_string(attend::additive_mask<float>::key_padding(additive), s),
              attend::to_string(per_sequence, s));
}

TEST(mask, a_rank_one_mask_is_a_key_vector) {
    attend::tensor<bool, 1> keys(4);
    keys.setValues({true, false, true, true});
    EXPECT_EQ(attend::to_string(attend::allowed_mask::from_torch_sdpa(keys), {1, 1, 2, 4}),
              "q0: k0 k2 k3\nq1: k0 k2 k3\n");
}

TEST(mask, an_onnx_mask_shorter_than_key_len_forbids_the_keys_past_it) {
    attend_test::rng g(71);
    for (int n = 0; n < attend_test::repeat(40); ++n) {
        const auto s = random_shape(g);
        const index_t stored = g.uniform_int(1, s.key_len);
        attend::tensor<bool, 2> grid(s.query_len, stored);
        attend::tensor<float, 2> bias(s.query_len, stored);
        for (index_t x = 0; x < grid.size(); ++x) {
            grid.data()[x] = g.bernoulli(0.7);
            bias.data()[x] = grid.data()[x] ? static_cast<float>(g.uniform(-2, 2))
                                            : -std::numeric_limits<float>::infinity();
        }
        const auto expected = [&](index_t, index_t, index_t i, index_t j) { return j < stored && grid(i, j); };
        const auto boolean = attend::allowed_mask::from_onnx(grid);
        expect_materializes_to(boolean, s, expected);
        expect_classification_agrees(boolean, s, g, true);
        expect_materializes_to(attend::additive_mask<float>::from_onnx(bias), s, expected);
        expect_classification_agrees(attend::additive_mask<float>::from_onnx(bias), s, g, false);
    }
}

TEST(mask_errors, a_rank_two_grid_that_does_not_broadcast_names_the_key_padding_constructor) {
    attend::tensor<bool, 2> padding(2, 5);  // a [batch, key_len] key padding mask given as a grid
    padding.setConstant(false);
    try {
        (void)attend::materialize(attend::to_allowed(attend::forbidden_mask::query_key_grid(padding)), {2, 1, 3, 5});
        FAIL() << "expected mask_error";
    } catch (const attend::mask_error& e) {
        EXPECT_EQ(e.id(), "attend.mask.broadcast");
        EXPECT_NE(std::string(e.what()).find("forbidden_mask::key_padding(t)"), std::string::npos) << e.what();
    }
    // A short key axis is ONNX's convention only: elsewhere it does not broadcast.
    attend::tensor<bool, 2> short_grid(3, 4);
    short_grid.setConstant(true);
    expect_mask_error("attend.mask.broadcast", [&] {
        (void)attend::materialize(attend::allowed_mask::query_key_grid(short_grid), {1, 1, 3, 5});
    });
    expect_mask_error("attend.mask.broadcast", [&] {
        (void)attend::materialize(attend::allowed_mask::from_onnx(short_grid), {1, 1, 3, 3});
    });
}

TEST(mask_errors, per_row_diagonals_are_checked_against_the_batch_and_key_len) {
    expect_mask_error("attend.mask.diagonal_batch", [] {
        (void)attend::materialize(attend::causal(attend::diagonal_offsets({0, 1})), {3, 1, 2, 2});
    });
    expect_mask_error("attend.mask.diagonal_batch", [] {
        (void)attend::materialize(attend::sliding_window(1, 0, attend::aligned_to_key_lengths({2})), {2, 1, 2, 2});
    });
    expect_mask_error("attend.mask.length_range", [] {
        (void)attend::materialize(attend::prefix_lm(0, attend::aligned_to_key_lengths({3, -1})), {2, 1, 2, 2});
    });
    expect_mask_error("attend.mask.length_range", [] {
        (void)attend::materialize(attend::causal(attend::aligned_to_key_lengths({3})), {1, 1, 2, 2});
    });
    try {
        (void)attend::sliding_window(-1, 0, attend::alignment::bottom_right);
        FAIL() << "expected mask_error";
    } catch (const attend::mask_error& e) {
        EXPECT_NE(std::string(e.what()).find("attend::unbounded"), std::string::npos) << e.what();
    }
}

/// Floor division, for the definitions below (C++'s / truncates toward zero).
index_t floor_div(index_t a, index_t c) { return a / c - (a % c != 0 && (a < 0) != (c < 0)); }

/// Group ids [batch, key_len]: runs of text (-1) and of groups, a group sometimes coming back later in the row.
attend::tensor<int, 2> random_group_ids(attend_test::rng& g, index_t batch, index_t key_len) {
    attend::tensor<int, 2> ids(batch, key_len);
    for (index_t b = 0; b < batch; ++b) {
        int next = 0, id = -1;
        for (index_t j = 0; j < key_len; ++j) {
            if (j == 0 || g.bernoulli(0.2))
                id = g.bernoulli(0.4)               ? -1
                     : g.bernoulli(0.2) && next > 0 ? static_cast<int>(g.uniform_int(0, next - 1))
                                                    : next++;
            ids(b, j) = id;
        }
    }
    return ids;
}

TEST(mask, chunked_allows_exactly_the_keys_of_each_querys_chunk_as_transformers_counts_them) {
    // transformers' chunked_overlay: (kv - left_padding[b]) // C == (q - left_padding[b]) // C, with the query at
    // its diagonal key.
    attend_test::rng g(80);
    for (int n = 0; n < attend_test::repeat(120); ++n) {
        const auto s = random_shape(g);
        const index_t c = g.uniform_int(1, 9);
        std::vector<index_t> offsets(static_cast<std::size_t>(s.batch)), padding(offsets.size());
        for (std::size_t b = 0; b < offsets.size(); ++b) {
            offsets[b] = g.uniform_int(-s.query_len - 10, s.key_len + 10);
            padding[b] = g.uniform_int(-20, 20);
        }
        const auto rule = attend::chunked(c, attend::diagonal_offsets(offsets)).with_left_padding(padding);
        const auto same_chunk = [&](index_t b, index_t, index_t i, index_t j) {
            const auto u = static_cast<std::size_t>(b);
            return floor_div(j - padding[u], c) == floor_div(i + offsets[u] - padding[u], c);
        };
        expect_materializes_to(rule, s, same_chunk);
        expect_classification_agrees(rule, s, g, true);
        // Hugging Face's chunked causal mask: both parts written, classified exactly together.
        const auto hf = attend::causal(attend::diagonal_offsets(offsets)) && rule;
        expect_materializes_to(hf, s, [&](index_t b, index_t h, index_t i, index_t j) {
            return same_chunk(b, h, i, j) && j <= i + offsets[static_cast<std::size_t>(b)];
        });
        expect_classification_agrees(hf, s, g, true);
        // Without left padding the chunks start at key 0, on either alignment.
        const auto align = g.bernoulli(0.5) ? attend::alignment::top_left : attend::alignment::bottom_right;
        const index_t offset = align == attend::alignment::bottom_right ? s.key_len - s.query_len : 0;
        const auto plain = attend::chunked(c, align);
        expect_materializes_to(plain, s, [&](index_t, index_t, index_t i, index_t j) {
            return floor_div(j, c) == floor_div(i + offset, c);
        });
        expect_classification_agrees(plain, s, g, true);
    }
}

TEST(mask, chunked_is_exact_for_hostile_offsets_and_chunk_sizes) {
    attend_test::rng g(81);
    for (int n = 0; n < attend_test::repeat(60); ++n) {
        const auto s = random_shape(g);
        const auto offsets = random_diagonal_offsets(g, s);
        const index_t c = g.bernoulli(0.3) ? (index_t(1) << 40) + g.uniform_int(0, 5) : g.uniform_int(1, 50);
        const auto rule = attend::chunked(c, attend::diagonal_offsets(offsets));
        expect_materializes_to(rule, s, [&](index_t b, index_t, index_t i, index_t j) {
            // In long double: offsets reach the ends of Eigen::Index.
            const long double p = static_cast<long double>(offsets[static_cast<std::size_t>(b)]) + i;
            return std::floor(static_cast<long double>(j) / c) == std::floor(p / c);
        });
        expect_classification_agrees(rule, s, g, true);
    }
}

TEST(mask, bidirectional_groups_join_each_group_and_leave_text_to_the_causal_part) {
    // transformers' blockwise_overlay: q_group == kv_group and q_group >= 0, the query at its diagonal key.
    attend_test::rng g(82);
    for (int n = 0; n < attend_test::repeat(120); ++n) {
        const auto s = random_shape(g);
        const auto ids = random_group_ids(g, s.batch, s.key_len);
        std::vector<index_t> offsets(static_cast<std::size_t>(s.batch));
        for (auto& x : offsets) x = g.uniform_int(-s.query_len - 3, s.key_len + 3);
        const auto groups = attend::bidirectional_groups(ids, attend::diagonal_offsets(offsets));
        const auto same_group = [&](index_t b, index_t, index_t i, index_t j) {
            const index_t p = i + offsets[static_cast<std::size_t>(b)];
            const int q_group = p >= 0 && p < s.key_len ? ids(b, p) : -1;
            return q_group >= 0 && q_group == ids(b, j);
        };
        expect_materializes_to(groups, s, same_group);
        expect_classification_agrees(groups, s, g, true);
        const auto multimodal = attend::causal(attend::diagonal_offsets(offsets)) || groups;
        expect_materializes_to(multimodal, s, [&](index_t b, index_t h, index_t i, index_t j) {
            return same_group(b, h, i, j) || j <= i + offsets[static_cast<std::size_t>(b)];
        });
        expect_classification_agrees(multimodal, s, g, false);
    }
}

TEST(mask, to_string_draws_chunks_and_groups_as_transformers_documents_them) {
    // transformers' sdpa_mask docstring: chunk_size 3 over 5 tokens.
    const attend::score_shape five{1, 1, 5, 5};
    EXPECT_EQ(attend::to_string(
                  attend::causal(attend::alignment::top_left) && attend::chunked(3, attend::alignment::top_left), five),
              "q0: k0\nq1: k0 k1\nq2: k0 k1 k2\nq3: k3\nq4: k3 k4\n");
    // Left padding 1: the chunks count from the first real key.
    EXPECT_EQ(attend::to_string(attend::chunked(3, attend::alignment::top_left).with_left_padding({1}), five),
              "q0: k0\nq1: k1 k2 k3\nq2: k1 k2 k3\nq3: k1 k2 k3\nq4: k4\n");
    // A decode of two queries over five keys: the queries are positions 3 and 4.
    EXPECT_EQ(attend::to_string(attend::chunked(3, attend::alignment::bottom_right), {1, 1, 2, 5}),
              "q0: k3 k4\nq1: k3 k4\n");
    attend::tensor<int, 2> ids(1, 5);
    ids.setValues({{-1, 0, 0, -1, -1}});
    EXPECT_EQ(attend::to_string(attend::causal(attend::alignment::top_left) ||
                                    attend::bidirectional_groups(ids, attend::alignment::top_left),
                                five),
              "q0: k0\nq1: k0 k1 k2\nq2: k0 k1 k2\nq3: k0 k1 k2 k3\nq4: k0 k1 k2 k3 k4\n");
    EXPECT_EQ(attend::to_string(attend::bidirectional_groups(ids, attend::alignment::bottom_right), {1, 1, 2, 5}),
              "q0: (none)\nq1: (none)\n");
}

TEST(mask_errors, chunk_sizes_group_ids_and_left_padding_are_checked) {
    for (const index_t bad : {index_t(0), index_t(-4)})
        expect_mask_error("attend.mask.chunk_size", [&] { (void)attend::chunked(bad, attend::alignment::top_left); });
    expect_mask_error("attend.mask.lengths_batch", [] {
        (void)attend::materialize(attend::chunked(2, attend::alignment::top_left).with_left_padding({0, 1, 2}),
                                  {2, 1, 3, 3});
    });
    attend::tensor<int, 2> ids(2, 4);
    ids.setConstant(-1);
    ids(1, 2) = -2;
    expect_mask_error("attend.mask.group_id",
                      [&] { (void)attend::bidirectional_groups(ids, attend::alignment::top_left); });
    ids(1, 2) = 3;
    const auto groups = attend::bidirectional_groups(ids, attend::alignment::bottom_right);
    expect_mask_error("attend.mask.group_ids_shape", [&] { (void)attend::materialize(groups, {2, 1, 1, 5}); });
    expect_mask_error("attend.mask.group_ids_shape", [&] { (void)attend::materialize(groups, {3, 1, 1, 4}); });
    EXPECT_EQ(attend::to_string(groups, {2, 1, 1, 4}), "batch 0, head 0:\nq0: (none)\nbatch 1, head 0:\nq0: (none)\n");
}

}  // namespace
