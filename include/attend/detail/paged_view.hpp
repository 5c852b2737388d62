// SPDX-License-Identifier: MIT
#pragma once
/// How the kernels and the input scans read the keys and values of a paged cache in place.

#include <algorithm>
#include <array>
#include <cstddef>
#include <string>

#include "../shape.hpp"
#include "../tensor.hpp"
#include "quantized_rows.hpp"

namespace attend::detail {

/// Keys or values `[1, kv_heads, len, dim]` of one sequence of a paged cache (paged_cache.hpp), read in place:
/// row i is row i % block_size of block table[i / block_size]. The pool is `[kv_heads, blocks, block_size, dim]`
/// (of q8_0 blocks, `[..., dim / 32]`: dims[3] counts values, row_units the T that hold them),
/// head-major, so one head's rows of consecutive blocks follow each other: a sequence whose blocks were handed
/// out in order reads as one stream, as a contiguous cache does. Where a run of rows crosses to a block that
/// does not follow, the tiled kernel copies the run into its scratch (the same values either way).
template <class T>
struct paged_view {
    const T* pool = nullptr;         ///< block storage `[kv_heads, pool_blocks, block_size, dim]`
    const index_t* table = nullptr;  ///< the sequence's block table
    std::array<index_t, 4> dims{};   ///< 1, kv_heads, len, dim
    index_t block_size = 1;
    index_t pool_blocks = 1;  ///< blocks per head in the pool
    int rank = 4;

    const T* row(index_t /*batch: always 0*/, index_t h, index_t i) const {
        return pool + ((h * pool_blocks + table[i / block_size]) * block_size + i % block_size) * row_units<T>(dims[3]);
    }
};

/// How many of rows [i, i + n) of a (batch, head) follow row i at row_stride(x), row i included: all of them in a
/// strided view; in a paged view, up to the first block that does not follow the one before it in the pool.
template <class T>
index_t rows_following(const strided_view<T>&, index_t, index_t n) {
    return n;
}
template <class T>
index_t rows_following(const paged_view<T>& x, index_t i, index_t n) {
    index_t b = i / x.block_size, end = (b + 1) * x.block_size;
    while (end < i + n && x.table[b + 1] == x.table[b] + 1) {
        ++b;
        end += x.block_size;
    }
    return std::min(n, end - i);
}

/// True when rows [i, i + n) of a (batch, head), n >= 1, follow each other at row_stride(x): always for a strided
/// view; for a paged view when the blocks they span are consecutive in the pool.
template <class View>
bool rows_contiguous(const View& x, index_t i, index_t n) {
    return rows_following(x, i, n) == n;
}

/// Rows from i on that are packed one after another (row stride == dim), so they copy as one span: to the end
/// of a dense view (one row of a strided one), or of a block.
template <class T>
index_t packed_rows(const strided_view<T>& x, index_t i) {
    return x.strides[2] == x.dims[3] ? x.dims[2] - i : 1;
}
template <class T>
index_t packed_rows(const paged_view<T>& x, index_t i) {
    return x.block_size - i % x.block_size;
}

template <class T>
index_t row_stride(const strided_view<T>& x) {
    return x.strides[2];
}
template <class T>
index_t row_stride(const paged_view<T>& x) {
    return row_units<T>(x.dims[3]);
}

/// Batch row n of x `[batch, heads, len, dim]`, its first `rows` rows: `[1, heads, rows, dim]`.
template <class T>
strided_view<T> batch_rows(const strided_view<T>& x, index_t n, index_t rows) {
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
