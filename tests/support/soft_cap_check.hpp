// SPDX-License-Identifier: MIT
#pragma once
// The kernels' soft-cap (detail::soft_cap: for float, a degree-4 rational tanh with the cap folded into its
// coefficients) on runs of every length around the packet sizes, so pairs of packets, single packets and the padded
// tail are all reached, over caps from tiny to huge (folded whole, at both ends of that range, and prescaled) and
// scores from 0 to far past the clamp: within four epsilons of the definition in long double, +-inf to +-c, NaN
// kept. A function, not a test, so each instruction set's build runs it (softcap_test.cpp for
// the default target, micro_kernel_test.cpp for every target).

#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <limits>
#include <vector>

#include <attend/detail/score_pipeline.hpp>

#include "random.hpp"

namespace attend_test {

template <class T>
void expect_soft_cap_within_four_epsilons() {
    using attend::index_t;
    using ld = long double;
    // Four epsilons: the float rational is within 3.7 without FMA and 2.5 with it (the rounding of its folded
    // coefficients, of s^2 and of the product included).
    const double bound = 4 * static_cast<double>(std::numeric_limits<T>::epsilon());
    attend_test::rng g(11);
    for (const double cap : {1e-30, 0x1p-20, 0.01, 2.5, 30.0, 50.0, 0x1p20, 3e6, 1e30}) {
        SCOPED_TRACE(cap);
        for (index_t n = 0; n <= 70; ++n) {
            std::vector<T> x(static_cast<std::size_t>(n)), original;
            for (auto& e : x) {
                const double magnitude = std::pow(10.0, g.uniform(-8, 3));  // |s / c| from 1e-8 to 1000
                e = static_cast<T>((g.bernoulli(0.5) ? -1 : 1) * magnitude * cap);
            }
            if (n > 3) x[1] = T(0);
            original = x;
            attend::detail::soft_cap(x.data(), n, static_cast<T>(cap));
            for (index_t j = 0; j < n; ++j) {
                const auto u = static_cast<std::size_t>(j);
                const ld c = static_cast<T>(cap), want = c * std::tanh(static_cast<ld>(original[u]) / c);
                ASSERT_LE(std::abs(static_cast<ld>(x[u]) - want),
                          static_cast<ld>(bound) * std::abs(want) + std::numeric_limits<T>::denorm_min())
                    << "run length " << n << " element " << j << " score " << original[u];
            }
        }
    }
    std::vector<T> special(40, T(1));
    const T inf = std::numeric_limits<T>::infinity();
    for (const index_t j : {index_t(0), index_t(17), index_t(39)}) {  // in a packet pair, a single packet, the tail
        special[static_cast<std::size_t>(j)] = inf;
        special[static_cast<std::size_t>(j + 1 < 40 ? j + 1 : 38)] = -inf;
        special[static_cast<std::size_t>(j > 0 ? j - 1 : 2)] = std::numeric_limits<T>::quiet_NaN();
    }
    const auto before = special;
    attend::detail::soft_cap(special.data(), index_t(40), T(30));
    for (std::size_t j = 0; j < special.size(); ++j) {
        if (std::isnan(before[j])) {
            EXPECT_TRUE(std::isnan(special[j])) << j;
        } else if (std::isinf(before[j])) {
            EXPECT_NEAR(static_cast<double>(special[j]), std::copysign(30.0, before[j]), 30 * bound) << j;
        }
    }
}

}  // namespace attend_test
