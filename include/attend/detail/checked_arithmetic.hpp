// SPDX-License-Identifier: MIT
#pragma once
/// Checked arithmetic on sizes, lengths, counts and offsets. Every such number that reaches attend from a caller is
/// checked non-negative, and every sum or product of them is checked here before it is used as a size, an index or
/// a pointer offset: signed overflow is undefined behaviour, and a wrapped size is a buffer overflow waiting.

#include <array>
#include <cstddef>
#include <initializer_list>
#include <limits>

#include "../error.hpp"
#include "../tensor.hpp"

namespace attend::detail {

/// True when a + b overflows Eigen::Index (either sign).
constexpr bool sum_overflows(index_t a, index_t b) {
    return b > 0 ? a > std::numeric_limits<index_t>::max() - b : a < std::numeric_limits<index_t>::min() - b;
}

/// a - b clamped to Eigen::Index's range: a relative position between hostile absolute ones saturates instead of
/// overflowing (every user of a relative position clamps far distances anyway).
constexpr index_t saturating_difference(index_t a, index_t b) {
    if (b < 0 && a > std::numeric_limits<index_t>::max() + b) return std::numeric_limits<index_t>::max();
    if (b > 0 && a < std::numeric_limits<index_t>::min() + b) return std::numeric_limits<index_t>::min();
    return a - b;
}

/// True when any size is negative.
template <std::size_t N>
constexpr bool any_negative(const std::array<index_t, N>& sizes) {
    for (index_t s : sizes)
        if (s < 0) return true;
    return false;
}

/// True when a size is negative or the sizes' product overflows Eigen::Index.
template <std::size_t N>
constexpr bool sizes_invalid(const std::array<index_t, N>& sizes) {
    index_t product = 1;
    for (index_t s : sizes) {
        if (s < 0) return true;
        if (s != 0 && product > std::numeric_limits<index_t>::max() / s) return true;
        product *= s;
    }
    return false;
}

/// sizes_invalid for sizes given one by one: a negative size counts as an overflow, since no caller may form a
/// product of sizes it has not checked.
template <class... Sizes>
constexpr bool product_overflows(Sizes... sizes) {
    return sizes_invalid(std::array<index_t, sizeof...(Sizes)>{static_cast<index_t>(sizes)...});
}

/// Throws shape_error attend.shape.negative if a size is negative and attend.shape.overflow if their product
/// overflows Eigen::Index; `what` names the tensor ("key", "materialize shape") in the message.
template <std::size_t N>
void require_valid_sizes(const std::array<index_t, N>& sizes, const char* what) {
    if (any_negative(sizes))
        throw shape_error("attend.shape.negative",
                          concat(what, ' ', format_shape(sizes), " has a negative size; sizes must be >= 0"));
    if (sizes_invalid(sizes))
        throw shape_error("attend.shape.overflow",
                          concat(what, ' ', format_shape(sizes), ": the element count overflows Eigen::Index"));
}

/// a + b for a position or length that must stay representable; throws position_error attend.position.overflow
/// naming `what` when it does not.
inline index_t checked_position_sum(index_t a, index_t b, const char* what) {
    if (sum_overflows(a, b))
        throw position_error("attend.position.overflow",
                             concat(what, ": ", a, " + ", b, " overflows Eigen::Index (positions must stay below ",
                                    std::numeric_limits<index_t>::max(), ')'));
    return a + b;
}

}  // namespace attend::detail
