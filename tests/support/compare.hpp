// SPDX-License-Identifier: MIT
#pragma once
/// Element-wise comparisons of attend tensors for tests: largest magnitude, largest difference, finiteness and
/// bit equality (the thread-count independence tests need the last).

#include <algorithm>
#include <cmath>

#include <gtest/gtest.h>

#include <attend/tensor.hpp>

namespace attend_test {

template <class T, int R>
double max_abs(const attend::tensor<T, R>& t) {
    double m = 0;
    for (attend::index n = 0; n < t.size(); ++n) m = std::max(m, std::abs(static_cast<double>(t.data()[n])));
    return m;
}

/// Largest |a - b| over the elements; a shape mismatch is a test failure.
template <class T, int R>
double max_abs_diff(const attend::tensor<T, R>& a, const attend::tensor<T, R>& b) {
    EXPECT_EQ(a.dimensions(), b.dimensions());
    double m = 0;
    for (attend::index n = 0; n < std::min(a.size(), b.size()); ++n)
        m = std::max(m, std::abs(static_cast<double>(a.data()[n]) - static_cast<double>(b.data()[n])));
    return m;
}

template <class T, int R>
bool all_finite(const attend::tensor<T, R>& t) {
    for (attend::index n = 0; n < t.size(); ++n)
        if (!std::isfinite(t.data()[n])) return false;
    return true;
}

template <class T, int R>
bool bit_equal(const attend::tensor<T, R>& a, const attend::tensor<T, R>& b) {
    return a.dimensions() == b.dimensions() && std::equal(a.data(), a.data() + a.size(), b.data());
}

}  // namespace attend_test
