// SPDX-License-Identifier: MIT
// Every allocation of the paged cache's operations, made to fail one at a time: each failure is a resource_error
// (never a bare std::bad_alloc) and leaves the cache exactly as it was, block numbers, reference counts and free
// list included, also when it comes after multi-head attention has appended (the append is taken back out).
//
// This binary replaces the global operator new and interposes glibc's malloc family (Eigen allocates with
// malloc), so that the n-th allocation after arming fails. Under AddressSanitizer (which owns malloc) and off
// glibc the tests are skipped.
#include <attend/attend.hpp>

#include <gtest/gtest.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <new>
#include <string>
#include <vector>

#include "support/paged_model.hpp"
#include "support/random.hpp"

#include "support/malloc_hooks.hpp"

namespace {

/// Armed: allocations count down and the one that reaches zero fails; the others succeed. (Without the hooks
/// nothing reads them and the tests skip.)
std::atomic<bool> armed{false};
std::atomic<std::int64_t> countdown{0};

}  // namespace

#ifdef ATTEND_TEST_MALLOC_HOOKS

namespace {

bool fail_now() { return armed.load(std::memory_order_relaxed) && countdown.fetch_sub(1) == 0; }

/// A refused allocation, as glibc's: null with errno ENOMEM (glibc's thread creation asserts on that errno).
void* refused() noexcept {
    errno = ENOMEM;
    return nullptr;
}

}  // namespace

extern "C" {
void* malloc(std::size_t n) noexcept { return fail_now() ? refused() : __libc_malloc(n); }
void* calloc(std::size_t count, std::size_t n) noexcept { return fail_now() ? refused() : __libc_calloc(count, n); }
void* realloc(void* old, std::size_t n) noexcept { return fail_now() ? refused() : __libc_realloc(old, n); }
void* memalign(std::size_t alignment, std::size_t n) noexcept {
    return fail_now() ? refused() : __libc_memalign(alignment, n);
}
void free(void* p) noexcept { __libc_free(p); }
}

#endif

namespace {

using attend::index_t;
using attend::tensor;
using attend_test::state_of;

/// Runs `op` with its n-th allocation failing, for n = 0, 1, ... until it succeeds: every failure must be a
/// resource_error that leaves `cache` as it was. Returns how many allocations failed.
template <class T, class Op>
int fail_every_allocation(attend::paged_kv_cache<T>& cache, Op&& op) {
    for (int n = 0;; ++n) {
        const auto before = state_of(cache);
        std::exception_ptr failure;
        countdown = n;
        armed = true;
        try {
            op();
        } catch (...) {
            armed = false;  // before anything in here allocates
            failure = std::current_exception();
        }
        armed = false;
        if (!failure) return n;
        std::string what;
        try {
            std::rethrow_exception(failure);
        } catch (const attend::resource_error& e) {
            what = e.what();
        } catch (const std::bad_alloc&) {
            what = "a bare std::bad_alloc";
        } catch (const std::exception& e) {
            what = std::string("an unexpected ") + e.what();
        }
        EXPECT_NE(what.find("attend.resource.allocation"), std::string::npos)
            << "allocation " << n << " failed as " << what;
        EXPECT_TRUE(state_of(cache) == before) << "allocation " << n << " failed and changed the cache: " << what;
        EXPECT_EQ(attend_test::consistency_problem(cache), "");
        if (::testing::Test::HasFailure()) return n;
    }
}

#define ATTEND_SKIP_WITHOUT_HOOKS()                                                   \
    if (!hooks_available())                                                           \
    GTEST_SKIP() << "allocations cannot be made to fail here (AddressSanitizer owns " \
                    "malloc, or not glibc)"

bool hooks_available() {
#ifdef ATTEND_TEST_MALLOC_HOOKS
    return true;
#else
    return false;
#endif
}

attend::paged_cache_config small_config() { return attend_test::paged_config(2, 4, 2, 40, 4, 3); }

TEST(PagedCacheAllocation, MultiHeadDecodingThatFailsAfterItsAppendTakesTheAppendBackOut) {
    ATTEND_SKIP_WITHOUT_HOOKS();
    // A windowed cache with a fork, so the failing calls copy a shared block and drop blocks before they fail.
    const attend::multi_head_attention<float> m(attend::mha_config{8, 2}, 1);
    attend::paged_kv_cache<float> cache(small_config());
    const index_t a = cache.add_sequence();
    tensor<float, 3> x(1, 7, 8);
    attend_test::fill_uniform(x, 2);
    attend::mha_options o;
    o.attention.threads = 1;
    (void)m.forward_cached(x, cache, {a}, {7}, o);
    const index_t b = cache.fork(a);
    auto twin = cache;
    tensor<float, 3> next(2, 2, 8);
    attend_test::fill_uniform(next, 3);
    // The argument lists are made before arming: their allocations are the caller's, not the cache's.
    const std::vector<index_t> ids{a, b}, counts{2, 1};
    const int failures = fail_every_allocation(cache, [&] { (void)m.forward_cached(next, cache, ids, counts, o); });
    EXPECT_GT(failures, 10);
    // After all those failures the cache does exactly what its untouched twin does.
    (void)m.forward_cached(next, twin, ids, counts, o);
    EXPECT_TRUE(state_of(cache) == state_of(twin));
}

TEST(PagedCacheAllocation, AppendForkReorderAndAttentionFailWithoutAChange) {
    ATTEND_SKIP_WITHOUT_HOOKS();
    attend::paged_kv_cache<double> cache(small_config());
    const index_t a = cache.add_sequence(), b = cache.add_sequence();
    tensor<double, 4> k(2, 2, 5, 4), v(2, 2, 5, 4), q(2, 2, 5, 4);
    attend_test::fill_uniform(k, 1);
    attend_test::fill_uniform(v, 2);
    attend_test::fill_uniform(q, 3);
    const std::vector<index_t> ids{a, b}, swapped{b, a}, counts{5, 3}, queries{2, 1};
    EXPECT_GT(fail_every_allocation(cache, [&] { cache.append(ids, k, v, counts); }), 0);
    EXPECT_GT(fail_every_allocation(cache, [&] { (void)cache.fork(b); }), 0);
    EXPECT_GT(fail_every_allocation(cache, [&] { cache.reorder(ids, swapped); }), 0);
    EXPECT_GT(fail_every_allocation(cache, [&] { (void)attend::paged_attention(q, cache, ids, queries); }), 0);
}

}  // namespace
