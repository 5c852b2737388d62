// SPDX-License-Identifier: MIT
// shard_layout, take_shard and join_shards (distributed/sharding.hpp): how ring attention places shards in the
// sequence. No MPI needed. Random totals and rank counts, both layouts.

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include <gtest/gtest.h>

#include <attend/distributed/sharding.hpp>

#include "support/errors.hpp"
#include "support/random.hpp"

namespace {

using attend::index_t;
using attend::distributed::sequence_axis;
using attend::distributed::shard_layout;
using attend::distributed::sharding;

std::vector<index_t> random_lengths(attend_test::rng& g, int ranks) {
    std::vector<index_t> lengths;
    for (int r = 0; r < ranks; ++r) lengths.push_back(g.uniform_int(0, 9));
    return lengths;
}

TEST(ShardLayout, EveryPositionOfTheSequenceBelongsToExactlyOneRowOfOneShard) {
    attend_test::rng g(11);
    for (int n = 0; n < attend_test::repeat(200); ++n)
        for (sharding kind : {sharding::contiguous, sharding::zigzag}) {
            const int ranks = static_cast<int>(g.uniform_int(1, 6));
            const shard_layout layout(kind, random_lengths(g, ranks));
            std::vector<int> owners(static_cast<std::size_t>(layout.total()), 0);
            for (int r = 0; r < ranks; ++r) {
                std::vector<int> local(static_cast<std::size_t>(layout.shard_length(r)), 0);
                for (const auto& s : layout.segments(r))
                    for (index_t i = 0; i < s.length; ++i) {
                        ++owners[static_cast<std::size_t>(s.global_begin + i)];
                        ++local[static_cast<std::size_t>(s.local_begin + i)];
                    }
                EXPECT_TRUE(std::all_of(local.begin(), local.end(), [](int c) { return c == 1; }));
            }
            EXPECT_TRUE(std::all_of(owners.begin(), owners.end(), [](int c) { return c == 1; }));
        }
}

TEST(ShardLayout, ZigzagGivesRankRChunksRAndTwoNMinusOneMinusR) {
    const shard_layout layout(sharding::zigzag, shard_layout::balanced_lengths(sharding::zigzag, 16, 4));
    for (int r = 0; r < 4; ++r) {
        ASSERT_EQ(layout.segments(r).size(), 2u);
        EXPECT_EQ(layout.segments(r)[0].global_begin, 2 * r);
        EXPECT_EQ(layout.segments(r)[1].global_begin, 2 * (7 - r));
        EXPECT_EQ(layout.segments(r)[1].local_begin, 2);
    }
}

TEST(ShardLayout, JoiningTheShardsOfATensorGivesTheTensorBack) {
    attend_test::rng g(12);
    for (int n = 0; n < attend_test::repeat(50); ++n)
        for (sharding kind : {sharding::contiguous, sharding::zigzag}) {
            const int ranks = static_cast<int>(g.uniform_int(1, 5));
            const shard_layout layout(kind, random_lengths(g, ranks));
            attend::tensor<double, 4> full(2, 3, layout.total(), 2);
            attend_test::fill_uniform(full, g.next());
            attend::tensor<double, 3> lse(2, 3, layout.total()), headless(2, layout.total(), 3);
            attend_test::fill_uniform(lse, g.next());
            attend_test::fill_uniform(headless, g.next());
            attend::tensor<double, 2> headless_lse(2, layout.total());
            attend_test::fill_uniform(headless_lse, g.next());
            std::vector<attend::tensor<double, 4>> shards;
            std::vector<attend::tensor<double, 3>> lse_shards, headless_shards;
            std::vector<attend::tensor<double, 2>> headless_lse_shards;
            for (int r = 0; r < ranks; ++r) {
                shards.push_back(attend::distributed::take_shard(full, layout, r));
                lse_shards.push_back(attend::distributed::take_shard(lse, layout, r, sequence_axis{2}));
                headless_shards.push_back(attend::distributed::take_shard(headless, layout, r, sequence_axis{1}));
                headless_lse_shards.push_back(attend::distributed::take_shard(headless_lse, layout, r));
                EXPECT_EQ(headless_shards.back().dimension(1), layout.shard_length(r));
            }
            const auto same = [](const auto& a, const auto& b) {
                return a.dimensions() == b.dimensions() && std::equal(a.data(), a.data() + a.size(), b.data());
            };
            EXPECT_TRUE(same(attend::distributed::join_shards(shards, layout), full));
            EXPECT_TRUE(same(attend::distributed::join_shards(lse_shards, layout, sequence_axis{2}), lse));
            EXPECT_TRUE(same(attend::distributed::join_shards(headless_shards, layout, sequence_axis{1}), headless));
            EXPECT_TRUE(same(attend::distributed::join_shards(headless_lse_shards, layout), headless_lse));
        }
}

TEST(ShardLayout, ASequenceAxisOutsideTheTensorIsAValueError) {
    const shard_layout layout(sharding::contiguous, {2, 2});
    const attend::tensor<double, 3> x(1, 4, 3);
    attend_test::expect_error<attend::value_error>(
        [&] { attend::distributed::take_shard(x, layout, 0, sequence_axis{3}); }, "attend.value.sequence_axis");
    const std::vector<attend::tensor<double, 3>> shards{attend::tensor<double, 3>(1, 2, 3),
                                                        attend::tensor<double, 3>(1, 2, 3)};
    attend_test::expect_error<attend::value_error>(
        [&] { attend::distributed::join_shards(shards, layout, sequence_axis{-1}); }, "attend.value.sequence_axis");
    // The axis named is the one cut: [1, 4, 3] along axis 1 has the layout's 4 positions, along axis 2 it has not.
    EXPECT_EQ(attend::distributed::take_shard(x, layout, 1, sequence_axis{1}).dimension(1), 2);
    attend_test::expect_error<attend::shape_error>(
        [&] { attend::distributed::take_shard(x, layout, 1, sequence_axis{2}); }, "attend.shape.shard_total");
}

/// Causal work of a rank: allowed (query, key) pairs of its queries, query p sees keys 0 .. p.
std::int64_t causal_pairs(const shard_layout& layout, int rank) {
    std::int64_t pairs = 0;
    for (const auto& s : layout.segments(rank))
        for (index_t i = 0; i < s.length; ++i) pairs += s.global_begin + i + 1;
    return pairs;
}

TEST(ShardLayout, BalancedZigzagKeepsCausalWorkOfEveryRankWithinTwoPercentOfTheMeanAndContiguousDoesNot) {
    for (int ranks : {2, 4, 8})
        for (index_t total : {index_t(4096), index_t(32768), index_t(100003)}) {
            for (sharding kind : {sharding::zigzag, sharding::contiguous}) {
                const shard_layout layout(kind, shard_layout::balanced_lengths(kind, total, ranks));
                std::vector<std::int64_t> work;
                for (int r = 0; r < ranks; ++r) work.push_back(causal_pairs(layout, r));
                const double mean =
                    static_cast<double>(std::accumulate(work.begin(), work.end(), std::int64_t(0))) / ranks;
                double worst = 0;
                for (auto w : work) worst = std::max(worst, std::abs(static_cast<double>(w) - mean) / mean);
                if (kind == sharding::zigzag) EXPECT_LE(worst, 0.02) << ranks << " ranks, total " << total;
                else EXPECT_GE(worst, 0.4) << ranks << " ranks, total " << total;
            }
        }
}

TEST(ShardLayout, BalancedLengthsDifferByAtMostOneChunkAndSumToTheTotal) {
    for (sharding kind : {sharding::contiguous, sharding::zigzag})
        for (int ranks = 1; ranks <= 7; ++ranks)
            for (index_t total = 0; total < 40; ++total) {
                const auto lengths = shard_layout::balanced_lengths(kind, total, ranks);
                EXPECT_EQ(std::accumulate(lengths.begin(), lengths.end(), index_t(0)), total);
                const auto [lo, hi] = std::minmax_element(lengths.begin(), lengths.end());
                EXPECT_LE(*hi - *lo, kind == sharding::zigzag ? 2 : 1);
            }
}

TEST(ShardLayoutErrors, NegativeLengthsAndNoRanksAreValueErrors) {
    attend_test::expect_error<attend::value_error>(
        [] {
            shard_layout(sharding::contiguous, {3, -1});
        },
        "attend.value.shard_lengths");
    attend_test::expect_error<attend::value_error>([] { shard_layout(sharding::zigzag, {}); },
                                                   "attend.value.shard_lengths");
    attend_test::expect_error<attend::value_error>([] { shard_layout::balanced_lengths(sharding::zigzag, 10, 0); },
                                                   "attend.value.shard_lengths");
}

TEST(ShardLayoutErrors, ATensorOfAnotherTotalOrShardsOfOtherLengthsAreShapeErrors) {
    const shard_layout layout(sharding::contiguous, {2, 3});
    attend::tensor<float, 4> full(1, 1, 6, 2);
    full.setZero();
    attend_test::expect_error<attend::shape_error>([&] { attend::distributed::take_shard(full, layout, 0); },
                                                   "attend.shape.shard_total");
    attend::tensor<float, 4> shard(1, 1, 2, 2);
    shard.setZero();
    const std::vector<attend::tensor<float, 4>> shards(2, shard);
    attend_test::expect_error<attend::shape_error>([&] { attend::distributed::join_shards(shards, layout); },
                                                   "attend.shape.shard_total");
}

}  // namespace
