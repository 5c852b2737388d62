// SPDX-License-Identifier: MIT
// The tiled kernel's memory beyond inputs and outputs is O(threads x tile): at query_len = key_len = 16384 it must
// not allocate anything like a query_len x key_len score buffer (1 GiB in float). This binary replaces the global
// operator new / delete to track the peak of bytes allocated during the call (the kernel's workspaces are
// std::vectors), and, outside sanitizer builds, also checks the growth of the process's peak RSS (getrusage),
// which sees every allocator, Eigen's malloc included.

#include <gtest/gtest.h>

#include <sys/resource.h>

#include <malloc.h>

#include <atomic>
#include <cstdlib>
#include <new>

#include <attend/attend.hpp>

#include "support/random.hpp"

#if defined(__SANITIZE_ADDRESS__)
#define ATTEND_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(memory_sanitizer)
#define ATTEND_TEST_SANITIZED 1
#endif
#endif

namespace {

std::atomic<long long> live_bytes{0};
std::atomic<long long> peak_bytes{0};

void note_allocation(void* p) {
    if (!p) return;
    const long long now = live_bytes.fetch_add(static_cast<long long>(malloc_usable_size(p))) +
                          static_cast<long long>(malloc_usable_size(p));
    long long peak = peak_bytes.load();
    while (now > peak && !peak_bytes.compare_exchange_weak(peak, now)) {
    }
}

void note_release(void* p) {
    if (p) live_bytes.fetch_sub(static_cast<long long>(malloc_usable_size(p)));
}

void* allocate(std::size_t n) {
    void* p = std::malloc(n == 0 ? 1 : n);
    if (!p) throw std::bad_alloc();
    note_allocation(p);
    return p;
}

void* allocate_aligned(std::size_t n, std::align_val_t alignment) {
    void* p = nullptr;
    const auto a = std::max(static_cast<std::size_t>(alignment), sizeof(void*));
    if (posix_memalign(&p, a, n == 0 ? 1 : n) != 0) throw std::bad_alloc();
    note_allocation(p);
    return p;
}

void release(void* p) {
    note_release(p);
    std::free(p);
}

long long peak_rss_bytes() {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return static_cast<long long>(u.ru_maxrss) * 1024;  // Linux reports KiB
}

}  // namespace

void* operator new(std::size_t n) { return allocate(n); }
void* operator new[](std::size_t n) { return allocate(n); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
    try {
        return allocate(n);
    } catch (...) {
        return nullptr;
    }
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {
    try {
        return allocate(n);
    } catch (...) {
        return nullptr;
    }
}
void* operator new(std::size_t n, std::align_val_t a) { return allocate_aligned(n, a); }
void* operator new[](std::size_t n, std::align_val_t a) { return allocate_aligned(n, a); }
void operator delete(void* p) noexcept { release(p); }
void operator delete[](void* p) noexcept { release(p); }
void operator delete(void* p, std::size_t) noexcept { release(p); }
void operator delete[](void* p, std::size_t) noexcept { release(p); }
void operator delete(void* p, std::align_val_t) noexcept { release(p); }
void operator delete[](void* p, std::align_val_t) noexcept { release(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { release(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { release(p); }

namespace {

constexpr long long mib = 1024 * 1024;

TEST(TiledMemory, LongSequenceAllocatesNoScoreMatrix) {
    constexpr attend::index_t len = 16384, dim = 64;
    const auto q = attend_test::random_tensor<float>(1, 1, 1, len, dim);
    const auto k = attend_test::random_tensor<float>(2, 1, 1, len, dim);
    const auto v = attend_test::random_tensor<float>(3, 1, 1, len, dim);
    attend::tensor<float, 4> out(1, 1, len, dim);
    attend::tensor<float, 3> lse(1, 1, len);
    out.setZero();
    lse.setZero();
    attend::sdpa_options o;
    o.threads = 2;
    o.kernel = attend::kernel::tiled;

    const long long rss_before = peak_rss_bytes();
    const long long live_before = live_bytes.load();
    peak_bytes.store(live_before);
#if defined(__OPTIMIZE__)
    attend::scaled_dot_product_attention_into(q, k, v, attend::no_mask{}, o, out, nullptr, lse);
#else
    // Unoptimized (debug, sanitizer) builds: the same call shape, with a band mask so it takes seconds, not minutes.
    attend::scaled_dot_product_attention_into(q, k, v, attend::sliding_window(1024, 0, attend::alignment::top_left), o,
                                              out, nullptr, lse);
#endif
    const long long extra = peak_bytes.load() - live_before;
    const long long rss_growth = peak_rss_bytes() - rss_before;

    std::printf("peak bytes allocated during the call: %.2f MiB; peak RSS growth: %.2f MiB\n",
                static_cast<double>(extra) / static_cast<double>(mib),
                static_cast<double>(rss_growth) / static_cast<double>(mib));
    EXPECT_LT(extra, 64 * mib);
    EXPECT_GT(extra, 0);  // the tracking works: the kernel does allocate its workspaces
#if !defined(ATTEND_TEST_SANITIZED)
    EXPECT_LT(rss_growth, 64 * mib);
#endif
    // The result is a real one: every lse is finite, every output row a convex combination of values in [-1, 1).
    for (attend::index_t n = 0; n < lse.size(); ++n) ASSERT_TRUE(std::isfinite(lse.data()[n])) << n;
    for (attend::index_t n = 0; n < out.size(); ++n) ASSERT_LE(std::abs(out.data()[n]), 1.0f) << n;
}

}  // namespace
