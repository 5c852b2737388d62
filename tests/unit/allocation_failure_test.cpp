// SPDX-License-Identifier: MIT
// A huge but valid call fails with resource_error attend.resource.allocation, naming what it was allocating and
// its bytes, before any output is written: never an uncaught std::bad_alloc from deep inside, never undefined
// behaviour. The inputs are small (head_dim 1), the materialized [query_len, key_len] = 2^20 x 2^20 scores or
// weights are 4 TiB in float.
//
// Under AddressSanitizer a failed allocation aborts unless ASAN_OPTIONS holds allocator_may_return_null=1
// (scripts/test sets it). On a Linux kernel that overcommits memory unconditionally (vm.overcommit_memory = 1)
// a 4 TiB request may succeed and then exhaust memory when written, so the test skips there.

#include <fstream>
#include <limits>
#include <new>
#include <stdexcept>
#include <string>

#include <gtest/gtest.h>

#include <attend/attend.hpp>

#include "support/errors.hpp"

namespace {

using attend::index_t;

constexpr float sentinel = -7777.25f;
constexpr index_t huge_len = index_t(1) << 20;

bool allocator_always_succeeds() {
    std::ifstream policy("/proc/sys/vm/overcommit_memory");
    int mode = 0;
    return policy >> mode && mode == 1;
}

#define ATTEND_SKIP_IF_ALWAYS_OVERCOMMITTING()                                                       \
    if (allocator_always_succeeds())                                                                 \
    GTEST_SKIP() << "vm.overcommit_memory = 1: a 4 TiB allocation would succeed and exhaust memory " \
                    "when written"

/// q, k, v `[1, 2^20, 1]`: 4 MiB each, valid, with scores of 2^40 elements.
struct huge_call {
    attend::tensor<float, 3> q{1, huge_len, 1}, k{1, huge_len, 1}, v{1, huge_len, 1};
    attend::tensor<float, 3> out{1, huge_len, 1};
    huge_call() {
        q.setConstant(0.5f);
        k.setConstant(0.25f);
        v.setConstant(1.0f);
        out.setConstant(sentinel);
    }
    bool out_untouched() const {
        for (index_t n = 0; n < out.size(); ++n)
            if (!(out.data()[n] == sentinel)) return false;
        return true;
    }
};

TEST(AllocationFailure, ReferenceKernelScoresOfTwoToTheFortyElementsAreAResourceErrorBeforeAnyWrite) {
    ATTEND_SKIP_IF_ALWAYS_OVERCOMMITTING();
    huge_call c;
    attend::sdpa_options o;
    o.kernel = attend::kernel::reference;
    o.threads = 1;
    const std::string message = attend_test::expect_error<attend::resource_error>(
        [&] { attend::scaled_dot_product_attention_into(c.q, c.k, c.v, attend::no_mask{}, o, c.out); },
        "attend.resource.allocation");
    EXPECT_NE(message.find("the reference kernel's scores [1048576,1048576] = 4398046511104 bytes"), std::string::npos)
        << message;
    EXPECT_TRUE(c.out_untouched());
}

TEST(AllocationFailure, NeedWeightsOfTwoToTheFortyElementsIsAResourceError) {
    ATTEND_SKIP_IF_ALWAYS_OVERCOMMITTING();
    huge_call c;
    for (const auto kernel : {attend::kernel::reference, attend::kernel::tiled}) {
        attend::sdpa_options o;
        o.kernel = kernel;
        o.threads = 1;
        o.need_weights = true;
        const std::string message = attend_test::expect_error<attend::resource_error>(
            [&] { (void)attend::scaled_dot_product_attention(c.q, c.k, c.v, o); }, "attend.resource.allocation");
        EXPECT_NE(message.find("weights [1,1048576,1048576] = 4398046511104 bytes"), std::string::npos) << message;
        EXPECT_NE(message.find("need_weights"), std::string::npos) << message;
    }
}

TEST(AllocationFailure, OutOfMemoryIsCaughtAsStdBadAllocAndAsAnAttendError) {
    // Code that handles out-of-memory the usual way sees attend's too; attend::error still catches every failure.
    ATTEND_SKIP_IF_ALWAYS_OVERCOMMITTING();
    huge_call c;
    attend::sdpa_options o;
    o.need_weights = true;
    o.threads = 1;
    int as_bad_alloc = 0, as_attend_error = 0, as_invalid_argument = 0;
    try {
        (void)attend::scaled_dot_product_attention(c.q, c.k, c.v, o);
    } catch (const std::bad_alloc& e) {
        ++as_bad_alloc;
        EXPECT_NE(std::string(e.what()).find("[attend.resource.allocation]"), std::string::npos) << e.what();
        as_attend_error += dynamic_cast<const attend::error*>(&e) != nullptr;
        as_invalid_argument += dynamic_cast<const std::invalid_argument*>(&e) != nullptr;
    }
    EXPECT_EQ(as_bad_alloc, 1);
    EXPECT_EQ(as_attend_error, 1);
    EXPECT_EQ(as_invalid_argument, 0);
}

TEST(AllocationFailure, TheSameShapeWithoutWeightsRunsInTiles) {
    // The tiled kernel needs O(threads x tile) memory: the call that cannot materialize its scores still runs.
    // Only a slice of the queries, to keep the test short: 4 queries against 2^20 keys.
    huge_call c;
    attend::tensor<float, 3> q(1, 4, 1);
    q.setConstant(0.5f);
    attend::sdpa_options o;
    o.kernel = attend::kernel::tiled;
    o.threads = 1;
    const auto r = attend::scaled_dot_product_attention(q, c.k, c.v, o);
    for (index_t n = 0; n < r.out.size(); ++n) EXPECT_FLOAT_EQ(r.out.data()[n], 1.0f);
}

TEST(AllocationFailure, ReferenceBackwardScoresAreAResourceErrorBeforeAnyWrite) {
    ATTEND_SKIP_IF_ALWAYS_OVERCOMMITTING();
    huge_call c;
    attend::tensor<float, 2> lse(1, huge_len);
    lse.setConstant(0.0f);
    attend::tensor<float, 3> d_out = c.v, dq = c.out, dk = c.out, dv = c.out;
    attend::sdpa_options o;
    o.kernel = attend::kernel::reference;
    o.threads = 1;
    const std::string message = attend_test::expect_error<attend::resource_error>(
        [&] {
            attend::scaled_dot_product_attention_backward_into(c.q, c.k, c.v, attend::no_mask{}, c.v, lse, d_out, o, dq,
                                                               dk, dv);
        },
        "attend.resource.allocation");
    EXPECT_NE(message.find("the reference backward's score matrices (3 x query_len x key_len) [3,1048576,1048576]"),
              std::string::npos)
        << message;
    for (const auto* g : {&dq, &dk, &dv})
        for (index_t n = 0; n < g->size(); ++n) ASSERT_EQ(g->data()[n], sentinel);
}

TEST(AllocationFailure, ReferenceBackwardOfSixteenBitInputsIsAResourceErrorBeforeAnyWrite) {
    // kernel::reference on bf16 inputs works on float copies (2^20 values each, which fit) and rounds its float
    // gradients into the bf16 outputs at the end: its score matrices fail first, and nothing is written.
    ATTEND_SKIP_IF_ALWAYS_OVERCOMMITTING();
    using bf16 = Eigen::bfloat16;
    const huge_call c;
    const attend::tensor<bf16, 3> q = c.q.cast<bf16>(), k = c.k.cast<bf16>(), v = c.v.cast<bf16>();
    attend::tensor<float, 2> lse(1, huge_len);
    lse.setConstant(0.0f);
    const bf16 marker(sentinel);
    attend::tensor<bf16, 3> dq(q.dimensions()), dk(k.dimensions()), dv(v.dimensions());
    for (auto* g : {&dq, &dk, &dv}) g->setConstant(marker);
    attend::sdpa_options o;
    o.kernel = attend::kernel::reference;
    o.threads = 1;
    const std::string message = attend_test::expect_error<attend::resource_error>(
        [&] {
            attend::scaled_dot_product_attention_backward_into(q, k, v, attend::no_mask{}, v, lse, v, o, dq, dk, dv);
        },
        "attend.resource.allocation");
    EXPECT_NE(message.find("the reference backward's score matrices (3 x query_len x key_len) [3,1048576,1048576]"),
              std::string::npos)
        << message;
    for (const auto* g : {&dq, &dk, &dv})
        for (index_t n = 0; n < g->size(); ++n) ASSERT_TRUE(g->data()[n] == marker);
}

TEST(AllocationFailure, AKvCacheLargerThanAVectorCanHoldIsAResourceError) {
    // 2^62 positions of one float: within Eigen::Index, past std::vector's max_size, so the standard library
    // throws std::length_error before asking the allocator (this holds under every sanitizer and kernel policy).
    const std::string message = attend_test::expect_error<attend::resource_error>(
        [] {
            attend::kv_cache<float> cache(attend::kv_cache_config{}.with_capacity(index_t(1) << 62).with_head_dim(1));
        },
        "attend.resource.allocation");
    EXPECT_NE(
        message.find(
            "kv_cache storage (keys and values x batch x kv_heads x capacity x dim) [2,1,1,4611686018427387904,1]"),
        std::string::npos)
        << message;
    EXPECT_NE(message.find("std::length_error"), std::string::npos) << message;
}

TEST(AllocationFailure, MultiHeadWeightsOfTwoToTheFortyElementsAreAResourceError) {
    ATTEND_SKIP_IF_ALWAYS_OVERCOMMITTING();
    // model_dim 1, one head: x `[1, 2^20, 1]` is 4 MiB; the per-head weights `[1, 1, 2^20, 2^20]` 4 TiB.
    const attend::multi_head_attention<float> m(attend::mha_config{1, 1});
    attend::tensor<float, 3> x(1, huge_len, 1);
    x.setConstant(0.5f);
    attend::mha_options o;
    o.attention.need_weights = true;
    o.attention.threads = 1;
    const std::string message = attend_test::expect_error<attend::resource_error>([&] { (void)m.forward(x, x, x, o); },
                                                                                  "attend.resource.allocation");
    EXPECT_NE(message.find("per-head weights [batch, heads, query_len, key_len] [1,1,1048576,1048576]"),
              std::string::npos)
        << message;
}

TEST(AllocationFailure, ForwardCachedThatCannotAllocateLeavesTheCacheUnchanged) {
    ATTEND_SKIP_IF_ALWAYS_OVERCOMMITTING();
    // 2^20 new tokens of model_dim 1 into an empty cache: the per-head weights [1, 1, 2^20, 2^20] are 4 TiB. The
    // failure must come before the append, so the cache keeps its length and its positions.
    const attend::multi_head_attention<float> m(attend::mha_config{1, 1});
    auto cache = m.make_cache(1, huge_len + 1);
    attend::tensor<float, 3> first(1, 1, 1);
    first.setConstant(0.25f);
    (void)m.forward_cached(first, cache);
    ASSERT_EQ(cache.length(), 1);
    const float key0 = cache.keys().row(0, 0, 0)[0];
    attend::tensor<float, 3> x(1, huge_len, 1);
    x.setConstant(0.5f);
    attend::mha_options o;
    o.attention.need_weights = true;
    o.average_weights = false;
    o.attention.threads = 1;
    const std::string message = attend_test::expect_error<attend::resource_error>(
        [&] { (void)m.forward_cached(x, cache, o); }, "attend.resource.allocation");
    EXPECT_NE(message.find("per-head weights"), std::string::npos) << message;
    EXPECT_EQ(cache.length(), 1);
    EXPECT_EQ(cache.keys().row(0, 0, 0)[0], key0);
    // And the cache still decodes: the next token lands at position 1.
    (void)m.forward_cached(first, cache);
    EXPECT_EQ(cache.length(), 2);
}

}  // namespace
