// SPDX-License-Identifier: MIT
// Tests of attend/paged_cache.hpp and attend/paged_attention.hpp: serving sessions of random joins, leaves,
// forks, rollbacks, reorders and ragged appends, each checked against every sequence decoded alone in a plain
// kv_cache (bit for bit); rolling windows against full attention with a sliding window; forks that copy block
// numbers, not keys; and every error, which leaves the cache exactly as it was.
#include <attend/attend.hpp>
#include <attend/paged_attention.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include "support/compare.hpp"
#include "support/errors.hpp"
#include "support/paged_model.hpp"
#include "support/random.hpp"

namespace {

using attend::index_t;
using attend::tensor;
using attend_test::expect_error;
using attend_test::state_of;

/// An rng as the session's chooser.
struct rng_choice {
    attend_test::rng* g;
    index_t operator()(index_t lo, index_t hi) const { return g->uniform_int(lo, hi); }
};

/// A session's problems as gtest failures.
struct gtest_failure {
    void operator()(const std::string& what) const { ADD_FAILURE() << what; }
};

template <class T, class Stored = T>
using session = attend_test::paged_session<T, rng_choice, gtest_failure, Stored>;

/// `steps` random operations, the model checked after each; returns what the session did.
template <class T, class Stored = T>
typename session<T, Stored>::tally run_session(const typename session<T, Stored>::sizes& z,
                                               const attend::sdpa_options& o, std::uint64_t seed, int steps) {
    attend_test::rng g(seed);
    session<T, Stored> s(z, o, rng_choice{&g}, gtest_failure{}, seed + 1000);
    for (int n = 0; n < steps && !s.failed(); ++n) {
        s.step();
        s.check_model();
    }
    return s.done();
}

TEST(PagedCache, RaggedSessionsAreBitIdenticalToEachSequenceDecodedAloneInAPlainCache) {
    for (index_t block_size : {1, 4, 16, 64}) {
        SCOPED_TRACE("block_size " + std::to_string(block_size));
        session<double>::sizes z;
        z.block_size = block_size;
        z.blocks = 1000 / block_size + 8;
        z.prefill = 250;
        attend::sdpa_options o;
        o.threads = 2;
        const int steps = attend_test::repeat(250);
        const auto done = run_session<double>(z, o, 7 + static_cast<std::uint64_t>(block_size), steps);
        // The session reached what it is about: forks that later copied a shared block, rollbacks, reorders, a
        // full pool or full slots refused, and sequences longer than one key tile (256 keys in double). A shortened
        // run (the sanitizer pass scales repeats down) checks every step alike but need not reach them all.
        if (steps < 250) continue;
        EXPECT_GT(done.attended_rows, 300);
        EXPECT_GT(done.forks, 3);
        if (block_size > 1) {  // a block of one position is never partly filled
            EXPECT_GT(done.copies_on_write, 0);
        }
        EXPECT_GT(done.truncations, 3);
        EXPECT_GT(done.reorders, 3);
        EXPECT_GT(done.refusals, 0);
        EXPECT_GT(done.longest, 256);
    }
}

TEST(PagedCache, FloatSessionsWithSoftcapSinksAndOneThreadAreBitIdenticalToo) {
    session<float>::sizes z;
    z.block_size = 8;
    z.blocks = 64;
    z.heads = 6;
    z.kv_heads = 3;
    z.head_dim = 16;
    attend::sdpa_options o;
    o.threads = 1;
    o.softcap = 3.0;
    o.sinks = attend::attention_sinks{0.5, -1.0, 2.0, 0.0, 1.5, -0.25};
    const int steps = attend_test::repeat(100);
    const auto done = run_session<float>(z, o, 11, steps);
    if (steps < 100) return;  // a shortened run need not reach every case
    EXPECT_GT(done.attended_rows, 200);
    EXPECT_GT(done.copies_on_write, 0);
}

TEST(PagedCache, RollingWindowSessionsEqualFullAttentionWithASlidingWindowOverTheWholeHistory) {
    for (index_t block_size : {4, 16}) {
        SCOPED_TRACE("block_size " + std::to_string(block_size));
        session<double>::sizes z;
        z.block_size = block_size;
        z.window = 23;
        // Few blocks: the window has to hand blocks back for the sessions to go on.
        z.blocks = 400 / block_size + 4;
        z.prefill = 120;
        z.history = 2048;
        attend::sdpa_options o;
        o.threads = 2;
        const int steps = attend_test::repeat(200);
        const auto done = run_session<double>(z, o, 23 + static_cast<std::uint64_t>(block_size), steps);
        if (steps < 200) continue;  // a shortened run need not reach every case
        EXPECT_GT(done.dropped_blocks, 20);
        EXPECT_GT(done.longest, 300);
        EXPECT_GT(done.attended_rows, 300);
    }
}

/// A cache with one sequence of `length` random positions (float ones for a quantized pool); returns its id.
template <class T>
index_t fill_sequence(attend::paged_kv_cache<T>& c, index_t length, std::uint64_t seed) {
    using In = std::conditional_t<attend::detail::is_quantized_block_v<T>, float, T>;
    const index_t id = c.add_sequence();
    tensor<In, 4> k(1, c.kv_heads(), length, c.head_dim()), v(1, c.kv_heads(), length, c.value_dim());
    attend_test::fill_uniform(k, seed);
    attend_test::fill_uniform(v, seed + 1);
    c.append(id, k, v);
    return id;
}

TEST(PagedCache, LongSequencesTakeTheSplitKeyDecodePathAndStayBitIdentical) {
    // Past 2048 keys (float, head_dim < 128) one query is split into key chunks. The sequence's blocks either
    // follow each other in the pool (read in place as one stream) or alternate with another sequence's (every
    // GEMV slice that crosses a block edge goes through the scratch copy); block sizes that do and do not divide
    // the GEMV slices.
    tensor<float, 4> k(1, 2, 2600, 32), v(1, 2, 2600, 32), q(1, 8, 1, 32);
    attend_test::fill_uniform(k, 5);
    attend_test::fill_uniform(v, 6);
    attend_test::fill_uniform(q, 9);
    attend::kv_cache<float> plain(attend::kv_cache_config{}.with_kv_heads(2).with_capacity(2600).with_head_dim(32));
    plain.append(k, v);
    for (index_t block_size : {16, 64, 48})
        for (bool interleaved : {false, true}) {
            attend::paged_kv_cache<float> c(attend_test::paged_config(2, 32, block_size, 6000 / block_size + 4, 2));
            const index_t id = c.add_sequence(), other = c.add_sequence();
            for (index_t at = 0; at < 2600; at += block_size) {
                const index_t n = std::min<index_t>(block_size, 2600 - at);
                const std::array<index_t, 4> from{0, 0, at, 0}, rows{1, 2, n, 32};
                const tensor<float, 4> kn = k.slice(from, rows), vn = v.slice(from, rows);
                c.append(id, kn, vn);
                if (interleaved) c.append(other, kn, vn);  // takes the next block, so id's blocks do not follow
            }
            for (int threads : {1, 2}) {
                attend::sdpa_options o;
                o.threads = threads;
                const auto paged = attend::paged_attention(q, c, {id}, {1}, o);
                const auto alone = attend::scaled_dot_product_attention(
                    q, plain.keys(), plain.values(), attend::causal(attend::alignment::bottom_right), o);
                EXPECT_TRUE(attend_test::bit_equal(paged.out, alone.out))
                    << "block_size " << block_size << (interleaved ? ", interleaved" : "");
                EXPECT_TRUE(attend_test::bit_equal(paged.lse, alone.lse)) << "block_size " << block_size;
            }
        }
}

TEST(PagedCache, CheckFiniteChangesNoBitOfAPagedDecode) {
    // With check_finite on, each sequence's scan of its keys and values rides on its decode pass (one chunk, or
    // split keys past 1024 keys at head_dim 128); off, there is no scan. Ragged lengths in one call.
    attend::paged_kv_cache<float> c(attend_test::paged_config(2, 128, 16, 200, 3));
    const std::vector<index_t> ids{fill_sequence(c, 5, 1), fill_sequence(c, 300, 3), fill_sequence(c, 2600, 5)};
    tensor<float, 4> q(3, 8, 1, 128);
    attend_test::fill_uniform(q, 9);
    for (const int threads : {1, 2}) {
        attend::sdpa_options checked, unchecked;
        checked.threads = unchecked.threads = threads;
        unchecked.check_finite = false;
        const auto with_scan = attend::paged_attention(q, c, ids, {1, 1, 1}, checked);
        const auto without = attend::paged_attention(q, c, ids, {1, 1, 1}, unchecked);
        EXPECT_TRUE(attend_test::bit_equal(with_scan.out, without.out)) << threads << " threads";
        EXPECT_TRUE(attend_test::bit_equal(with_scan.lse, without.lse)) << threads << " threads";
    }
}

TEST(PagedCache, TheReferenceKernelReadsTheBlocksToo) {
    const auto cfg = attend_test::paged_config(1, 8, 3, 20);
    attend::paged_kv_cache<double> c(cfg);
    const index_t id = fill_sequence(c, 40, 3);
    tensor<double, 4> q(1, 2, 4, 8);
    attend_test::fill_uniform(q, 4);
    attend::sdpa_options tiled, reference;
    reference.kernel = attend::kernel::reference;
    const auto a = attend::paged_attention(q, c, {id}, {4}, tiled);
    const auto b = attend::paged_attention(q, c, {id}, {4}, reference);
    EXPECT_LT(attend_test::max_abs_diff(a.out, b.out), 1e-14);
    EXPECT_LT(attend_test::max_abs_diff(a.lse, b.lse), 1e-14);
}

// The kernels read a paged sequence's rows in runs that follow each other in the pool (rows_following): a run ends
// exactly where the next block of the table is not the next block of the pool, and each row of the run the row
// kernels' prefetch runs on into (run_of_rows) is at the address the view gives that row.
TEST(PagedCache, RowRunsEndWhereTheBlocksStopFollowingAndHoldTheViewsRows) {
    const index_t block_size = 4, heads = 2, dim = 8, pool_blocks = 9;
    const std::vector<index_t> table = {3, 4, 5, 0, 7, 8, 1, 2};
    std::vector<float> pool(static_cast<std::size_t>(heads * pool_blocks * block_size * dim));
    attend::detail::paged_view<float> view;
    view.pool = pool.data();
    view.table = table.data();
    view.dims = {1, heads, static_cast<index_t>(table.size()) * block_size, dim};
    view.block_size = block_size;
    view.pool_blocks = pool_blocks;
    const index_t len = view.dims[2];
    for (index_t h = 0; h < heads; ++h)
        for (index_t i = 0; i < len; ++i)
            for (index_t n = 1; i + n <= len; ++n) {
                index_t following = 1;  // rows after i whose address is one row further on
                while (following < n && view.row(0, h, i + following) == view.row(0, h, i + following - 1) + dim)
                    ++following;
                ASSERT_EQ(attend::detail::rows_following(view, i, n), following) << i << ", " << n;
                EXPECT_EQ(attend::detail::rows_contiguous(view, i, n), following == n);
                const attend::detail::row_run run = attend::detail::run_of_rows(view, 0, h, i, n);
                ASSERT_EQ(run.rows, std::min<index_t>(following, attend::detail::row_run::most));
                for (index_t m = 0; m < run.rows; ++m)
                    ASSERT_EQ(run.first + m * run.stride, reinterpret_cast<const char*>(view.row(0, h, i + m)));
            }
    EXPECT_EQ(attend::detail::run_of_rows(view, 0, 0, 3, 0).rows, 0);
}

TEST(PagedCache, AForkCopiesBlockNumbersNotKeysAndAWriteCopiesOnlyTheSharedTailBlock) {
    const auto cfg = attend_test::paged_config(2, 4, 8, 40, 4);
    attend::paged_kv_cache<float> c(cfg);
    const index_t parent = fill_sequence(c, 8 * 25 + 3, 1);  // 25 full blocks and 3 positions of a 26th
    const index_t free_before = c.free_blocks();
    const auto before = state_of(c);
    const index_t child = c.fork(parent);
    // No block taken, no key copied: the child's table is the parent's and every row is the same memory.
    EXPECT_EQ(c.free_blocks(), free_before);
    EXPECT_EQ(c.block_table(child), c.block_table(parent));
    for (index_t p = 0; p < c.length(parent); ++p) EXPECT_EQ(c.key_row(child, 1, p), c.key_row(parent, 1, p));
    for (index_t b : c.block_table(parent)) EXPECT_EQ(c.references(b), 2);
    // The child appends into the shared, partly filled last block: that one block is copied, nothing else.
    tensor<float, 4> k(1, 2, 1, 4), v(1, 2, 1, 4);
    k.setConstant(0.5f);
    v.setConstant(-0.5f);
    c.append(child, k, v);
    EXPECT_EQ(c.free_blocks(), free_before - 1);
    const auto& pt = c.block_table(parent);
    const auto& ct = c.block_table(child);
    for (std::size_t n = 0; n + 1 < pt.size(); ++n) EXPECT_EQ(pt[n], ct[n]);
    EXPECT_NE(pt.back(), ct.back());
    EXPECT_EQ(c.references(pt.back()), 1);
    for (index_t p = 0; p < c.length(parent); ++p) EXPECT_EQ(c.key_row(child, 0, p)[2], c.key_row(parent, 0, p)[2]);
    // The parent is untouched, and removing the child hands back exactly its private block.
    c.remove_sequence(child);
    EXPECT_TRUE(state_of(c) == before);
    EXPECT_EQ(attend_test::consistency_problem(c), "");
}

TEST(PagedCache, TheRollingWindowCountsKeysBeforeTheQueryAsSlidingWindowDoes) {
    // window_left is sliding_window's left: with_window(3) is a config's sliding_window: 4, and window_left 0
    // leaves each query its own position only.
    const auto base = attend_test::paged_config(1, 4, 4, 16);
    EXPECT_EQ(base.window_left, attend::unbounded);
    EXPECT_EQ(base.with_window(3).window_left, base.with_window_from_config(4).window_left);
    EXPECT_EQ(base.with_window_from_config(4).window_keys(), 4);
    attend_test::expect_error<attend::mask_error>([&] { (void)base.with_window_from_config(0); },
                                                  "attend.mask.window_from_config");
    attend::paged_kv_cache<double> own(base.with_window(0));
    const index_t id = own.add_sequence();
    tensor<double, 4> k(1, 1, 1, 4), v(1, 1, 1, 4), q(1, 1, 1, 4);
    q.setConstant(1.0);
    for (index_t p = 0; p < 6; ++p) {
        k.setConstant(static_cast<double>(p % 3));
        v.setConstant(static_cast<double>(10 * p));
        own.append(id, k, v);
        const auto r = attend::paged_attention(q, own, {id}, {1});
        EXPECT_EQ(r.out(0, 0, 0, 0), 10.0 * static_cast<double>(p)) << "position " << p;
    }
}

TEST(PagedCache, ARollingWindowHoldsABoundedNumberOfBlocks) {
    // 7 blocks of 16: 112 positions for a sequence that reaches 1000 with a window of 64.
    const auto cfg = attend_test::paged_config(1, 4, 16, 7, 1, 64);
    attend::paged_kv_cache<double> c(cfg);
    const index_t id = c.add_sequence();
    tensor<double, 4> k(1, 1, 1, 4), v(1, 1, 1, 4);
    for (index_t p = 0; p < 1000; ++p) {
        k.setConstant(static_cast<double>(p));
        v.setConstant(static_cast<double>(-p));
        c.append(id, k, v);
        // What a query at the next position sees is all there.
        for (index_t seen = std::max<index_t>(0, p - 62); seen <= p; ++seen) ASSERT_EQ(c.key_row(id, 0, seen)[0], seen);
        ASSERT_LE(c.length(id) - c.dropped(id), 64 + 16);
    }
    EXPECT_EQ(c.dropped(id), (999 - 64 + 1) / 16 * 16);
    EXPECT_EQ(c.key_row(id, 0, 0)[3], 0.0);  // dropped positions read the zero block
    EXPECT_EQ(attend_test::consistency_problem(c), "");
}

TEST(PagedCache, ReorderForBeamSearchSharesBlocks) {
    const auto cfg = attend_test::paged_config(1, 4, 4, 16, 3);
    attend::paged_kv_cache<float> c(cfg);
    const index_t a = fill_sequence(c, 6, 1), b = fill_sequence(c, 9, 2), d = fill_sequence(c, 2, 3);
    const auto table_a = c.block_table(a);
    const auto table_b = c.block_table(b);
    const float b0 = *c.key_row(b, 0, 0);
    c.reorder({a, b, d}, {b, b, a});
    EXPECT_EQ(c.block_table(a), table_b);
    EXPECT_EQ(c.block_table(b), table_b);
    EXPECT_EQ(c.block_table(d), table_a);
    EXPECT_EQ(c.length(a), 9);
    EXPECT_EQ(c.length(d), 6);
    EXPECT_EQ(*c.key_row(a, 0, 0), b0);
    EXPECT_EQ(c.free_blocks(), 16 - 3 - 2);  // d's old block went back; b's three and a's two are shared
    EXPECT_EQ(attend_test::consistency_problem(c), "");
}

// ---------------------------------------------------------------------------------------------------------
// An int8 (q8_0) pool: the blocks a q8_kv_cache would hold, read in place by float queries.

/// Random sessions over a quantized pool of Block: the model keeps each sequence in a quantized_kv_cache<Block>
/// of its own, so the pool must hold the same bytes, position by position, and attention over a ragged batch the
/// bits of attention over each sequence's cache alone.
template <class Block>
void expect_quantized_sessions_equal_each_sequence_alone() {
    for (const index_t window : {0, 23})
        for (const index_t block_size : {1, 4, 16}) {
            SCOPED_TRACE("block_size " + std::to_string(block_size) + ", window " + std::to_string(window));
            typename session<float, Block>::sizes z;
            z.head_dim = 32;
            z.block_size = block_size;
            z.window = window;
            z.blocks = (window > 0 ? 300 : 700) / block_size + 8;
            z.prefill = 120;
            attend::sdpa_options o;
            o.threads = 2;
            const int steps = attend_test::repeat(120);
            const auto done = run_session<float, Block>(z, o, 31 + static_cast<std::uint64_t>(block_size), steps);
            if (steps < 120) continue;  // a shortened run need not reach every case
            EXPECT_GT(done.attended_rows, 150);
            EXPECT_GT(done.forks, 2);
            EXPECT_GT(done.truncations, 2);
            if (block_size > 1) {
                EXPECT_GT(done.copies_on_write, 0);
            }
            if (window > 0) {
                EXPECT_GT(done.dropped_blocks, 5);
            }
        }
}

TEST(PagedCacheQ8, RaggedSessionsHoldAnInt8CachesBlocksAndAttendBitIdenticallyToEachSequenceAlone) {
    expect_quantized_sessions_equal_each_sequence_alone<attend::q8_0_block>();
}

TEST(PagedCacheQ4, RaggedSessionsHoldAnInt4CachesBlocksAndAttendBitIdenticallyToEachSequenceAlone) {
    expect_quantized_sessions_equal_each_sequence_alone<attend::q4_0_block>();
}

TEST(PagedCacheQ8, AnInt8PoolTakes34BytesFor32ValuesAnInt4Pool18AFloatPool128) {
    const auto cfg = attend_test::paged_config(2, 128, 16, 64, 4);
    const attend::paged_kv_cache<float> wide(cfg);
    const attend::paged_kv_cache<attend::q8_0_block> int8(cfg);
    const attend::paged_kv_cache<attend::q4_0_block> int4(cfg);
    EXPECT_EQ(wide.storage_bytes(), std::size_t(2) * 65 * 2 * 16 * 128 * sizeof(float));
    EXPECT_EQ(int8.storage_bytes() * 128, wide.storage_bytes() * 34);  // 0.27 of the bytes
    EXPECT_EQ(int4.storage_bytes() * 128, wide.storage_bytes() * 18);  // 0.14
}

TEST(PagedCacheQ8, ValuesOfEveryStorageTypeAreQuantizedAsAnInt8CacheQuantizesThem) {
    const auto check = [](auto type) {
        using T = decltype(type);
        attend::paged_kv_cache<attend::q8_0_block> pool(attend_test::paged_config(2, 64, 4, 8, 2));
        attend::q8_kv_cache plain(attend::kv_cache_config{}.with_kv_heads(2).with_capacity(16).with_head_dim(64));
        tensor<T, 4> k(1, 2, 7, 64), v(1, 2, 7, 64);
        attend_test::fill_uniform(k, 5);
        attend_test::fill_uniform(v, 6);
        const index_t id = pool.add_sequence();
        pool.append(id, k, v);
        plain.append(k, v);
        for (index_t h = 0; h < 2; ++h)
            for (index_t p = 0; p < 7; ++p) {
                EXPECT_TRUE(attend_test::same_row(pool.key_row(id, h, p), plain.keys().row(0, h, p), 64)) << p;
                EXPECT_TRUE(attend_test::same_row(pool.value_row(id, h, p), plain.values().row(0, h, p), 64)) << p;
            }
    };
    check(float{});
    check(double{});
    check(Eigen::half{});
    check(Eigen::bfloat16{});
}

TEST(PagedCacheQ8, CheckFiniteAndTheReferenceKernelAgreeOverAnInt8Pool) {
    // Blocks are finite by construction, so check_finite scans nothing of the pool and changes no bit; the
    // reference kernel reads the same widened values (to float rounding: it sums in another order).
    attend::paged_kv_cache<attend::q8_0_block> pool(attend_test::paged_config(2, 128, 16, 200, 3));
    const std::vector<index_t> ids{fill_sequence(pool, 5, 1), fill_sequence(pool, 300, 3),
                                   fill_sequence(pool, 2600, 5)};
    tensor<float, 4> q(3, 8, 1, 128);
    attend_test::fill_uniform(q, 9);
    attend::sdpa_options checked, unchecked, reference;
    unchecked.check_finite = false;
    reference.kernel = attend::kernel::reference;
    const auto with_scan = attend::paged_attention(q, pool, ids, {1, 1, 1}, checked);
    const auto without = attend::paged_attention(q, pool, ids, {1, 1, 1}, unchecked);
    EXPECT_TRUE(attend_test::bit_equal(with_scan.out, without.out));
    EXPECT_TRUE(attend_test::bit_equal(with_scan.lse, without.lse));
    EXPECT_LT(attend_test::max_abs_diff(with_scan.out, attend::paged_attention(q, pool, ids, {1, 1, 1}, reference).out),
              1e-5);
}

TEST(PagedCacheQ8Errors, HeadDimsThatAreNotWholeBlocksAreQuantizedDimErrors) {
    expect_error<attend::value_error>(
        [] { attend::paged_kv_cache<attend::q8_0_block> c(attend_test::paged_config(1, 40, 4, 4)); },
        "attend.value.quantized_dim");
    auto cfg = attend_test::paged_config(1, 32, 4, 4);
    cfg.value_dim = 48;
    expect_error<attend::value_error>([&] { attend::paged_kv_cache<attend::q8_0_block> c(cfg); },
                                      "attend.value.quantized_dim");
}

TEST(PagedCacheQ8Errors, AValueAnInt8BlockCannotHoldChangesNothingForAnySequence) {
    attend::paged_kv_cache<attend::q8_0_block> pool(attend_test::paged_config(2, 32, 4, 16, 3));
    const index_t a = fill_sequence(pool, 6, 1);
    const index_t b = pool.fork(a);
    tensor<float, 4> k(2, 2, 3, 32), v(2, 2, 3, 32);
    attend_test::fill_uniform(k, 2);
    attend_test::fill_uniform(v, 3);
    const auto refused = [&](const char* id, float value) {
        v(1, 1, 2, 17) = value;  // sequence b's last new value
        const auto before = state_of(pool);
        const std::string message = expect_error<attend::value_error>([&] { pool.append({a, b}, k, v, {3, 3}); }, id);
        EXPECT_TRUE(state_of(pool) == before) << id << ": sequence a's tokens were not appended either";
        EXPECT_NE(message.find("[0,1,2,17]"), std::string::npos) << message;
        v(1, 1, 2, 17) = 0;
    };
    refused("attend.value.quantized_range", 9e6f);  // beyond 127 x 65504
    refused("attend.value.quantized_range", -9e6f);
    refused("attend.value.non_finite", std::numeric_limits<float>::quiet_NaN());
    refused("attend.value.non_finite", std::numeric_limits<float>::infinity());
    v(1, 1, 2, 17) = 8e6f;  // within range: appended
    pool.append({a, b}, k, v, {3, 3});
    EXPECT_EQ(pool.length(b), 9);
    EXPECT_EQ(attend_test::consistency_problem(pool), "");
}

// ---------------------------------------------------------------------------------------------------------
// Errors: each a typed error with its id, and the cache as it was.

struct error_fixture {
    attend::paged_cache_config cfg;
    attend::paged_kv_cache<double> c;
    index_t a, b;
    error_fixture() : cfg(make()), c(cfg) {
        a = fill_sequence(c, 10, 1);
        b = c.fork(a);
        fill_after(b, 3);
    }
    static attend::paged_cache_config make() { return attend_test::paged_config(2, 4, 4, 8, 3, 6); }
    void fill_after(index_t id, index_t n) {
        tensor<double, 4> k(1, 2, n, 4), v(1, 2, n, 4);
        attend_test::fill_uniform(k, 7);
        attend_test::fill_uniform(v, 8);
        c.append(id, k, v);
    }
};

template <class E, class F>
void expect_unchanged_error(error_fixture& f, F&& call, const char* id) {
    const auto before = state_of(f.c);
    expect_error<E>(call, id);
    EXPECT_TRUE(state_of(f.c) == before) << id;
}

TEST(PagedCacheErrors, BadSizesAreValueErrors) {
    for (auto change : {+[](attend::paged_cache_config& c) { c.blocks = 0; },
                        +[](attend::paged_cache_config& c) { c.block_size = 0; },
                        +[](attend::paged_cache_config& c) { c.head_dim = 0; },
                        +[](attend::paged_cache_config& c) { c.max_sequences = 0; },
                        +[](attend::paged_cache_config& c) { c.window_left = -1; }}) {
        auto cfg = error_fixture::make();
        change(cfg);
        expect_error<attend::value_error>([&] { attend::paged_kv_cache<float> c(cfg); }, "attend.value.size");
    }
    auto cfg = error_fixture::make();
    cfg.blocks = std::numeric_limits<index_t>::max() / 2;
    expect_error<attend::shape_error>([&] { attend::paged_kv_cache<float> c(cfg); }, "attend.shape.overflow");
}

TEST(PagedCacheErrors, UnknownRemovedAndRepeatedSequencesAreValueErrors) {
    error_fixture f;
    tensor<double, 4> k(1, 2, 1, 4), v(1, 2, 1, 4);
    k.setZero();
    v.setZero();
    expect_unchanged_error<attend::value_error>(
        f, [&] { f.c.append(7, k, v); }, "attend.value.sequence");
    expect_unchanged_error<attend::value_error>(
        f, [&] { f.c.fork(-1); }, "attend.value.sequence");
    expect_unchanged_error<attend::value_error>(
        f, [&] { f.c.truncate(2, 0); }, "attend.value.sequence");
    expect_unchanged_error<attend::value_error>(
        f,
        [&] {
            f.c.reorder({f.a, f.a}, {f.b, f.b});
        },
        "attend.value.sequence");
    expect_unchanged_error<attend::value_error>(
        f, [&] { f.c.reorder({f.a}, {2}); }, "attend.value.sequence");
    tensor<double, 4> k2(2, 2, 1, 4), v2(2, 2, 1, 4);
    k2.setZero();
    v2.setZero();
    expect_unchanged_error<attend::value_error>(
        f,
        [&] {
            f.c.append({f.a, f.a}, k2, v2, {1, 1});
        },
        "attend.value.sequence");
    expect_unchanged_error<attend::value_error>(
        f, [&] { (void)f.c.references(8); }, "attend.value.block");
    expect_unchanged_error<attend::position_error>(
        f, [&] { (void)f.c.key_row(f.a, 2, 0); }, "attend.position.range");
    expect_unchanged_error<attend::position_error>(
        f, [&] { (void)f.c.value_row(f.a, 0, 10); }, "attend.position.range");
    f.c.remove_sequence(f.b);
    expect_unchanged_error<attend::value_error>(
        f, [&] { (void)f.c.length(f.b); }, "attend.value.sequence");
    expect_unchanged_error<attend::value_error>(
        f, [&] { f.c.remove_sequence(f.b); }, "attend.value.sequence");
}

TEST(PagedCacheErrors, BadAppendsChangeNothing) {
    error_fixture f;
    tensor<double, 4> k(2, 2, 3, 4), v(2, 2, 3, 4);
    attend_test::fill_uniform(k, 1);
    attend_test::fill_uniform(v, 2);
    expect_unchanged_error<attend::shape_error>(
        f, [&] { f.c.append({f.a}, k, v, {1}); }, "attend.shape.sequences");
    expect_unchanged_error<attend::shape_error>(
        f,
        [&] {
            f.c.append({f.a, f.b}, k, v, {1});
        },
        "attend.shape.sequences");
    expect_unchanged_error<attend::shape_error>(
        f,
        [&] {
            f.c.append({f.a, f.b}, k, v, {1, 4});
        },
        "attend.shape.sequences");
    expect_unchanged_error<attend::shape_error>(
        f,
        [&] {
            f.c.append({f.a, f.b}, k, v, {-1, 0});
        },
        "attend.shape.sequences");
    tensor<double, 4> wide(2, 2, 3, 5);
    wide.setZero();
    expect_unchanged_error<attend::shape_error>(
        f,
        [&] {
            f.c.append({f.a, f.b}, k, wide, {1, 1});
        },
        "attend.shape.cache");
    // The second sequence's second new key is NaN: neither sequence gets anything.
    k(1, 1, 1, 2) = std::numeric_limits<double>::quiet_NaN();
    expect_unchanged_error<attend::value_error>(
        f,
        [&] {
            f.c.append({f.a, f.b}, k, v, {3, 3});
        },
        "attend.value.non_finite");
    k(1, 1, 1, 2) = 0;
    // 8 blocks: a holds 3, b shares 2 of them and holds 2 of its own (one a copy), so 3 are free; 17 more
    // positions of a need 7 blocks in all, 4 new ones.
    expect_unchanged_error<attend::position_error>(
        f,
        [&] {
            tensor<double, 4> big(1, 2, 17, 4);
            big.setZero();
            f.c.append(f.a, big, big);
        },
        "attend.position.cache_full");
    // Keys that live in the cache's own pool.
    const auto pool_view = [&] {
        attend::strided_view<const double> x;
        x.data = f.c.key_row(f.a, 0, 0);
        x.dims = {1, 2, 1, 4};
        x.strides = {8 * 4, 4 * 4, 4, 1};
        x.rank = 4;
        return x;
    }();
    expect_unchanged_error<attend::shape_error>(
        f, [&] { f.c.append(f.b, pool_view, pool_view); }, "attend.shape.aliasing");
}

TEST(PagedCacheErrors, FullSlotsTruncationsAndTheWindowAreTypedErrors) {
    error_fixture f;
    (void)f.c.add_sequence();
    expect_unchanged_error<attend::position_error>(
        f, [&] { (void)f.c.add_sequence(); }, "attend.position.sequence_slots");
    expect_unchanged_error<attend::position_error>(
        f, [&] { (void)f.c.fork(f.a); }, "attend.position.sequence_slots");
    expect_unchanged_error<attend::position_error>(
        f, [&] { f.c.truncate(f.a, 11); }, "attend.position.truncate");
    expect_unchanged_error<attend::position_error>(
        f, [&] { f.c.truncate(f.a, -1); }, "attend.position.truncate");
    // b appended 3 tokens at length 10 with window 6: positions below 4 (one block) were dropped, so b can roll
    // back to 10 but not to 8, where a query would see position 3.
    ASSERT_EQ(f.c.dropped(f.b), 4);
    expect_unchanged_error<attend::position_error>(
        f, [&] { f.c.truncate(f.b, 8); }, "attend.position.window");
    tensor<double, 4> q(1, 2, 5, 4);
    q.setZero();
    expect_unchanged_error<attend::position_error>(
        f, [&] { (void)attend::paged_attention(q, f.c, {f.b}, {5}); }, "attend.position.window");
    f.c.truncate(f.b, 10);
    EXPECT_EQ(f.c.length(f.b), 10);
}

TEST(PagedCacheErrors, BadAttentionCallsAreTypedErrorsBeforeAnyWrite) {
    error_fixture f;
    tensor<double, 4> q(2, 4, 3, 4);
    attend_test::fill_uniform(q, 3);
    expect_error<attend::shape_error>([&] { (void)attend::paged_attention(q, f.c, {f.a}, {1}); },
                                      "attend.shape.sequences");
    expect_error<attend::shape_error>(
        [&] {
            (void)attend::paged_attention(q, f.c, {f.a, f.b}, {1, 4});
        },
        "attend.shape.sequences");
    expect_error<attend::value_error>(
        [&] {
            (void)attend::paged_attention(q, f.c, {f.a, 2}, {1, 1});
        },
        "attend.value.sequence");
    tensor<double, 4> q3(1, 3, 1, 4), q5(1, 2, 1, 5);
    q3.setZero();
    q5.setZero();
    expect_error<attend::shape_error>([&] { (void)attend::paged_attention(q3, f.c, {f.a}, {1}); }, "attend.shape.gqa");
    expect_error<attend::shape_error>([&] { (void)attend::paged_attention(q5, f.c, {f.a}, {1}); },
                                      "attend.shape.key_dim");
    attend::sdpa_options o;
    o.need_weights = true;
    expect_error<attend::value_error>(
        [&] {
            (void)attend::paged_attention(q, f.c, {f.a, f.b}, {1, 1}, o);
        },
        "attend.value.need_weights");
    q(1, 2, 0, 1) = std::numeric_limits<double>::infinity();
    expect_error<attend::value_error>(
        [&] {
            (void)attend::paged_attention(q, f.c, {f.a, f.b}, {1, 1});
        },
        "attend.value.non_finite");
}

TEST(PagedCacheErrors, AKeyWhoseScoresOverflowIsTheScansErrorThoughTheDecodePassFindsIt) {
    // check_finite's scan of each sequence's keys rides on its decode pass. A key whose scores overflow float (q.k
    // = 8 x 1e19 x 1e19 / sqrt(8)), in the second of two sequences, short (one chunk) or long (split keys), is
    // still the scan's typed error with the scan's message, and the call returns nothing.
    for (const index_t length : {index_t(300), index_t(2600)}) {
        attend::paged_kv_cache<float> c(attend_test::paged_config(2, 8, 16, 200, 2));
        const index_t a = fill_sequence(c, 40, 1), b = c.add_sequence();
        tensor<float, 4> k(1, 2, length, 8), v(1, 2, length, 8);
        attend_test::fill_uniform(k, 3);
        attend_test::fill_uniform(v, 4);
        for (index_t d = 0; d < 8; ++d) k(0, 1, length - 7, d) = 1e19f;
        c.append(b, k, v);
        tensor<float, 4> q(2, 4, 1, 8);
        q.setConstant(1e19f);
        const std::string paged = expect_error<attend::value_error>(
            [&] {
                (void)attend::paged_attention(q, c, {a, b}, {0, 1});
            },
            "attend.value.score_overflow");
        attend::sdpa_options scan_first;
        scan_first.kernel = attend::kernel::reference;
        const tensor<float, 4> q1 = q.slice(std::array<index_t, 4>{1, 0, 0, 0}, std::array<index_t, 4>{1, 4, 1, 8});
        const std::string scanned = expect_error<attend::value_error>(
            [&] {
                (void)attend::scaled_dot_product_attention(q1, k, v, attend::causal(attend::alignment::bottom_right),
                                                           scan_first);
            },
            "attend.value.score_overflow");
        EXPECT_NE(paged.find("key " + std::to_string(length - 7)), std::string::npos) << paged;
        EXPECT_EQ(paged, scanned);
    }
}

// ---------------------------------------------------------------------------------------------------------
// Multi-head attention over a paged cache

/// A multi_head_attention<T> decoding ragged batches over a paged cache of S (T, 16-bit under a float module, or
/// int8 / int4 under a float or 16-bit one) gives each sequence the bits of decoding it alone over a kv_cache<S>
/// (a quantized_kv_cache<S> for int8 and int4).
template <class T, class S>
void expect_ragged_batching_equals_each_sequence_alone() {
    constexpr bool quantized = attend::detail::is_quantized_block_v<S>;
    constexpr index_t D = quantized ? 32 : 8, E = 4 * D;  // a quantized row is whole blocks of 32
    attend::mha_config cfg{E, 4};
    cfg.kv_heads = 2;
    const attend::multi_head_attention<T> m(cfg, 5);
    attend::mha_options o;
    o.rotary = attend::rotary_embedding{8};
    o.attention.threads = 2;
    attend::paged_cache_config pc = attend_test::paged_config(2, D, 4, 64, 4);
    attend::paged_kv_cache<S> cache(pc);
    std::map<index_t, attend_test::plain_cache_t<S>> alone;
    const auto make_alone = [&] {
        if constexpr (std::is_same_v<S, attend::q8_0_block>) return m.template make_cache<attend::q8_0_block>(1, 256);
        else if constexpr (std::is_same_v<S, attend::q4_0_block>)
            return m.template make_cache<attend::q4_0_block>(1, 256);
        else return m.template make_cache<S>(1, 256);
    };
    attend_test::rng g(3);
    for (int step = 0; step < attend_test::repeat(30); ++step) {
        // Sequences join and leave between steps; one is forked and one rolled back now and then.
        const auto ids = cache.sequences();
        if (ids.size() < 3 && g.bernoulli(0.5)) alone.emplace(cache.add_sequence(), make_alone());
        if (!ids.empty() && g.bernoulli(0.15)) {
            const index_t gone = ids[static_cast<std::size_t>(g.uniform_int(0, static_cast<index_t>(ids.size()) - 1))];
            cache.remove_sequence(gone);
            alone.erase(gone);
        }
        if (!cache.sequences().empty() && cache.sequences().size() < 4 && g.bernoulli(0.2)) {
            const index_t from = cache.sequences().front();
            alone.insert_or_assign(cache.fork(from), alone.at(from));
        }
        if (!cache.sequences().empty() && g.bernoulli(0.2)) {
            const index_t id = cache.sequences().back();
            const index_t keep = g.uniform_int(0, cache.length(id));
            cache.truncate(id, keep);
            alone.at(id).truncate(keep);
        }
        const auto batch = cache.sequences();
        if (batch.empty()) continue;
        std::vector<index_t> counts;
        for (std::size_t n = 0; n < batch.size(); ++n) counts.push_back(g.bernoulli(0.2) ? g.uniform_int(0, 9) : 1);
        const index_t L = *std::max_element(counts.begin(), counts.end());
        tensor<T, 3> x(static_cast<index_t>(batch.size()), L, E);
        attend_test::fill_uniform(x, 100 + static_cast<std::uint64_t>(step));
        const auto r = m.forward_cached(x, cache, batch, counts, o);
        for (std::size_t n = 0; n < batch.size(); ++n) {
            const index_t t = counts[n];
            tensor<T, 3> xn(1, t, E);
            for (index_t i = 0; i < t; ++i)
                for (index_t e = 0; e < E; ++e) xn(0, i, e) = x(static_cast<index_t>(n), i, e);
            const auto want = m.forward_cached(xn, alone.at(batch[n]), o);
            ASSERT_EQ(cache.length(batch[n]), alone.at(batch[n]).length());
            for (index_t i = 0; i < L; ++i)
                for (index_t e = 0; e < E; ++e) {
                    const T expected = i < t ? want.out(0, i, e) : T(0);
                    ASSERT_EQ(std::memcmp(&r.out(static_cast<index_t>(n), i, e), &expected, sizeof(T)), 0)
                        << "step " << step << " sequence " << batch[n] << " token " << i << ": "
                        << r.out(static_cast<index_t>(n), i, e) << " != " << expected;
                }
        }
        EXPECT_EQ(attend_test::consistency_problem(cache), "");
    }
}

TEST(PagedCacheMha, RaggedContinuousBatchingIsBitIdenticalToDecodingEachSequenceAlone) {
    expect_ragged_batching_equals_each_sequence_alone<double, double>();
}

TEST(PagedCacheMha, AFloatModuleOverASixteenBitPagedCacheIsBitIdenticalToDecodingEachSequenceAlone) {
    expect_ragged_batching_equals_each_sequence_alone<float, Eigen::half>();
    expect_ragged_batching_equals_each_sequence_alone<float, Eigen::bfloat16>();
}

TEST(PagedCacheMha, AFloatOr16BitModuleOverAnInt8PoolIsBitIdenticalToDecodingEachSequenceAloneOverAnInt8Cache) {
    expect_ragged_batching_equals_each_sequence_alone<float, attend::q8_0_block>();
    expect_ragged_batching_equals_each_sequence_alone<Eigen::half, attend::q8_0_block>();
    expect_ragged_batching_equals_each_sequence_alone<Eigen::bfloat16, attend::q8_0_block>();
}

TEST(PagedCacheMha, AFloatOr16BitModuleOverAnInt4PoolIsBitIdenticalToDecodingEachSequenceAloneOverAnInt4Cache) {
    expect_ragged_batching_equals_each_sequence_alone<float, attend::q4_0_block>();
    expect_ragged_batching_equals_each_sequence_alone<Eigen::bfloat16, attend::q4_0_block>();
}

TEST(PagedCacheMha, ARollingWindowKeepsAbsoluteRotaryPositionsAndEqualsASlidingWindowOverTheWholeHistory) {
    // 300 tokens through 8 blocks of 8 positions with a window of 20: blocks are handed back and reused many
    // times, while rotary positions keep counting from 0. A plain kv_cache holding the whole history, attended
    // with sliding_window(19, 0, bottom_right), must give the same bits at every step, prefill chunks included.
    attend::mha_config cfg{16, 4};
    cfg.kv_heads = 2;
    const attend::multi_head_attention<float> m(cfg, 9);
    attend::mha_options o;
    o.rotary = attend::rotary_embedding{4};
    o.attention.threads = 1;
    attend::paged_kv_cache<float> cache(attend_test::paged_config(2, 4, 8, 8, 1, 20));
    const index_t id = cache.add_sequence();
    auto plain = m.make_cache(1, 300);
    const auto window = attend::sliding_window(19, 0, attend::alignment::bottom_right);
    attend_test::rng g(4);
    for (index_t done = 0; done < 300;) {
        const index_t t = std::min<index_t>(300 - done, g.bernoulli(0.1) ? g.uniform_int(2, 8) : 1);
        tensor<float, 3> x(1, t, 16);
        attend_test::fill_uniform(x, static_cast<std::uint64_t>(done));
        const auto paged = m.forward_cached(x, cache, {id}, {t}, o);
        const auto alone = m.forward_cached(x, plain, window, o);
        ASSERT_TRUE(attend_test::bit_equal(paged.out, alone.out)) << "tokens " << done << " .. " << done + t;
        done += t;
        ASSERT_LE(static_cast<index_t>(cache.block_table(id).size()) - cache.dropped(id) / 8, 8);
    }
    EXPECT_GT(cache.dropped(id), 250);
    EXPECT_EQ(attend_test::consistency_problem(cache), "");
}

TEST(PagedCacheMha, ModuleAndCacheMustFit) {
    const attend::multi_head_attention<float> m(attend::mha_config{8, 2}, 1);
    attend::paged_cache_config pc = attend_test::paged_config(2, 3, 16, 4);
    attend::paged_kv_cache<float> wrong(pc);
    const index_t id = wrong.add_sequence();
    tensor<float, 3> x(1, 1, 8);
    x.setZero();
    expect_error<attend::shape_error>([&] { (void)m.forward_cached(x, wrong, {id}, {1}); }, "attend.shape.cache");
    pc.head_dim = 4;
    attend::paged_kv_cache<float> cache(pc);
    const index_t s = cache.add_sequence();
    expect_error<attend::shape_error>(
        [&] {
            (void)m.forward_cached(x, cache, {s, s}, {1, 1});
        },
        "attend.shape.sequences");
    expect_error<attend::shape_error>([&] { (void)m.forward_cached(x, cache, {s}, {2}); }, "attend.shape.sequences");
    attend::mha_options o;
    o.attention.need_weights = true;
    expect_error<attend::value_error>([&] { (void)m.forward_cached(x, cache, {s}, {1}, o); },
                                      "attend.value.need_weights");
    EXPECT_EQ(cache.length(s), 0);
}

/// A module over a pool of T with two sequences, heads of width `dim`: after a first step, a step whose token of
/// sequence b is scaled by `factor` (finite in float, beyond what T holds) must be refused with `id` while the pool
/// keeps every byte, sequence a's token included. Returns the error's message.
template <class T>
std::string second_step_beyond_the_pool_is_refused(index_t dim, float factor, const char* id) {
    const attend::multi_head_attention<float> m(attend::mha_config{dim * 2, 2}, 1);
    attend::paged_kv_cache<T> cache(attend_test::paged_config(2, dim, 4, 8, 2));
    const index_t a = cache.add_sequence(), b = cache.add_sequence();
    tensor<float, 3> x(2, 2, dim * 2);
    attend_test::fill_uniform(x, 9);
    (void)m.forward_cached(x, cache, {a, b}, {2, 1});
    const auto before = attend_test::state_of(cache);
    for (index_t e = 0; e < dim * 2; ++e) x(1, 0, e) *= factor;
    const std::string message = expect_error<attend::value_error>(
        [&] {
            (void)m.forward_cached(x, cache, {a, b}, {1, 1});
        },
        id);
    EXPECT_TRUE(attend_test::state_of(cache) == before) << "sequence a's token was not appended either";
    return message;
}

TEST(PagedCacheMha, AProjectionBeyondFp16IsRefusedBeforeTheSixteenBitCacheChanges) {
    const std::string message =
        second_step_beyond_the_pool_is_refused<Eigen::half>(4, 1e6f, "attend.value.non_finite");  // inf in fp16
    EXPECT_NE(message.find("rounded to the cache's type"), std::string::npos) << message;
}

TEST(PagedCacheMha, AProjectionBeyondAnInt8BlockIsRefusedBeforeThePoolChanges) {
    (void)second_step_beyond_the_pool_is_refused<attend::q8_0_block>(32, 1e9f, "attend.value.quantized_range");
}

TEST(PagedCacheMha, AProjectionBeyondAnInt4BlockIsRefusedBeforeThePoolChanges) {
    (void)second_step_beyond_the_pool_is_refused<attend::q4_0_block>(32, 1e9f, "attend.value.quantized_range");
}

}  // namespace
