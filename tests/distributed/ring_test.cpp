// SPDX-License-Identifier: MIT
// ring_attention and ring_attention_backward (distributed/ring.hpp) under mpirun (2 and 4 ranks): every rank's
// out, lse, dq, dk and dv equal its rows of single-process attention over the whole sequence, for every mask kind
// (none, causal, sliding window, key padding, their combinations, a dense mask), both layouts (contiguous,
// zigzag), ragged shard lengths (including empty shards), grouped-query attention, dropout, float and double.
// Every rank builds the same random problem from one seed, so each can compute the single-process reference.
//
// Tolerances: relative to the largest reference magnitude (at least 0.1, see relative_error), double 1e-12, float
// 1e-5 (the targets). The
// ring changes only the order of the lse merges and of the dK / dV sums: sequences stay <= 64 keys and values in
// [-1, 1), so reordering moves a result by a few tens of ulps.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

#include <gtest/gtest.h>

#include <attend/attend.hpp>
#include <attend/distributed/ring.hpp>

#include "distributed/ring_support.hpp"
#include "support/errors.hpp"
#include "support/random.hpp"
#include "support/storage16.hpp"

namespace {

using attend::index_t;
namespace ad = attend::distributed;
using attend_test::mpi_rank;
using attend_test::mpi_size;
using attend_test::relative_error;

enum class mask_kind { none, causal, sliding_window, key_padding, causal_and_key_padding, windowed_causal, dense };

const char* name_of(mask_kind m) {
    switch (m) {
        case mask_kind::none: return "none";
        case mask_kind::causal: return "causal";
        case mask_kind::sliding_window: return "sliding_window";
        case mask_kind::key_padding: return "key_padding";
        case mask_kind::causal_and_key_padding: return "causal && key_padding";
        case mask_kind::windowed_causal: return "sliding_window(w, 0)";
        case mask_kind::dense: return "dense";
    }
    return "?";
}

struct problem_config {
    std::uint64_t seed;
    mask_kind mask;
    ad::sharding layout;
    bool ragged;
    bool dropout;
};

std::string describe(const problem_config& c, const std::vector<index_t>& lengths) {
    std::string text = std::string("mask ") + name_of(c.mask) + ", layout " +
                       (c.layout == ad::sharding::zigzag ? "zigzag" : "contiguous") + ", dropout " +
                       (c.dropout ? "on" : "off") + ", seed " + std::to_string(c.seed) + ", shard lengths";
    for (index_t n : lengths) text += ' ' + std::to_string(n);
    return text;
}

/// Runs one configuration: single-process forward and backward on every rank, the ring on the shards, and the
/// comparison of this rank's rows.
template <class T, class Mask>
void expect_ring_equals_single_process(const problem_config& c, const Mask& mask, index_t total, index_t batch,
                                       index_t heads, index_t kv_heads, index_t head_dim, index_t value_dim,
                                       const std::vector<index_t>& lengths, double tolerance) {
    attend_test::rng g(c.seed);
    attend::tensor<T, 4> q(batch, heads, total, head_dim), k(batch, kv_heads, total, head_dim),
        v(batch, kv_heads, total, value_dim), d_out(batch, heads, total, value_dim);
    attend_test::fill_uniform(q, g.next());
    attend_test::fill_uniform(k, g.next());
    attend_test::fill_uniform(v, g.next());
    attend_test::fill_uniform(d_out, g.next());

    ad::ring_options ro;
    ro.attention.empty_rows = attend::empty_rows::zero;  // key padding may leave a sequence with no key at all
    if (c.dropout) ro.attention.dropout = {0.25, c.seed * 7 + 1, true};
    attend::sdpa_options so;
    so.need_lse = true;
    so.empty_rows = ro.attention.empty_rows;
    so.dropout = ro.attention.dropout;
    so.threads = 1;
    const auto whole = attend::scaled_dot_product_attention(q, k, v, mask, so);
    const auto whole_grad =
        attend::scaled_dot_product_attention_backward(q, k, v, mask, whole.out, whole.lse, d_out, so);

    const ad::shard_layout layout(c.layout, lengths);
    const int rank = mpi_rank();
    const auto shard = [&](const auto& x) { return ad::take_shard(x, layout, rank); };
    const auto qs = shard(q), ks = shard(k), vs = shard(v), ds = shard(d_out);
    const auto ring = ad::ring_attention(qs, ks, vs, mask, layout, MPI_COMM_WORLD, ro);
    const std::string where = describe(c, lengths) + ", rank " + std::to_string(rank);
    EXPECT_LE(relative_error(ring.out, shard(whole.out)), tolerance) << "out, " << where;
    EXPECT_LE(relative_error(ring.lse, ad::take_shard(whole.lse, layout, rank, ad::sequence_axis{2})), tolerance)
        << "lse, " << where;
    const auto grads =
        ad::ring_attention_backward(qs, ks, vs, mask, ring.out, ring.lse, ds, layout, MPI_COMM_WORLD, ro);
    EXPECT_LE(relative_error(grads.d_query, shard(whole_grad.d_query)), tolerance) << "dq, " << where;
    EXPECT_LE(relative_error(grads.d_key, shard(whole_grad.d_key)), tolerance) << "dk, " << where;
    EXPECT_LE(relative_error(grads.d_value, shard(whole_grad.d_value)), tolerance) << "dv, " << where;
}

template <class T>
void run_all_mask_kinds(double tolerance) {
    const int ranks = mpi_size();
    std::uint64_t seed = 1000;
    for (mask_kind m : {mask_kind::none, mask_kind::causal, mask_kind::sliding_window, mask_kind::key_padding,
                        mask_kind::causal_and_key_padding, mask_kind::windowed_causal, mask_kind::dense})
        for (ad::sharding layout : {ad::sharding::contiguous, ad::sharding::zigzag})
            for (bool ragged : {false, true})
                for (bool dropout : {false, true}) {
                    // Dropout on in half of the (layout, shard lengths) pairs of each mask kind, off in the other
                    // half: every mask kind and layout meets both, at half the run time of every combination.
                    if (dropout != ((static_cast<int>(m) + static_cast<int>(layout) + (ragged ? 1 : 0)) % 2 == 1))
                        continue;
                    const problem_config c{++seed, m, layout, ragged, dropout};
                    attend_test::rng g(c.seed);  // same draws on every rank
                    const index_t batch = 2, heads = 4, kv_heads = g.bernoulli(0.5) ? 2 : 4;
                    const index_t head_dim = g.uniform_int(3, 8), value_dim = g.uniform_int(2, 7);
                    std::vector<index_t> lengths;
                    for (int r = 0; r < ranks; ++r) lengths.push_back(ragged ? g.uniform_int(0, 13) : 9);
                    if (ragged) lengths[static_cast<std::size_t>(g.uniform_int(0, ranks - 1))] += 1;  // total >= 1
                    index_t total = 0;
                    for (index_t n : lengths) total += n;
                    const auto top_left = attend::alignment::top_left;
                    const index_t window = g.uniform_int(0, 8), right = g.uniform_int(0, 5);
                    const std::vector<index_t> padding{g.uniform_int(0, total), g.uniform_int(1, total)};
                    switch (m) {
                        case mask_kind::none:
                            expect_ring_equals_single_process<T>(c, attend::no_mask{}, total, batch, heads, kv_heads,
                                                                 head_dim, value_dim, lengths, tolerance);
                            break;
                        case mask_kind::causal:
                            expect_ring_equals_single_process<T>(c, attend::causal(top_left), total, batch, heads,
                                                                 kv_heads, head_dim, value_dim, lengths, tolerance);
                            break;
                        case mask_kind::sliding_window:
                            expect_ring_equals_single_process<T>(
                                c, attend::sliding_window(window, right, attend::alignment::top_left), total, batch,
                                heads, kv_heads, head_dim, value_dim, lengths, tolerance);
                            break;
                        case mask_kind::key_padding:
                            expect_ring_equals_single_process<T>(c, attend::key_padding(padding), total, batch, heads,
                                                                 kv_heads, head_dim, value_dim, lengths, tolerance);
                            break;
                        case mask_kind::causal_and_key_padding:
                            expect_ring_equals_single_process<T>(
                                c, attend::causal(top_left) && attend::key_padding(padding), total, batch, heads,
                                kv_heads, head_dim, value_dim, lengths, tolerance);
                            break;
                        case mask_kind::windowed_causal:
                            expect_ring_equals_single_process<T>(
                                c, attend::sliding_window(window, 0, attend::alignment::top_left), total, batch, heads,
                                kv_heads, head_dim, value_dim, lengths, tolerance);
                            break;
                        case mask_kind::dense: {
                            attend::tensor<bool, 4> allowed(batch, 1, total, total);
                            for (index_t e = 0; e < allowed.size(); ++e) allowed.data()[e] = g.bernoulli(0.7);
                            expect_ring_equals_single_process<T>(c, attend::allowed_mask::true_means_allowed(allowed),
                                                                 total, batch, heads, kv_heads, head_dim, value_dim,
                                                                 lengths, tolerance);
                            break;
                        }
                    }
                }
}

TEST(RingAttention, ForwardAndBackwardEqualSingleProcessAttentionInDoubleForEveryMaskLayoutAndShardLengths) {
    run_all_mask_kinds<double>(1e-12);
}

TEST(RingAttention, ForwardAndBackwardEqualSingleProcessAttentionInFloatForEveryMaskLayoutAndShardLengths) {
    run_all_mask_kinds<float>(1e-5);
}

/// A `[batch, heads, len, dim]` tensor of uniform values from `seed`, the same on every rank.
attend::tensor<double, 4> uniform(index_t batch, index_t heads, index_t len, index_t dim, std::uint64_t seed) {
    attend::tensor<double, 4> t(batch, heads, len, dim);
    attend_test::fill_uniform(t, seed);
    return t;
}

/// The ring's forward and backward over zigzag shards of q, k, v, d_out `[batch, heads, total, dim]` equal one
/// process's call with the same options to 1e-12, d_sinks included when there are sinks.
template <class Mask>
void expect_zigzag_ring_equals_one_call(const attend::tensor<double, 4>& q, const attend::tensor<double, 4>& k,
                                        const attend::tensor<double, 4>& v, const attend::tensor<double, 4>& d_out,
                                        const Mask& mask, const attend::sdpa_options& so) {
    const int rank = mpi_rank();
    const auto whole = attend::scaled_dot_product_attention(q, k, v, mask, so);
    const auto whole_grad =
        attend::scaled_dot_product_attention_backward(q, k, v, mask, whole.out, whole.lse, d_out, so);
    const index_t total = q.dimension(2);
    const ad::shard_layout layout(ad::sharding::zigzag,
                                  ad::shard_layout::balanced_lengths(ad::sharding::zigzag, total, mpi_size()));
    const auto shard = [&](const auto& x) { return ad::take_shard(x, layout, rank); };
    ad::ring_options ro;
    ro.attention = so;
    const auto ring = ad::ring_attention(shard(q), shard(k), shard(v), mask, layout, MPI_COMM_WORLD, ro);
    const auto grads = ad::ring_attention_backward(shard(q), shard(k), shard(v), mask, ring.out, ring.lse, shard(d_out),
                                                   layout, MPI_COMM_WORLD, ro);
    EXPECT_LE(relative_error(ring.out, shard(whole.out)), 1e-12);
    EXPECT_LE(relative_error(ring.lse, ad::take_shard(whole.lse, layout, rank, ad::sequence_axis{2})), 1e-12);
    EXPECT_LE(relative_error(grads.d_query, shard(whole_grad.d_query)), 1e-12);
    EXPECT_LE(relative_error(grads.d_key, shard(whole_grad.d_key)), 1e-12);
    EXPECT_LE(relative_error(grads.d_value, shard(whole_grad.d_value)), 1e-12);
    ASSERT_EQ(grads.d_sinks.size(), whole_grad.d_sinks.size());
    if (grads.d_sinks.size() == 0) return;
    EXPECT_LE(relative_error(grads.d_sinks, whole_grad.d_sinks), 1e-12);
    EXPECT_GT(attend_test::max_abs_diff(grads.d_sinks, attend::tensor<double, 1>(grads.d_sinks.size()).setZero()),
              1e-3);
    EXPECT_TRUE(
        attend_test::same_on_every_rank(std::string(reinterpret_cast<const char*>(grads.d_sinks.data()),
                                                    sizeof(double) * static_cast<std::size_t>(grads.d_sinks.size()))));
}

TEST(RingAttention, ShardsLargeEnoughToComputeWhileTransfersProgressEqualSingleProcessAttention) {
    // 256 positions per rank, 2 heads, head_dim 16: each step (256 * 256 * 2 * 32 multiply-adds) reaches the size
    // at which the ring computes on a worker thread while the calling thread polls MPI (the small problems above
    // compute inline).
    const index_t total = 256 * mpi_size();
    const auto q = uniform(1, 2, total, 16, 61), k = uniform(1, 2, total, 16, 62), v = uniform(1, 2, total, 16, 63),
               d_out = uniform(1, 2, total, 16, 64);
    attend::sdpa_options so;
    so.need_lse = true;
    so.threads = 1;
    so.dropout = {0.1, 65, true};
    expect_zigzag_ring_equals_one_call(q, k, v, d_out, attend::causal(attend::alignment::top_left), so);
}

/// Every sdpa_options score feature in the ring equals one process's call: scores shaped at global positions
/// (a position-dependent score_mod, ALiBi or a T5 table, softcap), sinks joined once per row, forward and backward
/// (d_sinks the same on every rank), zigzag shards, grouped-query heads and padding that leaves rows empty.
TEST(RingAttention, EveryScoreFeatureOfSdpaGivesTheSingleProcessResult) {
    const index_t total = 7 * mpi_size();
    const auto q = uniform(2, 4, total, 8, 71), k = uniform(2, 2, total, 8, 72), v = uniform(2, 2, total, 6, 73),
               d_out = uniform(2, 4, total, 6, 74);
    // Sequence 1's last queries see no key: key padding and a window ahead of the diagonal.
    const auto mask = attend::causal(attend::alignment::top_left) && attend::key_padding({total, total - 3}) &&
                      attend::query_padding({total, total - 1});
    const attend::relative_position_bias<double> table(4, false, 8, 16, 75);
    for (int feature = 0; feature < 3; ++feature) {
        SCOPED_TRACE("feature " + std::to_string(feature));
        attend::sdpa_options so;
        so.threads = 1;
        so.empty_rows = attend::empty_rows::zero;
        so.sinks = attend::attention_sinks{0.5, -1.0, 2.0, 0.25};
        so.softcap = 3.0;
        if (feature == 0)  // distances to global positions: a block at the wrong offset changes them
            so.score_mod = attend::score_mod([](auto s, auto, auto h, auto i,
                                                auto j) { return s + decltype(s)(0.01 * (h + 1) * (i - 2 * j)); },
                                             [](auto, auto, auto, auto, auto) { return 1.0; });
        if (feature == 1)
            so.score_bias = attend::score_bias::alibi(attend::alibi_slopes(4), attend::alignment::top_left);
        if (feature == 2) so.score_bias = attend::score_bias::relative(table, attend::alignment::bottom_right);
        expect_zigzag_ring_equals_one_call(q, k, v, d_out, mask, so);
    }
}

/// Rank-3 inputs `[batch, len, dim]` (one head) give what one rank-3 call gives, results of rank 3 and 2, with a
/// rank-3 dense mask `[batch, total, total]` broadcast as that call broadcasts it.
TEST(RingAttention, RankThreeInputsGiveTheSingleProcessRankThreeResult) {
    const int rank = mpi_rank(), ranks = mpi_size();
    const index_t total = 6 * ranks;
    attend::tensor<double, 3> q(2, total, 8), k(2, total, 8), v(2, total, 5), d_out(2, total, 5);
    attend_test::fill_uniform(q, 91);
    attend_test::fill_uniform(k, 92);
    attend_test::fill_uniform(v, 93);
    attend_test::fill_uniform(d_out, 94);
    attend::tensor<bool, 3> allowed(2, total, total);
    attend_test::rng g(95);
    for (index_t n = 0; n < allowed.size(); ++n) allowed.data()[n] = g.uniform_int(0, 3) != 0;
    for (index_t b = 0; b < 2; ++b)
        for (index_t i = 0; i < total; ++i) allowed(b, i, i) = true;
    const auto mask = attend::allowed_mask::from_torch_sdpa(allowed);
    attend::sdpa_options so;
    so.threads = 1;
    so.softcap = 4.0;
    const auto whole = attend::scaled_dot_product_attention(q, k, v, mask, so);
    const auto whole_grad =
        attend::scaled_dot_product_attention_backward(q, k, v, mask, whole.out, whole.lse, d_out, so);
    const ad::shard_layout layout(ad::sharding::zigzag,
                                  ad::shard_layout::balanced_lengths(ad::sharding::zigzag, total, ranks));
    const auto shard = [&](const auto& x) { return ad::take_shard(x, layout, rank, ad::sequence_axis{1}); };
    ad::ring_options ro;
    ro.attention = so;
    const auto ring = ad::ring_attention(shard(q), shard(k), shard(v), mask, layout, MPI_COMM_WORLD, ro);
    static_assert(std::is_same_v<decltype(ring.out), attend::tensor<double, 3>> &&
                  std::is_same_v<decltype(ring.lse), attend::tensor<double, 2>>);
    const auto grads = ad::ring_attention_backward(shard(q), shard(k), shard(v), mask, ring.out, ring.lse, shard(d_out),
                                                   layout, MPI_COMM_WORLD, ro);
    EXPECT_LE(relative_error(ring.out, shard(whole.out)), 1e-12);
    EXPECT_LE(relative_error(ring.lse, ad::take_shard(whole.lse, layout, rank)), 1e-12);
    EXPECT_LE(relative_error(grads.d_query, shard(whole_grad.d_query)), 1e-12);
    EXPECT_LE(relative_error(grads.d_key, shard(whole_grad.d_key)), 1e-12);
    EXPECT_LE(relative_error(grads.d_value, shard(whole_grad.d_value)), 1e-12);
}

/// With sinks, a row with no allowed key is still the single-process empty-row error, forward and backward.
TEST(RingAttention, SinksDoNotHideARowWithNoKey) {
    const int rank = mpi_rank();
    const index_t total = 4 * mpi_size();
    attend::tensor<double, 4> q(2, 2, total, 8);
    attend_test::fill_uniform(q, 81);
    const auto layout = attend_test::even_layout(4);
    const auto qs = ad::take_shard(q, layout, rank);
    const auto mask = attend::key_padding({total, 0});  // sequence 1 has no key
    ad::ring_options ro;
    ro.attention.sinks = attend::attention_sinks{0.5, 1.0};
    attend_test::expect_error<attend::mask_error>(
        [&] { ad::ring_attention(qs, qs, qs, mask, layout, MPI_COMM_WORLD, ro); }, "attend.mask.empty_row");
    ro.attention.empty_rows = attend::empty_rows::zero;
    const auto zero = ad::ring_attention(qs, qs, qs, mask, layout, MPI_COMM_WORLD, ro);
    EXPECT_EQ(zero.lse(1, 1, 0), 1.0);  // a zero row's lse is its sink, as in one call
    ro.attention.empty_rows = attend::empty_rows::error;
    attend_test::expect_error<attend::mask_error>(
        [&] { ad::ring_attention_backward(qs, qs, qs, mask, zero.out, zero.lse, qs, layout, MPI_COMM_WORLD, ro); },
        "attend.mask.empty_row");
}

TEST(RingAttention, ResultsAreBitIdenticalWhateverTheTimingOfTheRanks) {
    const int rank = mpi_rank();
    const index_t total = 12 * mpi_size();
    attend::tensor<double, 4> q(1, 2, total, 8), k(1, 2, total, 8), v(1, 2, total, 8);
    attend_test::fill_uniform(q, 41);
    attend_test::fill_uniform(k, 42);
    attend_test::fill_uniform(v, 43);
    const ad::shard_layout layout(ad::sharding::zigzag,
                                  ad::shard_layout::balanced_lengths(ad::sharding::zigzag, total, mpi_size()));
    ad::ring_options o;
    const auto qs = ad::take_shard(q, layout, rank), ks = ad::take_shard(k, layout, rank),
               vs = ad::take_shard(v, layout, rank);
    const auto mask = attend::causal(attend::alignment::top_left);
    const auto first = ad::ring_attention(qs, ks, vs, mask, layout, MPI_COMM_WORLD, o);
    // Delay a different rank each time so messages arrive in another order relative to the computation.
    for (int slow = 0; slow < mpi_size(); ++slow) {
        if (rank == slow) std::this_thread::sleep_for(std::chrono::milliseconds(30));
        const auto again = ad::ring_attention(qs, ks, vs, mask, layout, MPI_COMM_WORLD, o);
        EXPECT_TRUE(std::equal(first.out.data(), first.out.data() + first.out.size(), again.out.data()));
        EXPECT_TRUE(std::equal(first.lse.data(), first.lse.data() + first.lse.size(), again.lse.data()));
    }
}

TEST(RingAttention, ThreadsDefaultToThisRanksShareOfTheNodesLogicalCpusAndGiveTheSameBits) {
    // Every rank of these tests runs on one machine: the default is its logical CPUs over the ranks, at least 1.
    const int rank = mpi_rank(), share = std::max(1, attend::detail::hardware_threads() / mpi_size());
    const index_t total = 8 * mpi_size();
    attend::tensor<double, 4> q(1, 2, total, 8), k(1, 2, total, 8), v(1, 2, total, 8), d_out(1, 2, total, 8);
    attend_test::fill_uniform(q, 51);
    attend_test::fill_uniform(k, 52);
    attend_test::fill_uniform(v, 53);
    attend_test::fill_uniform(d_out, 54);
    const ad::shard_layout layout(ad::sharding::contiguous,
                                  std::vector<index_t>(static_cast<std::size_t>(mpi_size()), 8));
    const auto qs = ad::take_shard(q, layout, rank), ks = ad::take_shard(k, layout, rank),
               vs = ad::take_shard(v, layout, rank), ds = ad::take_shard(d_out, layout, rank);
    const auto mask = attend::causal(attend::alignment::top_left);
    const auto by_default = ad::ring_attention(qs, ks, vs, mask, layout, MPI_COMM_WORLD);
    EXPECT_EQ(by_default.statistics.threads, share);
    ad::ring_options three;
    three.attention.threads = 3;
    const auto with_three = ad::ring_attention(qs, ks, vs, mask, layout, MPI_COMM_WORLD, three);
    EXPECT_EQ(with_three.statistics.threads, 3);
    EXPECT_TRUE(
        std::equal(by_default.out.data(), by_default.out.data() + by_default.out.size(), with_three.out.data()));
    const auto grads =
        ad::ring_attention_backward(qs, ks, vs, mask, by_default.out, by_default.lse, ds, layout, MPI_COMM_WORLD);
    EXPECT_EQ(grads.statistics.threads, share);
}

TEST(RingAttention, AShardTheMaskHidesFromEveryLaterRankIsNeitherSentNorComputed) {
    const int rank = mpi_rank(), ranks = mpi_size();
    const index_t shard_len = 10, total = shard_len * ranks;
    attend::tensor<float, 4> q(1, 1, total, 4);
    attend_test::fill_uniform(q, 51);
    const ad::shard_layout layout(ad::sharding::contiguous,
                                  std::vector<index_t>(static_cast<std::size_t>(ranks), shard_len));
    const auto qs = ad::take_shard(q, layout, rank);
    // A window of 3 keys back: rank r needs only its own shard and the end of rank r - 1's.
    const auto windowed = ad::ring_attention(qs, qs, qs, attend::sliding_window(3, 0, attend::alignment::top_left),
                                             layout, MPI_COMM_WORLD);
    EXPECT_EQ(windowed.statistics.shards_sent, rank + 1 < ranks ? 1 : 0);
    EXPECT_EQ(windowed.statistics.blocks_computed, rank > 0 ? 2 : 1);
    EXPECT_EQ(windowed.statistics.bytes_sent, rank + 1 < ranks ? 2 * shard_len * 4 * index_t(sizeof(float)) : 0);
    // Causal: shard s goes only to ranks s + 1 .. N - 1, so rank r < N - 1 passes on shards 0 .. r and the last
    // rank sends nothing (without the mask every rank would send N - 1 shards).
    const auto causal =
        ad::ring_attention(qs, qs, qs, attend::causal(attend::alignment::top_left), layout, MPI_COMM_WORLD);
    EXPECT_EQ(causal.statistics.shards_sent, rank + 1 < ranks ? rank + 1 : 0);
    EXPECT_EQ(causal.statistics.blocks_computed, rank + 1);
    // Without a mask every shard visits every rank.
    const auto full = ad::ring_attention(qs, qs, qs, layout, MPI_COMM_WORLD);
    EXPECT_EQ(full.statistics.shards_sent, ranks - 1);
    EXPECT_EQ(full.statistics.blocks_computed, ranks);
}

/// 16-bit shards: the ring of float on the same (widened) values, rounded once; with float queries, not rounded.
/// `dense` picks a dense mask (ragged shards, contiguous layout, no dropout) instead of causal and padding (zigzag,
/// dropout, grouped query).
template <class T>
void expect_16bit_ring_is_the_float_ring_rounded_once(std::uint64_t seed, bool dense) {
    const int rank = mpi_rank(), ranks = mpi_size();
    attend_test::rng g(seed);  // same draws on every rank
    std::vector<index_t> lengths;
    for (int r = 0; r < ranks; ++r) lengths.push_back(dense ? g.uniform_int(0, 11) : 8);
    lengths[0] += 1;
    index_t total = 0;
    for (index_t n : lengths) total += n;
    const index_t batch = 2, heads = 4, kv_heads = dense ? 4 : 2, head_dim = 6, value_dim = 5;
    const auto q = attend_test::random16<T>(g.next(), batch, heads, total, head_dim);
    const auto k = attend_test::random16<T>(g.next(), batch, kv_heads, total, head_dim);
    const auto v = attend_test::random16<T>(g.next(), batch, kv_heads, total, value_dim);
    const auto d_out = attend_test::random16<T>(g.next(), batch, heads, total, value_dim);
    ad::ring_options ro;
    ro.attention.empty_rows = attend::empty_rows::zero;
    if (!dense) ro.attention.dropout = {0.2, seed, true};
    const ad::shard_layout layout(dense ? ad::sharding::contiguous : ad::sharding::zigzag, lengths);
    const auto shard = [&](const auto& x) { return ad::take_shard(x, layout, rank); };
    const auto widened = [&](const auto& x) { return attend::tensor<float, 4>(shard(x).template cast<float>()); };
    const auto check = [&](const auto& mask) {
        const auto ring = ad::ring_attention(shard(q), shard(k), shard(v), mask, layout, MPI_COMM_WORLD, ro);
        const auto ring_f = ad::ring_attention(widened(q), widened(k), widened(v), mask, layout, MPI_COMM_WORLD, ro);
        const attend::tensor<T, 4> rounded = ring_f.out.template cast<T>();
        EXPECT_TRUE(attend_test::bit_equal(ring.out, rounded)) << "out, rank " << rank;
        EXPECT_TRUE(attend_test::bit_equal(ring.lse, ring_f.lse)) << "lse (float), rank " << rank;
        // The shards travel in 16 bits: half the bytes of the float ring's, the same shards.
        EXPECT_EQ(ring.statistics.shards_sent, ring_f.statistics.shards_sent);
        EXPECT_EQ(2 * ring.statistics.bytes_sent, ring_f.statistics.bytes_sent);
        // Float queries over the same 16-bit shards: the float ring on the widened keys and values, bit for bit,
        // with the shards still travelling in 16 bits.
        const auto mixed = ad::ring_attention(widened(q), shard(k), shard(v), mask, layout, MPI_COMM_WORLD, ro);
        EXPECT_TRUE(attend_test::bit_equal(mixed.out, ring_f.out)) << "out, float q, rank " << rank;
        EXPECT_TRUE(attend_test::bit_equal(mixed.lse, ring_f.lse)) << "lse, float q, rank " << rank;
        EXPECT_EQ(mixed.statistics.bytes_sent, ring.statistics.bytes_sent);

        // Against one process in float on the same values: the float ring's summation order (1e-5, as the float
        // test above) plus the one rounding to T (half a unit: at most 2^-8 of the value for bf16, 2^-11 for fp16).
        attend::sdpa_options so;
        so.empty_rows = ro.attention.empty_rows;
        so.dropout = ro.attention.dropout;
        const attend::tensor<float, 4> qf = q.template cast<float>(), kf = k.template cast<float>(),
                                       vf = v.template cast<float>();
        const auto whole = attend::scaled_dot_product_attention(qf, kf, vf, mask, so);
        const double half_unit = std::is_same_v<T, Eigen::bfloat16> ? 0x1p-8 : 0x1p-11;
        EXPECT_LE(relative_error(attend::tensor<float, 4>(ring.out.template cast<float>()), shard(whole.out)),
                  half_unit + 1e-5)
            << "out against one process, rank " << rank;

        const auto grads = ad::ring_attention_backward(shard(q), shard(k), shard(v), mask, ring.out, ring.lse,
                                                       shard(d_out), layout, MPI_COMM_WORLD, ro);
        const auto grads_float = ad::ring_attention_backward<float>(shard(q), shard(k), shard(v), mask, ring.out,
                                                                    ring.lse, shard(d_out), layout, MPI_COMM_WORLD, ro);
        const attend::tensor<float, 4> out_f = ring.out.template cast<float>();
        const auto grads_f = ad::ring_attention_backward(widened(q), widened(k), widened(v), mask, out_f, ring.lse,
                                                         widened(d_out), layout, MPI_COMM_WORLD, ro);
        for (const auto& [got, got_float, want, name] :
             {std::tuple{&grads.d_query, &grads_float.d_query, &grads_f.d_query, "dq"},
              std::tuple{&grads.d_key, &grads_float.d_key, &grads_f.d_key, "dk"},
              std::tuple{&grads.d_value, &grads_float.d_value, &grads_f.d_value, "dv"}}) {
            const attend::tensor<T, 4> want_rounded = want->template cast<T>();
            EXPECT_TRUE(attend_test::bit_equal(*got, want_rounded)) << name << ", rank " << rank;
            EXPECT_TRUE(attend_test::bit_equal(*got_float, *want)) << name << " in float, rank " << rank;
        }
    };
    if (dense) {
        attend::tensor<bool, 4> allowed(batch, 1, total, total);
        for (index_t e = 0; e < allowed.size(); ++e) allowed.data()[e] = g.bernoulli(0.7);
        check(attend::allowed_mask::true_means_allowed(allowed));
    } else {
        check(attend::causal(attend::alignment::top_left) && attend::key_padding({total - 3, total}));
    }
}

TEST(RingAttention,
     SixteenBitShardsTravelInSixteenBitsAndGiveTheFloatRingOnTheirValuesRoundedOnceOrUnroundedForFloatQueries) {
    for (const bool dense : {false, true}) {
        expect_16bit_ring_is_the_float_ring_rounded_once<Eigen::half>(dense ? 91 : 92, dense);
        expect_16bit_ring_is_the_float_ring_rounded_once<Eigen::bfloat16>(dense ? 93 : 94, dense);
    }
}

}  // namespace
