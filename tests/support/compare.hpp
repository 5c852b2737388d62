// SPDX-License-Identifier: MIT
#pragma once
/// Element-wise comparisons of attend tensors for tests. What counts as equal is in the name:
///   bit_equal     same dimensions and the same bytes (tells -0 from +0): determinism across thread counts,
///                 kernels and entry points
///   identical     same dimensions and every element == (-0 == +0, a NaN never matches), naming the first mismatch
///   near          same dimensions and every element within an absolute tolerance (equal infinities match)
///   max_abs_diff  largest |a - b|, max_rel_diff the same relative to b's magnitude: +inf for a NaN, a lone
///                 infinity or a shape mismatch, so a tolerance check can never pass by accident
/// and the single-tensor checks max_abs and all_finite.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>

#include <gtest/gtest.h>

#include <attend/tensor.hpp>

namespace attend_test {

/// Largest |element|; NaNs are skipped (a tolerance scaled by it must not become NaN or infinite because of one).
template <class T, int R>
double max_abs(const attend::tensor<T, R>& t) {
    double m = 0;
    for (attend::index_t n = 0; n < t.size(); ++n) m = std::max(m, std::abs(static_cast<double>(t.data()[n])));
    return m;
}

/// Largest |a - b| over the elements, in double (a and b may hold different scalar types, e.g. a float result
/// against a double reference). Equal elements count 0, equal infinities included; a NaN or an infinity facing
/// anything else counts +inf. A shape mismatch is a test failure and gives +inf. With `where`, the flat index and
/// both values of the first largest difference are written there.
template <class A, class B>
double max_abs_diff(const A& a, const B& b, std::string* where = nullptr) {
    EXPECT_EQ(a.dimensions(), b.dimensions());
    if (a.dimensions() != b.dimensions()) {
        if (where) *where = "the shapes differ";
        return std::numeric_limits<double>::infinity();
    }
    double m = 0;
    for (attend::index_t n = 0; n < a.size(); ++n) {
        const double x = static_cast<double>(a.data()[n]), y = static_cast<double>(b.data()[n]);
        if (x == y) continue;
        const double d = std::isnan(x - y) ? std::numeric_limits<double>::infinity() : std::abs(x - y);
        if (d > m) {
            m = d;
            if (where) {
                std::ostringstream s;
                s << "flat index " << n << ": " << x << " vs " << y;
                *where = s.str();
            }
        }
    }
    return m;
}

/// max_abs_diff(a, b) / max(largest finite |b|, floor): the error of a result a against a reference b, relative to
/// the reference's magnitude. The floor keeps a reference that is zero up to rounding from turning a few ulps into
/// a large ratio; floor 0 demands exact agreement where b is all zero. 0 when a and b are equal.
template <class A, class B>
double max_rel_diff(const A& a, const B& b, double floor) {
    const double diff = max_abs_diff(a, b);
    if (diff == 0) return 0;
    double scale = floor;
    for (attend::index_t n = 0; n < b.size(); ++n) {
        const double y = std::abs(static_cast<double>(b.data()[n]));
        if (std::isfinite(y)) scale = std::max(scale, y);
    }
    return scale > 0 ? diff / scale : std::numeric_limits<double>::infinity();
}

template <class T, int R>
bool all_finite(const attend::tensor<T, R>& t) {
    for (attend::index_t n = 0; n < t.size(); ++n)
        if (!std::isfinite(t.data()[n])) return false;
    return true;
}

/// Same dimensions and the same bytes: -0 differs from +0, a NaN equals only a NaN of the same payload.
template <class T, int R>
bool bit_equal(const attend::tensor<T, R>& a, const attend::tensor<T, R>& b) {
    return a.dimensions() == b.dimensions() &&
           (a.size() == 0 || std::memcmp(a.data(), b.data(), static_cast<std::size_t>(a.size()) * sizeof(T)) == 0);
}

/// Same dimensions and every element within `tolerance` of the other (equal infinities match, a NaN never does);
/// tolerance 0 is `identical`. A failure names the first element that is not.
template <class T, int R>
::testing::AssertionResult near(const attend::tensor<T, R>& a, const attend::tensor<T, R>& b, double tolerance) {
    for (std::size_t d = 0; d < static_cast<std::size_t>(R); ++d)
        if (a.dimension(d) != b.dimension(d))
            return ::testing::AssertionFailure()
                   << "dimension " << d << " differs: " << a.dimension(d) << " vs " << b.dimension(d);
    for (attend::index_t n = 0; n < a.size(); ++n) {
        const double x = static_cast<double>(a.data()[n]), y = static_cast<double>(b.data()[n]);
        if (!(x == y || std::abs(x - y) <= tolerance))
            return ::testing::AssertionFailure() << "flat index " << n << ": " << x << " vs " << y << " (|diff| "
                                                 << std::abs(x - y) << ", tolerance " << tolerance << ')';
    }
    return ::testing::AssertionSuccess();
}

/// Same dimensions and every element == (-0 == +0, a NaN never matches). A failure names the first mismatch.
template <class T, int R>
::testing::AssertionResult identical(const attend::tensor<T, R>& a, const attend::tensor<T, R>& b) {
    return near(a, b, 0.0);
}

}  // namespace attend_test
