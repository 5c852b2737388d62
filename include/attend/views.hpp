// SPDX-License-Identifier: MIT
#pragma once
/// Views into caller memory that the attention calls accept wherever they take a tensor, without copying.

#include "error.hpp"
#include "tensor.hpp"

namespace attend {

/// Positions [begin, end) of the sequence axis of x (`[batch, heads, len, dim]`, or `[batch, len, dim]` for rank
/// 3; an attend::tensor, TensorMap or strided_view) as a read-only strided_view into the same memory. Split-KV
/// decoding passes key ranges of one K and V to separate calls and combines them with merge_partials, and a
/// chunked prefill passes query ranges, neither copying anything. A mask of such a call sees positions relative
/// to `begin` (rules such as causal(alignment::bottom_right) or a key_padding of the range's own lengths say what
/// the range means). Throws shape_error attend.shape.range unless 0 <= begin <= end <= len.
template <class X>
strided_view<const detail::scalar_of<X>> key_range(const X& x, index_t begin, index_t end) {
    auto v = detail::as_view(x);
    if (begin < 0 || end < begin || end > v.dims[2])
        throw shape_error("attend.shape.range",
                          detail::concat("range [", begin, ", ", end, ") of a sequence axis of length ", v.dims[2],
                                         " (needs 0 <= begin <= end <= length)"));
    v.data += begin * v.strides[2];
    v.dims[2] = end - begin;
    return v;
}

}  // namespace attend
