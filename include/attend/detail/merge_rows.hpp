// SPDX-License-Identifier: MIT
#pragma once
/// The per-row formula of merge_partials, shared by merge.hpp and the tiled kernel's split-key decode path, so
/// there is one copy of it.

#include <algorithm>
#include <cmath>
#include <limits>

#include "../tensor.hpp"

namespace attend::detail {

/// Combines the attention rows of two disjoint key sets, a (out_a, lse_a) and b (out_b, lse_b), each `dim` long:
/// out = (e^(lse_a - m) out_a + e^(lse_b - m) out_b) / (e^(lse_a - m) + e^(lse_b - m)), m = max(lse_a, lse_b),
/// and returns lse = m + log(e^(lse_a - m) + e^(lse_b - m)). A row empty in both (both lse -inf) gives a zero row
/// and -inf. `out` may be `out_a` or `out_b` (the update is element by element).
template <class T>
T merge_row(const T* out_a, T lse_a, const T* out_b, T lse_b, T* out, index_t dim) {
    const T m = std::max(lse_a, lse_b);
    if (m == -std::numeric_limits<T>::infinity()) {
        std::fill(out, out + dim, T(0));
        return m;
    }
    const T wa = std::exp(lse_a - m), wb = std::exp(lse_b - m), sum = wa + wb;
    for (index_t d = 0; d < dim; ++d) out[d] = (wa * out_a[d] + wb * out_b[d]) / sum;
    return m + std::log(sum);
}

}  // namespace attend::detail
