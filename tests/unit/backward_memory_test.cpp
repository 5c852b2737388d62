// SPDX-License-Identifier: MIT
// Memory of the tiled backward (attend/detail/tiled_backward.hpp): at query_len = key_len = 16384 (one head,
// head_dim 64, float) a query x key buffer would take 1 GiB; the backward must stay within 64 MiB beyond its inputs and
// outputs.
//
// This binary counts every heap byte: it replaces the global operator new / delete (std::vector, std::string,
// shared_ptr) and, because Eigen allocates its matrices with std::malloc rather than operator new, also
// interposes glibc's malloc family, forwarding to __libc_malloc & co. Sizes come from malloc_usable_size, so
// frees need no bookkeeping. Under AddressSanitizer (which owns malloc) and off glibc the test is skipped.
#include <attend/backward.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <new>
#include <vector>

#include "support/malloc_hooks.hpp"

#ifdef ATTEND_TEST_MALLOC_HOOKS

namespace {

/// Bytes currently allocated and the peak since the last reset, over all threads.
struct heap_counter {
    std::atomic<std::int64_t> current{0};
    std::atomic<std::int64_t> peak{0};

    void allocated(void* p) {
        if (!p) return;
        const auto n = static_cast<std::int64_t>(malloc_usable_size(p));
        const std::int64_t now = current.fetch_add(n, std::memory_order_relaxed) + n;
        std::int64_t seen = peak.load(std::memory_order_relaxed);
        while (now > seen && !peak.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
        }
    }
    void released(void* p) {
        if (p) current.fetch_sub(static_cast<std::int64_t>(malloc_usable_size(p)), std::memory_order_relaxed);
    }
    /// Starts a measurement: returns the bytes allocated now, the baseline of the peak.
    std::int64_t reset() {
        const std::int64_t now = current.load();
        peak.store(now);
        return now;
    }
};

heap_counter& counter() {
    static heap_counter c;  // constant-initialized: usable before main and from the allocator hooks
    return c;
}

}  // namespace

extern "C" {
void* malloc(std::size_t n) noexcept {
    void* p = __libc_malloc(n);
    counter().allocated(p);
    return p;
}
void* calloc(std::size_t count, std::size_t n) noexcept {
    void* p = __libc_calloc(count, n);
    counter().allocated(p);
    return p;
}
void* realloc(void* old, std::size_t n) noexcept {
    const auto before = old ? static_cast<std::int64_t>(malloc_usable_size(old)) : 0;
    void* p = __libc_realloc(old, n);
    if (p || n == 0) {
        counter().current.fetch_sub(before, std::memory_order_relaxed);
        counter().allocated(p);
    }
    return p;
}
void* memalign(std::size_t alignment, std::size_t n) noexcept {
    void* p = __libc_memalign(alignment, n);
    counter().allocated(p);
    return p;
}
void free(void* p) noexcept {
    counter().released(p);
    __libc_free(p);
}
}

namespace {

using attend::index_t;
using attend::tensor;

constexpr double mib = 1024.0 * 1024.0;

void fill(tensor<float, 4>& t, std::uint64_t seed) {
    for (index_t n = 0; n < t.size(); ++n) {
        seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
        t.data()[n] = static_cast<float>(static_cast<double>(seed >> 40) / static_cast<double>(1ULL << 24) * 2 - 1);
    }
}

TEST(BackwardMemory, CounterSeesEigenAndOperatorNew) {
    const std::int64_t base = counter().reset();
    {
        Eigen::MatrixXf m(1024, 1024);  // std::malloc inside Eigen
        m.setZero();
        std::vector<float> v(1 << 20);  // operator new
        EXPECT_GE(counter().peak.load() - base, static_cast<std::int64_t>(8 * mib));
    }
    EXPECT_LE(counter().current.load() - base, static_cast<std::int64_t>(mib / 16));
}

/// q, k, v, out and d_out hold arbitrary values in [-1, 1) and lse is a constant: allocation does not depend on
/// the values (only P = exp(s - lse) must stay finite, and s <= 64 / 8 here), and skipping the forward pass keeps
/// the test to one backward call.
TEST(BackwardMemory, NoQueryByKeyBuffer) {
    const index_t L = 16384, S = 16384, D = 64;
    tensor<float, 4> q(1, 1, L, D), k(1, 1, S, D), v(1, 1, S, D), out(1, 1, L, D), d_out(1, 1, L, D);
    fill(q, 1);
    fill(k, 2);
    fill(v, 3);
    fill(out, 4);
    fill(d_out, 5);
    tensor<float, 3> lse(1, 1, L);
    lse.setConstant(static_cast<float>(std::log(static_cast<double>(S)) + 8));
    attend::sdpa_options options;
    options.threads = 2;
    options.check_finite = false;

    const std::int64_t base = counter().reset();
    const auto g = attend::scaled_dot_product_attention_backward(q, k, v, attend::causal(attend::alignment::top_left),
                                                                 out, lse, d_out, options);
    const double peak = static_cast<double>(counter().peak.load() - base) / mib;
    const double outputs = static_cast<double>((g.d_query.size() + g.d_key.size() + g.d_value.size()) * 4) / mib;
    std::cout << "[memory] backward L = S = 16384, D = 64, float: peak " << peak << " MiB allocated during the call, "
              << outputs << " MiB of it the returned gradients; a query x key float buffer would be "
              << static_cast<double>(L * S * 4) / mib << " MiB\n";
    EXPECT_LT(peak - outputs, 64.0);
    EXPECT_TRUE(std::isfinite(g.d_query(0, 0, L - 1, 0)) && std::isfinite(g.d_key(0, 0, 0, 0)));

    // The _into form allocates only scratch.
    tensor<float, 4> dq(q.dimensions()), dk(k.dimensions()), dv(v.dimensions());
    const std::int64_t base_into = counter().reset();
    attend::scaled_dot_product_attention_backward_into(q, k, v, attend::causal(attend::alignment::bottom_right), out,
                                                       lse, d_out, options, dq, dk, dv);
    const double peak_into = static_cast<double>(counter().peak.load() - base_into) / mib;
    std::cout << "[memory] backward_into: peak " << peak_into << " MiB\n";
    EXPECT_LT(peak_into, 64.0);
}

/// 16-bit inputs are read in place, a tile at a time: beyond the returned gradients the call allocates the one
/// float dq it rounds from and the workers' scratch, where float copies of q, k, v, out and d_out would take 20 MiB
/// here (and float gradients 12 MiB more); with float gradients on request, only the scratch.
TEST(BackwardMemory, SixteenBitInputsAreReadInPlaceNotCopiedToFloat) {
    using bf16 = Eigen::bfloat16;
    const index_t H = 16, L = 1024, S = 1024, D = 64;  // 16 heads: one key chunk each, no dq partials
    tensor<float, 4> source(1, H, L, D);
    tensor<bf16, 4> q(1, H, L, D), k(1, H, S, D), v(1, H, S, D), out(1, H, L, D), d_out(1, H, L, D);
    std::uint64_t seed = 11;
    for (auto* x : {&q, &k, &v, &out, &d_out}) {
        fill(source, seed++);
        *x = source.cast<bf16>();
    }
    tensor<float, 3> lse(1, H, L);
    lse.setConstant(static_cast<float>(std::log(static_cast<double>(S)) + 8));
    attend::sdpa_options options;
    options.threads = 2;
    options.check_finite = false;
    const double float_copy = static_cast<double>(q.size() * 4) / mib, scratch = 2.0;

    const std::int64_t base = counter().reset();
    const auto g = attend::scaled_dot_product_attention_backward(q, k, v, attend::no_mask{}, out, lse, d_out, options);
    const double peak = static_cast<double>(counter().peak.load() - base) / mib;
    const double outputs = static_cast<double>((g.d_query.size() + g.d_key.size() + g.d_value.size()) * 2) / mib;
    std::cout << "[memory] backward of bf16 inputs, 16 heads, L = S = 1024, D = 64: peak " << peak
              << " MiB allocated during the call, " << outputs << " MiB of it the returned gradients\n";
    EXPECT_LT(peak - outputs, float_copy + scratch);

    tensor<float, 4> dq(q.dimensions()), dk(k.dimensions()), dv(v.dimensions());
    const std::int64_t base_into = counter().reset();
    attend::scaled_dot_product_attention_backward_into(q, k, v, attend::no_mask{}, out, lse, d_out, options, dq, dk,
                                                       dv);
    const double peak_into = static_cast<double>(counter().peak.load() - base_into) / mib;
    std::cout << "[memory] backward_into float gradients of bf16 inputs: peak " << peak_into << " MiB\n";
    EXPECT_LT(peak_into, scratch);
    EXPECT_TRUE(std::isfinite(dq(0, 3, 7, 1)) &&
                static_cast<float>(g.d_query(0, 3, 7, 1)) == static_cast<float>(bf16(dq(0, 3, 7, 1))));
}

}  // namespace

#else

TEST(BackwardMemory, NoQueryByKeyBuffer) { GTEST_SKIP() << "heap counting needs glibc and no AddressSanitizer"; }

#endif
