// SPDX-License-Identifier: MIT
#pragma once
/// A dense mask of any rank from a tensor, for tests that draw the rank at random: rank 2 is built as the
/// `[query_len, key_len]` grid by name (query_key_grid), the other ranks through the broadcasting constructor.

#include <type_traits>

#include <attend/mask.hpp>

namespace attend_test {

/// Mask is attend::allowed_mask, attend::forbidden_mask or attend::additive_mask<V>.
template <class Mask, class Tensor>
Mask dense_mask(const Tensor& t) {
    if constexpr (attend::detail::tensor_traits<Tensor>::rank == 2) return Mask::query_key_grid(t);
    else if constexpr (std::is_same_v<Mask, attend::allowed_mask>) return Mask::true_means_allowed(t);
    else if constexpr (std::is_same_v<Mask, attend::forbidden_mask>) return Mask::true_means_blocked(t);
    else return Mask::from_values(t);
}

}  // namespace attend_test
