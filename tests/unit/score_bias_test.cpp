// SPDX-License-Identifier: MIT
// Tests of attend/score_bias.hpp: ALiBi and T5 relative-position bias applied per tile of scores.
#include <attend/score_bias.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <typeinfo>
#include <vector>

#include "support/errors.hpp"
#include "support/random.hpp"

namespace {

using attend_test::expect_error;

using attend::alignment;
using attend::index_t;
using attend::score_bias;

constexpr alignment alignments[] = {alignment::top_left, alignment::bottom_right};

const char* name(alignment a) { return a == alignment::top_left ? "top_left" : "bottom_right"; }

/// A random score_bias of the given kind (0 alibi, 1 relative) for `heads` heads.
score_bias random_bias(attend_test::rng& g, int kind, index_t heads, alignment align) {
    if (kind == 0) {
        std::vector<double> slopes = g.bernoulli(0.5) ? attend::alibi_slopes(heads) : std::vector<double>{};
        if (slopes.empty())
            for (index_t h = 0; h < heads; ++h) slopes.push_back(g.uniform(-2.0, 2.0));
        return score_bias::alibi(std::move(slopes), align);
    }
    const bool bidirectional = g.bernoulli(0.5);
    const index_t num_buckets = g.bernoulli(0.5) ? 32 : 2 * g.uniform_int(2, 10);
    const index_t max_distance = num_buckets / 2 + g.uniform_int(1, 100);  // > max_exact either way
    attend::relative_position_bias<double> table(heads, bidirectional, num_buckets, max_distance, g.next());
    return score_bias::relative(table, align);
}

/// Runs add_tile on a random tile and checks every element became its old value + value(), exactly, and
/// that the padding columns of the leading dimension stayed untouched.
template <class T>
void check_tile_equals_value(attend_test::rng& g, const score_bias& bias, index_t heads, index_t query_len,
                             index_t key_len, index_t max_tile) {
    const index_t head = g.uniform_int(0, heads - 1);
    const index_t query_begin = g.uniform_int(0, query_len - 1), key_begin = g.uniform_int(0, key_len - 1);
    const index_t rows = g.uniform_int(1, std::min(max_tile, query_len - query_begin));
    const index_t cols = g.uniform_int(1, std::min(max_tile, key_len - key_begin));
    const index_t ld = cols + g.uniform_int(0, 3);
    std::vector<T> scores(static_cast<std::size_t>(rows * ld));
    for (auto& s : scores) s = static_cast<T>(g.uniform(-3, 3));
    const std::vector<T> before = scores;
    bias.add_tile(head, query_begin, key_begin, rows, cols, query_len, key_len, scores.data(), ld);
    for (index_t r = 0; r < rows; ++r)
        for (index_t c = 0; c < ld; ++c) {
            const auto k = static_cast<std::size_t>(r * ld + c);
            if (c >= cols) {
                ASSERT_EQ(scores[k], before[k]) << "padding column " << c << " was written";
                continue;
            }
            const T expected = before[k] + bias.value<T>(head, query_begin + r, key_begin + c, query_len, key_len);
            ASSERT_EQ(scores[k], expected)
                << "head " << head << " query " << query_begin + r << " key " << key_begin + c << " (L " << query_len
                << ", S " << key_len << ", tile " << rows << 'x' << cols << ')';
        }
}

TEST(ScoreBias, NoneIsEmptyAndAddsNothing) {
    const auto none = score_bias::none();
    EXPECT_TRUE(none.empty());
    EXPECT_TRUE(score_bias().empty());
    EXPECT_FALSE(score_bias::alibi({0.5}, attend::alignment::top_left).empty());
    EXPECT_NO_THROW(none.validate(7, 3, 5));
    std::vector<double> scores(12, 1.5);
    none.add_tile(0, 0, 0, 3, 4, 3, 4, scores.data(), 4);
    for (double s : scores) EXPECT_EQ(s, 1.5);
    EXPECT_EQ(none.value<float>(2, 1, 3, 3, 4), 0.0f);
}

TEST(ScoreBias, AlibiValueIsMinusSlopeTimesDistanceToTheAlignedDiagonal) {
    const auto top = score_bias::alibi({0.5, 0.25}, attend::alignment::top_left);
    const auto bottom = score_bias::alibi({0.5, 0.25}, alignment::bottom_right);
    // L 2, S 5: top_left puts query i at key i; bottom_right puts it at key i + 3.
    EXPECT_EQ(top.value<double>(0, 1, 1, 2, 5), 0.0);
    EXPECT_EQ(top.value<double>(0, 1, 0, 2, 5), -0.5);
    EXPECT_EQ(top.value<double>(1, 1, 4, 2, 5), -0.75);  // keys after the query count by |i - j| too
    EXPECT_EQ(bottom.value<double>(0, 1, 4, 2, 5), 0.0);
    EXPECT_EQ(bottom.value<double>(0, 0, 0, 2, 5), -1.5);
    EXPECT_EQ(bottom.value<float>(1, 0, 3, 2, 5), 0.0f);
    EXPECT_EQ(bottom.value<float>(1, 1, 0, 2, 5), -1.0f);
    // Decoding one token against a cache of 9: the last key is at distance 0.
    EXPECT_EQ(bottom.value<double>(0, 0, 8, 1, 9), 0.0);
    EXPECT_EQ(bottom.value<double>(0, 0, 0, 1, 9), -4.0);
}

TEST(ScoreBias, AlignmentsAgreeWhenQueryLenEqualsKeyLen) {
    attend_test::rng g(7);
    for (int rep = 0; rep < attend_test::repeat(200); ++rep) {
        const int kind = static_cast<int>(g.uniform_int(0, 1));
        const index_t heads = g.uniform_int(1, 4), n = g.uniform_int(1, 300);
        const std::uint64_t seed = g.next();
        attend_test::rng g1(seed), g2(seed);
        const auto top = random_bias(g1, kind, heads, alignment::top_left);
        const auto bottom = random_bias(g2, kind, heads, alignment::bottom_right);
        const index_t h = g.uniform_int(0, heads - 1), i = g.uniform_int(0, n - 1), j = g.uniform_int(0, n - 1);
        ASSERT_EQ(top.value<double>(h, i, j, n, n), bottom.value<double>(h, i, j, n, n));
    }
}

TEST(ScoreBias, RelativeValueIsTheTableValueAtTheAlignedQueryPosition) {
    attend::relative_position_bias<double> table(3, true, 32, 128, 5);
    const auto top = score_bias::relative(table, attend::alignment::top_left);
    const auto bottom = score_bias::relative(table, alignment::bottom_right);
    attend_test::rng g(8);
    for (int rep = 0; rep < attend_test::repeat(1000); ++rep) {
        const index_t query_len = g.uniform_int(1, 400), key_len = g.uniform_int(1, 400);
        const index_t h = g.uniform_int(0, 2), i = g.uniform_int(0, query_len - 1), j = g.uniform_int(0, key_len - 1);
        ASSERT_EQ(top.value<double>(h, i, j, query_len, key_len), table.value(h, i, j));
        ASSERT_EQ(bottom.value<double>(h, i, j, query_len, key_len), table.value(h, i + key_len - query_len, j));
        ASSERT_EQ(bottom.value<float>(h, i, j, query_len, key_len),
                  static_cast<float>(table.value(h, i + key_len - query_len, j)));
    }
}

TEST(ScoreBias, AddTileEqualsValueElementwiseForRandomTiles) {
    attend_test::rng g(9);
    for (int rep = 0; rep < attend_test::repeat(200); ++rep) {
        const int kind = static_cast<int>(g.uniform_int(0, 1));
        const auto align = alignments[g.uniform_int(0, 1)];
        const index_t heads = g.uniform_int(1, 6);
        // L != S on purpose, both ways round, including single rows and columns.
        const index_t query_len = g.uniform_int(1, 200), key_len = g.uniform_int(1, 200);
        const auto bias = random_bias(g, kind, heads, align);
        bias.validate(heads, query_len, key_len);
        SCOPED_TRACE(std::string(kind == 0 ? "alibi " : "relative ") + name(align));
        for (int tile = 0; tile < 4; ++tile) {
            check_tile_equals_value<double>(g, bias, heads, query_len, key_len, 70);
            check_tile_equals_value<float>(g, bias, heads, query_len, key_len, 70);
        }
        if (HasFatalFailure()) return;
    }
}

TEST(ScoreBias, TilesLargerThanTheStackBufferMatchValueToo) {
    attend_test::rng g(10);
    for (int kind = 0; kind < 2; ++kind)
        for (auto align : alignments)
            for (int rep = 0; rep < attend_test::repeat(4); ++rep) {
                const auto bias = random_bias(g, kind, 2, align);
                // rows + cols - 1 > 1024 diagonals: the heap path.
                check_tile_equals_value<double>(g, bias, 2, 700, 900, 700);
                check_tile_equals_value<float>(g, bias, 2, 1000, 300, 1000);
            }
}

TEST(ScoreBias, TilingTheWholeScoreMatrixEqualsOneTile) {
    attend_test::rng g(11);
    for (int rep = 0; rep < attend_test::repeat(50); ++rep) {
        const int kind = static_cast<int>(g.uniform_int(0, 1));
        const auto align = alignments[g.uniform_int(0, 1)];
        const index_t query_len = g.uniform_int(1, 90), key_len = g.uniform_int(1, 90);
        const index_t tile_rows = g.uniform_int(1, 17), tile_cols = g.uniform_int(1, 17);
        const auto bias = random_bias(g, kind, 3, align);
        std::vector<double> whole(static_cast<std::size_t>(query_len * key_len), 0.0), tiled = whole;
        bias.add_tile(2, 0, 0, query_len, key_len, query_len, key_len, whole.data(), key_len);
        for (index_t q0 = 0; q0 < query_len; q0 += tile_rows)
            for (index_t k0 = 0; k0 < key_len; k0 += tile_cols)
                bias.add_tile(2, q0, k0, std::min(tile_rows, query_len - q0), std::min(tile_cols, key_len - k0),
                              query_len, key_len, tiled.data() + q0 * key_len + k0, key_len);
        ASSERT_EQ(whole, tiled) << name(align) << (kind == 0 ? " alibi" : " relative");
    }
}

TEST(ScoreBias, EmptyTilesWriteNothing) {
    const auto bias = score_bias::alibi({1.0}, attend::alignment::top_left);
    double sentinel = 3.0;
    bias.add_tile(0, 0, 0, 0, 5, 4, 5, &sentinel, 5);
    bias.add_tile(0, 0, 0, 4, 0, 4, 5, &sentinel, 1);
    EXPECT_EQ(sentinel, 3.0);
}

TEST(ScoreBias, RelativeKeepsItsOwnCopyOfTheTable) {
    auto table = std::make_unique<attend::relative_position_bias<double>>(2, false, 16, 64, 1);
    const double expected = table->value(1, 10, 3);
    const auto bias = score_bias::relative(*table, attend::alignment::top_left);
    table->table().setConstant(99.0);  // later edits of the original do not reach the copy
    table.reset();                     // nor does its destruction
    EXPECT_EQ(bias.value<double>(1, 10, 3, 20, 20), expected);
    const score_bias copy = bias;  // copies share the table
    EXPECT_EQ(copy.value<double>(1, 10, 3, 20, 20), expected);
}

TEST(ScoreBias, RelativeSharedTableSeesTheCallersUpdates) {
    auto table = std::make_shared<attend::relative_position_bias<double>>(1, true);
    const auto bias = score_bias::relative(std::shared_ptr<const attend::relative_position_bias<double>>(table),
                                           attend::alignment::top_left);
    table->table().setConstant(2.5);
    EXPECT_EQ(bias.value<double>(0, 4, 1, 8, 8), 2.5);
}

TEST(ScoreBias, RelativeFromAFloatTableUsesTheSameValues) {
    attend::relative_position_bias<float> table(3, true, 16, 40, 4);
    const auto bias = score_bias::relative(table, alignment::bottom_right);
    for (index_t i = 0; i < 30; ++i)
        for (index_t j = 0; j < 50; ++j)
            for (index_t h = 0; h < 3; ++h) {
                ASSERT_EQ(bias.value<double>(h, i, j, 30, 50), static_cast<double>(table.value(h, i + 20, j)));
                ASSERT_EQ(bias.value<float>(h, i, j, 30, 50), table.value(h, i + 20, j));
            }
}

TEST(ScoreBias, ValidateRejectsAHeadCountThatDoesNotMatch) {
    const auto alibi = score_bias::alibi(attend::alibi_slopes(8), attend::alignment::top_left);
    EXPECT_NO_THROW(alibi.validate(8, 3, 4));
    expect_error<attend::shape_error>([&] { alibi.validate(12, 3, 4); }, "attend.shape.score_bias_heads");
    expect_error<attend::shape_error>([&] { alibi.validate(4, 3, 4); }, "attend.shape.score_bias_heads");
    const auto relative =
        score_bias::relative(attend::relative_position_bias<double>(6, true), attend::alignment::top_left);
    EXPECT_NO_THROW(relative.validate(6, 1, 1));
    expect_error<attend::shape_error>([&] { relative.validate(5, 1, 1); }, "attend.shape.score_bias_heads");
    expect_error<attend::shape_error>([] { score_bias::alibi({}, attend::alignment::top_left).validate(1, 1, 1); },
                                      "attend.shape.score_bias_heads");
}

TEST(ScoreBias, RejectsNonFiniteSlopesAndNullTables) {
    expect_error<attend::value_error>(
        [] {
            score_bias::alibi({0.5, std::numeric_limits<double>::infinity()}, attend::alignment::top_left);
        },
        "attend.value.alibi_slopes");
    expect_error<attend::value_error>(
        [] { score_bias::alibi({std::numeric_limits<double>::quiet_NaN()}, attend::alignment::top_left); },
        "attend.value.alibi_slopes");
    expect_error<attend::value_error>(
        [] {
            score_bias::relative(std::shared_ptr<const attend::relative_position_bias<double>>(),
                                 attend::alignment::top_left);
        },
        "attend.value.score_bias_table");
}

}  // namespace
