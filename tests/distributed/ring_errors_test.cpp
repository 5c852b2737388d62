// SPDX-License-Identifier: MIT
// Bad input to ring attention (distributed/ring.hpp) under mpirun (2 and 4 ranks): whether the problem is on one
// rank or in how the ranks disagree, every rank throws the same typed error with the same id and message, no
// rank is left waiting (ctest's timeout catches a hang), and the communicator is clean afterwards: a valid call
// right after each error gives the right answer.

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <attend/attend.hpp>
#include <attend/distributed/ring.hpp>

#include "distributed/ring_support.hpp"
#include "support/errors.hpp"
#include "support/random.hpp"

namespace {

using attend::index_t;
namespace ad = attend::distributed;
using attend_test::mpi_rank;
using attend_test::mpi_size;

using tensor4 = attend::tensor<double, 4>;

tensor4 filled(index_t b, index_t h, index_t len, index_t dim, std::uint64_t seed) {
    tensor4 t(b, h, len, dim);
    attend_test::fill_uniform(t, seed + static_cast<std::uint64_t>(mpi_rank()));
    return t;
}

/// f throws E with `id` on this rank, and the message is the same on every rank. Then a valid causal ring call
/// still equals single-process attention (nothing was left in flight by the failed call).
template <class E, class F>
void expect_same_error_everywhere(F&& f, const std::string& id) {
    const std::string message = attend_test::expect_error<E>(f, id);
    EXPECT_TRUE(attend_test::same_on_every_rank(message)) << "rank " << mpi_rank() << ": " << message;

    const index_t total = 5 * mpi_size();
    attend::tensor<double, 4> q(1, 2, total, 4);
    attend_test::fill_uniform(q, 99);
    const ad::shard_layout layout(ad::sharding::contiguous,
                                  std::vector<index_t>(static_cast<std::size_t>(mpi_size()), 5));
    const auto qs = ad::take_shard(q, layout, mpi_rank());
    const auto causal = attend::causal(attend::alignment::top_left);
    const auto ring = ad::ring_attention(qs, qs, qs, causal, layout, MPI_COMM_WORLD);
    attend::sdpa_options o;
    o.threads = 1;
    const auto whole = attend::scaled_dot_product_attention(q, q, q, causal, o);
    EXPECT_LE(attend_test::relative_error(ring.out, ad::take_shard(whole.out, layout, mpi_rank())), 1e-12);
}

TEST(RingErrors, DifferentHeadDimsOnDifferentRanksAreRingHeadDimOnEveryRank) {
    const auto layout = attend_test::even_layout(4);
    const index_t dim = mpi_rank() == 1 ? 6 : 8;
    const auto q = filled(1, 2, 4, dim, 1), k = filled(1, 2, 4, dim, 2), v = filled(1, 2, 4, 8, 3);
    expect_same_error_everywhere<attend::shape_error>([&] { ad::ring_attention(q, k, v, layout, MPI_COMM_WORLD); },
                                                      "attend.shape.ring_head_dim");
}

TEST(RingErrors, DifferentValueDimsOnDifferentRanksAreRingHeadDimOnEveryRank) {
    const auto layout = attend_test::even_layout(4);
    const index_t value_dim = mpi_rank() == mpi_size() - 1 ? 5 : 8;
    const auto q = filled(1, 2, 4, 8, 1), k = filled(1, 2, 4, 8, 2), v = filled(1, 2, 4, value_dim, 3);
    expect_same_error_everywhere<attend::shape_error>([&] { ad::ring_attention(q, k, v, layout, MPI_COMM_WORLD); },
                                                      "attend.shape.ring_head_dim");
}

TEST(RingErrors, DifferentHeadsOrBatchOnDifferentRanksAreRingHeadsOnEveryRank) {
    const auto layout = attend_test::even_layout(4);
    const index_t heads = mpi_rank() == 1 ? 4 : 2;
    const auto q = filled(1, heads, 4, 8, 1), k = filled(1, 2, 4, 8, 2), v = filled(1, 2, 4, 8, 3);
    expect_same_error_everywhere<attend::shape_error>([&] { ad::ring_attention(q, k, v, layout, MPI_COMM_WORLD); },
                                                      "attend.shape.ring_heads");
    const index_t batch = mpi_rank() == 0 ? 2 : 1;
    const auto qb = filled(batch, 2, 4, 8, 1), kb = filled(batch, 2, 4, 8, 2), vb = filled(batch, 2, 4, 8, 3);
    expect_same_error_everywhere<attend::shape_error>([&] { ad::ring_attention(qb, kb, vb, layout, MPI_COMM_WORLD); },
                                                      "attend.shape.ring_heads");
}

TEST(RingErrors, ShardsThatDoNotMatchTheLayoutAreRingLayoutOnEveryRank) {
    // Rank 0 holds 5 keys where the layout gives it 4 positions.
    const auto layout = attend_test::even_layout(4);
    const index_t key_len = mpi_rank() == 0 ? 5 : 4;
    const auto q = filled(1, 2, 4, 8, 1), k = filled(1, 2, key_len, 8, 2), v = filled(1, 2, key_len, 8, 3);
    auto msg = attend_test::expect_error<attend::shape_error>(
        [&] { ad::ring_attention(q, k, v, layout, MPI_COMM_WORLD); }, "attend.shape.ring_layout");
    EXPECT_TRUE(attend_test::same_on_every_rank(msg)) << msg;
    EXPECT_NE(msg.find("rank 0 holds 4 queries and 5 keys"), std::string::npos) << msg;
    // Every shard of the length the layout gives, but the layout cut for another number of ranks.
    const ad::shard_layout other(ad::sharding::contiguous,
                                 std::vector<index_t>(static_cast<std::size_t>(mpi_size() + 1), 4));
    expect_same_error_everywhere<attend::shape_error>([&] { ad::ring_attention(q, q, q, other, MPI_COMM_WORLD); },
                                                      "attend.shape.ring_layout");
}

TEST(RingErrors, LayoutsThatDifferBetweenRanksAreRingOptionsOnEveryRank) {
    // Rank 1 says zigzag, the others contiguous: each rank's own length fits, the positions would not.
    const auto q = filled(1, 2, 4, 8, 1);
    const ad::sharding kind = mpi_rank() == 1 ? ad::sharding::zigzag : ad::sharding::contiguous;
    const ad::shard_layout layout(kind, std::vector<index_t>(static_cast<std::size_t>(mpi_size()), 4));
    expect_same_error_everywhere<attend::value_error>(
        [&] { ad::ring_attention(q, q, q, attend::causal(attend::alignment::top_left), layout, MPI_COMM_WORLD); },
        "attend.value.ring_options");
}

TEST(RingErrors, NoKeyOnAnyRankIsEmptyKeysOnEveryRank) {
    const auto layout = attend_test::even_layout(0);
    const auto q = filled(1, 2, 0, 8, 1), k = filled(1, 2, 0, 8, 2), v = filled(1, 2, 0, 8, 3);
    expect_same_error_everywhere<attend::shape_error>([&] { ad::ring_attention(q, k, v, layout, MPI_COMM_WORLD); },
                                                      "attend.shape.empty_keys");
}

TEST(RingErrors, WeightsAreNotAvailableInTheRing) {
    const auto layout = attend_test::even_layout(4);
    const auto q = filled(1, 2, 4, 8, 1);
    ad::ring_options o;
    o.attention.need_weights = true;
    expect_same_error_everywhere<attend::value_error>([&] { ad::ring_attention(q, q, q, layout, MPI_COMM_WORLD, o); },
                                                      "attend.value.need_weights");
}

TEST(RingErrors, ScoresAndFloat64AreServedByScaledDotProductAttentionOnly) {
    const auto layout = attend_test::even_layout(4);
    const auto q = filled(1, 2, 4, 8, 1);
    ad::ring_options o;
    o.attention.need_scores = attend::score_stage::masked;
    expect_same_error_everywhere<attend::value_error>([&] { ad::ring_attention(q, q, q, layout, MPI_COMM_WORLD, o); },
                                                      "attend.value.sdpa_only");
    o.attention.need_scores.reset();
    o.attention.accumulation = attend::accumulation::float64;
    expect_same_error_everywhere<attend::value_error>([&] { ad::ring_attention(q, q, q, layout, MPI_COMM_WORLD, o); },
                                                      "attend.value.sdpa_only");
}

TEST(RingErrors, SinksOrScoreFeaturesThatDifferBetweenRanksAreRingOptionsOnEveryRank) {
    const auto layout = attend_test::even_layout(4);
    const auto q = filled(1, 2, 4, 8, 1);
    ad::ring_options o;
    o.attention.sinks = attend::attention_sinks{0.5, mpi_rank() == 1 ? 1.0 : 2.0};
    expect_same_error_everywhere<attend::value_error>([&] { ad::ring_attention(q, q, q, layout, MPI_COMM_WORLD, o); },
                                                      "attend.value.ring_options");
    ad::ring_options bias;
    if (mpi_rank() == 0)
        bias.attention.score_bias = attend::score_bias::alibi({0.5, 0.25}, attend::alignment::top_left);
    expect_same_error_everywhere<attend::value_error>(
        [&] { ad::ring_attention(q, q, q, layout, MPI_COMM_WORLD, bias); }, "attend.value.ring_options");
}

TEST(RingErrors, SinksOfTheWrongCountAreTheSingleProcessErrorOnEveryRank) {
    const auto layout = attend_test::even_layout(4);
    const auto q = filled(1, 2, 4, 8, 1);
    ad::ring_options o;
    o.attention.sinks = attend::attention_sinks{0.5, 1.0, 2.0};  // 2 heads
    expect_same_error_everywhere<attend::shape_error>([&] { ad::ring_attention(q, q, q, layout, MPI_COMM_WORLD, o); },
                                                      "attend.shape.sinks");
}

TEST(RingErrors, OptionsThatDifferBetweenRanksAreRingOptionsOnEveryRank) {
    const auto layout = attend_test::even_layout(4);
    const auto q = filled(1, 2, 4, 8, 1), k = filled(1, 2, 4, 8, 2), v = filled(1, 2, 4, 8, 3);
    ad::ring_options o;
    o.attention.dropout = {0.1, mpi_rank() == 1 ? 5u : 6u, true};
    expect_same_error_everywhere<attend::value_error>([&] { ad::ring_attention(q, k, v, layout, MPI_COMM_WORLD, o); },
                                                      "attend.value.ring_options");
}

TEST(RingErrors, AShapeErrorOnOneRankIsThrownOnEveryRank) {
    const auto layout = attend_test::even_layout(4);
    const index_t value_len = mpi_rank() == 1 ? 3 : 4;
    const auto q = filled(1, 2, 4, 8, 1), k = filled(1, 2, 4, 8, 2), v = filled(1, 2, value_len, 8, 3);
    const auto message = [&] {
        expect_same_error_everywhere<attend::shape_error>([&] { ad::ring_attention(q, k, v, layout, MPI_COMM_WORLD); },
                                                          "attend.shape.key_len");
    };
    message();
}

TEST(RingErrors, ANonFiniteValueInOneShardIsThrownOnEveryRankAfterTheRingCompletes) {
    const auto layout = attend_test::even_layout(4);
    auto q = filled(1, 2, 4, 8, 1), k = filled(1, 2, 4, 8, 2), v = filled(1, 2, 4, 8, 3);
    if (mpi_rank() == mpi_size() - 1) k(0, 1, 2, 3) = std::numeric_limits<double>::quiet_NaN();
    expect_same_error_everywhere<attend::value_error>(
        [&] { ad::ring_attention(q, k, v, attend::causal(attend::alignment::top_left), layout, MPI_COMM_WORLD); },
        "attend.value.non_finite");
}

TEST(RingErrors, ShardsOrQueriesOfAnotherStorageTypeOnOneRankAreRingStorageOnEveryRank) {
    const auto layout = attend_test::even_layout(4);
    const auto q = filled(1, 2, 4, 8, 1), k = filled(1, 2, 4, 8, 2), v = filled(1, 2, 4, 8, 3);
    const auto as = [](const tensor4& x, auto type) {
        return attend::tensor<decltype(type), 4>(x.template cast<decltype(type)>());
    };
    // Rank 1 sends bf16 shards (half the bytes) to a ring of doubles; the forward and the backward both refuse.
    expect_same_error_everywhere<attend::value_error>(
        [&] {
            if (mpi_rank() == 1)
                ad::ring_attention(as(q, Eigen::bfloat16()), as(k, Eigen::bfloat16()), as(v, Eigen::bfloat16()), layout,
                                   MPI_COMM_WORLD);
            else ad::ring_attention(q, k, v, layout, MPI_COMM_WORLD);
        },
        "attend.value.ring_storage");
    // Float queries on every rank, but rank 1's keys and values in bf16: its shards would not fit the others'.
    expect_same_error_everywhere<attend::value_error>(
        [&] {
            if (mpi_rank() == 1)
                ad::ring_attention(as(q, float()), as(k, Eigen::bfloat16()), as(v, Eigen::bfloat16()), layout,
                                   MPI_COMM_WORLD);
            else ad::ring_attention(as(q, float()), as(k, float()), as(v, float()), layout, MPI_COMM_WORLD);
        },
        "attend.value.ring_storage");
    const auto out = filled(1, 2, 4, 8, 4);
    const attend::tensor<double, 3> lse(1, 2, 4);
    const attend::tensor<float, 3> lse_f(1, 2, 4);
    expect_same_error_everywhere<attend::value_error>(
        [&] {
            if (mpi_rank() == 0)
                ad::ring_attention_backward(as(q, float()), as(k, float()), as(v, float()), attend::no_mask{},
                                            as(out, float()), lse_f, as(out, float()), layout, MPI_COMM_WORLD);
            else ad::ring_attention_backward(q, k, v, attend::no_mask{}, out, lse, out, layout, MPI_COMM_WORLD);
        },
        "attend.value.ring_storage");
}

TEST(RingErrors, ANonFiniteValueInOneSixteenBitShardIsThrownOnEveryRank) {
    const auto layout = attend_test::even_layout(4);
    const auto q = filled(1, 2, 4, 8, 1), k = filled(1, 2, 4, 8, 2), v = filled(1, 2, 4, 8, 3);
    attend::tensor<Eigen::half, 4> qh = q.cast<Eigen::half>(), kh = k.cast<Eigen::half>(), vh = v.cast<Eigen::half>();
    if (mpi_rank() == mpi_size() - 1) vh(0, 0, 1, 2) = Eigen::half(std::numeric_limits<float>::infinity());
    expect_same_error_everywhere<attend::value_error>(
        [&] { ad::ring_attention(qh, kh, vh, attend::causal(attend::alignment::top_left), layout, MPI_COMM_WORLD); },
        "attend.value.non_finite");
}

TEST(RingErrors, AnInvalidScaleIsAValueErrorOnEveryRank) {
    const auto layout = attend_test::even_layout(4);
    const auto q = filled(1, 2, 4, 8, 1), k = filled(1, 2, 4, 8, 2), v = filled(1, 2, 4, 8, 3);
    ad::ring_options o;
    o.attention.scale = -1.0;
    expect_same_error_everywhere<attend::value_error>([&] { ad::ring_attention(q, k, v, layout, MPI_COMM_WORLD, o); },
                                                      "attend.value.scale");
}

TEST(RingErrors, AMaskThatDoesNotFitTheWholeSequenceIsThrownOnEveryRankBeforeAnythingIsSent) {
    const auto layout = attend_test::even_layout(4);
    const auto q = filled(2, 2, 4, 8, 1), k = filled(2, 2, 4, 8, 2), v = filled(2, 2, 4, 8, 3);
    expect_same_error_everywhere<attend::mask_error>(
        [&] {
            ad::ring_attention(q, k, v, attend::key_padding({1, 2, 3}), layout, MPI_COMM_WORLD);
        },
        "attend.mask.lengths_batch");
}

TEST(RingErrors, AQueryWithNoKeyInTheWholeSequenceIsTheSingleProcessEmptyRowErrorOnEveryRank) {
    const index_t ranks = mpi_size(), total = 4 * ranks;
    attend::tensor<double, 4> q(2, 2, total, 8);
    attend_test::fill_uniform(q, 7);
    const auto mask = attend::key_padding({total, 0});  // sequence 1 has no key
    const std::string single = attend_test::expect_error<attend::mask_error>(
        [&] { attend::scaled_dot_product_attention(q, q, q, mask); }, "attend.mask.empty_row");
    const ad::shard_layout layout(ad::sharding::zigzag,
                                  ad::shard_layout::balanced_lengths(ad::sharding::zigzag, total, mpi_size()));
    const auto qs = ad::take_shard(q, layout, mpi_rank());
    ad::ring_options o;
    const std::string ring = attend_test::expect_error<attend::mask_error>(
        [&] { ad::ring_attention(qs, qs, qs, mask, layout, MPI_COMM_WORLD, o); }, "attend.mask.empty_row");
    EXPECT_EQ(ring, single);
}

TEST(RingErrors, BackwardInputsOfTheWrongShapeOnOneRankAreThrownOnEveryRank) {
    const auto layout = attend_test::even_layout(4);
    const auto q = filled(1, 2, 4, 8, 1), k = filled(1, 2, 4, 8, 2), v = filled(1, 2, 4, 8, 3);
    const auto fwd = ad::ring_attention(q, k, v, layout, MPI_COMM_WORLD);
    const auto d_out = filled(1, 2, 4, 8, 4);
    const auto bad = filled(1, 2, mpi_rank() == 1 ? 3 : 4, 8, 5);
    attend::tensor<double, 3> bad_lse(1, 2, mpi_rank() == 0 ? 5 : 4);
    bad_lse.setZero();
    expect_same_error_everywhere<attend::shape_error>(
        [&] { ad::ring_attention_backward(q, k, v, attend::no_mask{}, bad, fwd.lse, d_out, layout, MPI_COMM_WORLD); },
        "attend.shape.backward_out");
    expect_same_error_everywhere<attend::shape_error>(
        [&] { ad::ring_attention_backward(q, k, v, attend::no_mask{}, fwd.out, fwd.lse, bad, layout, MPI_COMM_WORLD); },
        "attend.shape.backward_d_out");
    expect_same_error_everywhere<attend::shape_error>(
        [&] {
            ad::ring_attention_backward(q, k, v, attend::no_mask{}, fwd.out, bad_lse, d_out, layout, MPI_COMM_WORLD);
        },
        "attend.shape.backward_lse");
}

TEST(RingErrors, ANonFiniteGradientInputOnOneRankIsThrownOnEveryRank) {
    const auto layout = attend_test::even_layout(4);
    const auto q = filled(1, 2, 4, 8, 1), k = filled(1, 2, 4, 8, 2), v = filled(1, 2, 4, 8, 3);
    const auto fwd = ad::ring_attention(q, k, v, layout, MPI_COMM_WORLD);
    auto d_out = filled(1, 2, 4, 8, 4);
    if (mpi_rank() == 0) d_out(0, 0, 1, 1) = std::numeric_limits<double>::infinity();
    expect_same_error_everywhere<attend::value_error>(
        [&] {
            ad::ring_attention_backward(q, k, v, attend::no_mask{}, fwd.out, fwd.lse, d_out, layout, MPI_COMM_WORLD);
        },
        "attend.value.non_finite");
}

}  // namespace
