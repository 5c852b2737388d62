// SPDX-License-Identifier: MIT
#pragma once
/// Helpers of the 16-bit storage tests: random tensors rounded to a 16-bit type, the typed-test names of the two
/// types, and the accuracy measure of the targets (error per row relative to the row's largest value).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include <gtest/gtest.h>

#include <attend/tensor.hpp>

#include "support/random.hpp"

namespace attend_test {

/// A tensor `[b, h, len, dim]` of uniform values in [lo, hi), rounded to T.
template <class T>
attend::tensor<T, 4> random16(std::uint64_t seed, attend::index_t b, attend::index_t h, attend::index_t len,
                              attend::index_t dim, double lo = -1, double hi = 1) {
    attend::tensor<float, 4> t(b, h, len, dim);
    fill_uniform(t, seed, lo, hi);
    return t.cast<T>();
}

/// The two 16-bit storage types for typed tests, and their names: "half", "bfloat16".
using storage16_types = ::testing::Types<Eigen::half, Eigen::bfloat16>;
struct storage16_names {
    template <class T>
    static std::string GetName(int) {
        return std::is_same_v<T, Eigen::half> ? "half" : "bfloat16";
    }
};

/// Largest |got - want| over a row of the last axis, relative to the row's largest |want|, over all rows.
template <class T, int R>
double worst_row_error(const attend::tensor<T, R>& got, const attend::tensor<double, R>& want) {
    const attend::index_t dim = want.dimension(R - 1), rows = want.size() / dim;
    double worst = 0;
    for (attend::index_t r = 0; r < rows; ++r) {
        double norm = 0, err = 0;
        for (attend::index_t d = 0; d < dim; ++d) {
            const double w = want.data()[r * dim + d];
            norm = std::max(norm, std::abs(w));
            err = std::max(err, std::abs(static_cast<double>(static_cast<float>(got.data()[r * dim + d])) - w));
        }
        if (norm > 0) worst = std::max(worst, err / norm);
    }
    return worst;
}

}  // namespace attend_test
