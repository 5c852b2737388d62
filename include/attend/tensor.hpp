// SPDX-License-Identifier: MIT
#pragma once
/// Tensor aliases and the strided views attend reads its inputs through.
/// Layout is PyTorch's, row-major: `[batch, heads, query_len, head_dim]`; rank 3 `[batch, len, dim]` is one head.

#include <array>
#include <cstdint>
#include <type_traits>

#include <unsupported/Eigen/CXX11/Tensor>

namespace attend {

/// Sizes, positions and indices: Eigen's, signed.
using index_t = Eigen::Index;

/// The storage types attend reads and writes: `float`, `double`, and the 16-bit `Eigen::half` (IEEE fp16) and
/// `Eigen::bfloat16`, in which inference stacks keep activations and KV caches.
template <class T>
inline constexpr bool is_storage_type_v = std::is_same_v<T, float> || std::is_same_v<T, double> ||
                                          std::is_same_v<T, Eigen::half> || std::is_same_v<T, Eigen::bfloat16>;

/// What a storage type computes in: scores, softmax, P·V and lse of 16-bit storage run in float, so scores past
/// fp16's 65504 stay finite and the output is rounded to 16 bits once, at the end; float and double compute in
/// themselves.
template <class Storage>
struct accumulator_of {
    using type = Storage;  ///< float and double compute in themselves
};
/// fp16 storage computes in float.
template <>
struct accumulator_of<Eigen::half> {
    using type = float;  ///< float
};
/// bfloat16 storage computes in float.
template <>
struct accumulator_of<Eigen::bfloat16> {
    using type = float;  ///< float
};
/// The accumulation type of a storage type: float for float, half and bfloat16; double for double.
template <class Storage>
using accumulator_t = typename accumulator_of<Storage>::type;

/// Row-major tensor, PyTorch's layout: the last axis is contiguous.
template <class T, int Rank>
using tensor = Eigen::Tensor<T, Rank, Eigen::RowMajor>;

/// Read-only view of caller memory in the same layout; nothing is copied.
template <class T, int Rank>
using const_tensor_view = Eigen::TensorMap<const Eigen::Tensor<T, Rank, Eigen::RowMajor>>;

/// Writable view of caller memory, for the `_into` forms.
template <class T, int Rank>
using tensor_view = Eigen::TensorMap<Eigen::Tensor<T, Rank, Eigen::RowMajor>>;

/// A rank-4 strided view `[batch, heads, len, dim]` with a contiguous last axis. Rank-3 inputs get heads = 1;
/// multi-head attention reads heads straight out of its projected `[batch, len, heads * head_dim]` buffers
/// through these strides, with no transpose copy.
template <class T>
struct strided_view {
    T* data = nullptr;                 ///< element [0, 0, 0, 0]
    std::array<index_t, 4> dims{};     ///< batch, heads, len, dim
    std::array<index_t, 4> strides{};  ///< elements; strides[3] == 1
    int rank = 4;                      ///< rank of the tensor the user passed (3 or 4), kept for messages

    /// The first element of row (b, h, i).
    T* row(index_t b, index_t h, index_t i) const { return data + b * strides[0] + h * strides[1] + i * strides[2]; }
    /// Elements the view spans.
    index_t size() const { return dims[0] * dims[1] * dims[2] * dims[3]; }
};

/// Splits a projected `[batch, len, heads * head_dim]` buffer into heads without copying:
/// head h of token i is the slice `[h * head_dim, (h + 1) * head_dim)` of row i.
template <class T>
strided_view<T> split_heads(T* data, index_t batch, index_t len, index_t heads, index_t head_dim) {
    strided_view<T> v;
    v.data = data;
    v.dims = {batch, heads, len, head_dim};
    v.strides = {len * heads * head_dim, head_dim, heads * head_dim, 1};
    v.rank = 4;
    return v;
}

struct q8_0_block;  // quantized_rows.hpp: int8 blocks of an int8 cache
struct q4_0_block;  // quantized_rows.hpp: int4 blocks of an int4 cache

namespace detail {

/// Storage types one attention call may combine: one type throughout, float queries and outputs over 16-bit
/// keys and values (a decoder with an fp16 or bf16 cache), or float or 16-bit queries and outputs over quantized
/// (q8_0, q4_0) keys and values (a model with an int8 or int4 cache). Keys and values always share a type.
template <class Q, class KV>
inline constexpr bool storage_pair_v =
    std::is_same_v<Q, KV> ||
    (std::is_same_v<Q, float> && (std::is_same_v<KV, Eigen::half> || std::is_same_v<KV, Eigen::bfloat16>)) ||
    ((std::is_same_v<Q, float> || std::is_same_v<Q, Eigen::half> ||
      std::is_same_v<Q, Eigen::bfloat16>)&&(std::is_same_v<KV, q8_0_block> || std::is_same_v<KV, q4_0_block>));

/// The static_assert message of every call that takes q, k and v.
#define ATTEND_STORAGE_PAIR_MESSAGE                                                                                 \
    "attend: query, key and value must have one scalar type, or float queries with Eigen::half or Eigen::bfloat16 " \
    "keys and values (of one type), or float, Eigen::half or Eigen::bfloat16 queries with an int8 or int4 cache's " \
    "keys and values"

template <class X>
struct tensor_traits {
    static constexpr bool supported = false;
};

template <class T, int Rank, int Options, class IndexType>
struct tensor_traits<Eigen::Tensor<T, Rank, Options, IndexType>> {
    static constexpr bool supported = true;
    static constexpr bool row_major = (Options & Eigen::RowMajor) != 0;
    static constexpr int rank = Rank;
    using scalar = T;
};

template <class T, int Rank, int Options, class IndexType, int MapOptions, template <class> class MakePointer>
struct tensor_traits<Eigen::TensorMap<Eigen::Tensor<T, Rank, Options, IndexType>, MapOptions, MakePointer>>
    : tensor_traits<Eigen::Tensor<std::remove_const_t<T>, Rank, Options, IndexType>> {};

template <class T, int Rank, int Options, class IndexType, int MapOptions, template <class> class MakePointer>
struct tensor_traits<Eigen::TensorMap<const Eigen::Tensor<T, Rank, Options, IndexType>, MapOptions, MakePointer>>
    : tensor_traits<Eigen::Tensor<std::remove_const_t<T>, Rank, Options, IndexType>> {};

template <class T>
struct tensor_traits<strided_view<T>> {
    static constexpr bool supported = true;
    static constexpr bool row_major = true;
    static constexpr int rank = 4;
    using scalar = std::remove_const_t<T>;
};

template <class X>
using scalar_of = typename tensor_traits<std::decay_t<X>>::scalar;

/// True for the 16-bit storage types, which compute in float.
template <class T>
inline constexpr bool is_16bit_v = std::is_same_v<T, Eigen::half> || std::is_same_v<T, Eigen::bfloat16>;

template <class X>
struct is_strided_view : std::false_type {};
template <class T>
struct is_strided_view<strided_view<T>> : std::true_type {};
/// True for a strided_view (what split_heads returns), false for a tensor or TensorMap.
template <class X>
inline constexpr bool is_strided_view_v = is_strided_view<std::decay_t<X>>::value;

/// Checks at compile time that X is a tensor attend can read without copying.
template <class X>
constexpr void require_row_major_tensor() {
    using traits = tensor_traits<std::decay_t<X>>;
    static_assert(traits::supported,
                  "attend: inputs must be attend::tensor (Eigen::Tensor<T, Rank, Eigen::RowMajor>) or an "
                  "Eigen::TensorMap of one; evaluate Eigen tensor expressions into a tensor first");
    if constexpr (traits::supported) {
        static_assert(traits::row_major,
                      "attend: tensors must be Eigen::RowMajor (PyTorch's layout, last axis contiguous); a "
                      "column-major tensor would read heads and positions transposed");
        static_assert(traits::rank == 3 || traits::rank == 4,
                      "attend: attention inputs are rank 4 [batch, heads, len, dim] or rank 3 [batch, len, dim]");
        static_assert(is_storage_type_v<typename traits::scalar>,
                      "attend: the scalar type must be float, double, Eigen::half or Eigen::bfloat16");
    }
}

/// A dense rank-3 or rank-4 row-major tensor as a rank-4 view over `data`. The strides are products of the
/// dims, taken in unsigned arithmetic: a shape whose products overflow Eigen::Index must reach check_views,
/// which rejects it (attend.shape.overflow), without undefined behaviour on the way.
template <class T, class X>
strided_view<T> dense_view(T* data, const X& x) {
    constexpr int rank = tensor_traits<std::decay_t<X>>::rank;
    strided_view<T> v;
    v.data = data;
    v.rank = rank;
    if constexpr (rank == 4) {
        v.dims = {x.dimension(0), x.dimension(1), x.dimension(2), x.dimension(3)};
    } else {
        v.dims = {x.dimension(0), 1, x.dimension(1), x.dimension(2)};
    }
    const auto u = [](index_t n) { return static_cast<std::uint64_t>(n); };
    v.strides = {static_cast<index_t>(u(v.dims[1]) * u(v.dims[2]) * u(v.dims[3])),
                 static_cast<index_t>(u(v.dims[2]) * u(v.dims[3])), v.dims[3], 1};
    return v;
}

/// A rank-3 or rank-4 row-major tensor, TensorMap or strided_view as a read-only rank-4 strided view.
template <class X>
auto as_view(const X& x) {
    require_row_major_tensor<X>();
    using T = scalar_of<X>;
    if constexpr (std::is_same_v<std::decay_t<X>, strided_view<const T>>) {
        return x;
    } else if constexpr (std::is_same_v<std::decay_t<X>, strided_view<T>>) {
        strided_view<const T> v;
        v.data = x.data;
        v.dims = x.dims;
        v.strides = x.strides;
        v.rank = x.rank;
        return v;
    } else {
        return dense_view<const T>(x.data(), x);
    }
}

/// A writable rank-3 or rank-4 row-major tensor, TensorMap or strided_view as a rank-4 strided view.
template <class X>
auto as_mutable_view(X& x) {
    require_row_major_tensor<X>();
    using T = scalar_of<X>;
    if constexpr (std::is_same_v<std::decay_t<X>, strided_view<T>>) {
        return x;
    } else {
        return dense_view<T>(x.data(), x);
    }
}

}  // namespace detail
}  // namespace attend
