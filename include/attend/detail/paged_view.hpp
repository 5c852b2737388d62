// SPDX-License-Identifier: MIT
#pragma once
/// How the kernels and the input scans read the keys and values of a paged cache in place.

#include <array>
#include <string>

#include "../shape.hpp"
#include "../tensor.hpp"

namespace attend::detail {

/// Keys or values `[1, kv_heads, len, dim]` of one sequence of a paged cache (paged_cache.hpp), read in place:
/// row i is row i % block_size of block table[i / block_size], and a block holds `[kv_heads, block_size, dim]`. Rows are contiguous only within a block, so the tiled kernel maps a run of rows in place when
/// it lies in one block and copies it into its scratch when it crosses a block edge (the same values either way).
template <class T>
struct paged_view {
    const T* pool = nullptr;       ///< block storage `[blocks, kv_heads, block_size, dim]`
    const index* table = nullptr;  ///< the sequence's block table
    std::array<index, 4> dims{};   ///< 1, kv_heads, len, dim
    index block_size = 1;
    int rank = 4;

    const T* row(index /*batch: always 0*/, index h, index i) const {
        return pool + ((table[i / block_size] * dims[1] + h) * block_size + i % block_size) * dims[3];
    }
};

/// Rows from i on that follow row i at row_stride(x): to the end of a strided view, or of a block.
template <class T>
index contiguous_rows(const strided_view<T>& x, index i) {
    return x.dims[2] - i;
}
template <class T>
index contiguous_rows(const paged_view<T>& x, index i) {
    return x.block_size - i % x.block_size;
}
template <class T>
index row_stride(const strided_view<T>& x) {
    return x.strides[2];
}
template <class T>
index row_stride(const paged_view<T>& x) {
    return x.dims[3];
}

/// Batch row n of x `[batch, heads, len, dim]`, its first `rows` rows: `[1, heads, rows, dim]`.
template <class T>
strided_view<T> batch_rows(const strided_view<T>& x, index n, index rows) {
    strided_view<T> v = x;
    v.data = x.data + n * x.strides[0];
    v.dims[0] = 1;
    v.dims[2] = rows;
    return v;
}

template <class T>
std::string spell_view(const paged_view<T>& v) {
    return concat(format_shape(v.dims), " (paged, blocks of ", v.block_size, ")");
}

}  // namespace attend::detail
