// SPDX-License-Identifier: MIT
#pragma once
/// merge_partials: attention over two disjoint key sets combined into attention over their union, exactly,
/// from each part's output and lse (split-KV decoding, ring attention across machines).

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "detail/memory.hpp"
#include "detail/merge_rows.hpp"
#include "detail/widen.hpp"
#include "error.hpp"
#include "tensor.hpp"

namespace attend {

/// Output and lse of attention over some set of keys. Rank is the rank of out (3 or 4); lse has one axis less.
template <class T, int Rank>
struct partial_attention {
    tensor<T, Rank> out;  ///< `[batch, heads, query_len, value_dim]`
    /// `[batch, heads, query_len]` in the accumulation type (float for 16-bit outs); -inf where the part had no
    /// allowed key
    tensor<accumulator_t<T>, Rank - 1> lse;
};

namespace detail {

/// A part of merge_partials: attend::tensor or TensorMap, row-major, of the part's rank and scalar type.
template <class X, class T, int Rank>
constexpr void require_partial() {
    using traits = tensor_traits<std::decay_t<X>>;
    static_assert(traits::supported && !std::is_same_v<std::decay_t<X>, strided_view<T>> &&
                      !std::is_same_v<std::decay_t<X>, strided_view<const T>>,
                  "attend: merge_partials takes attend::tensor or an Eigen::TensorMap of one for out and lse");
    if constexpr (traits::supported) {
        static_assert(traits::row_major, "attend: merge_partials needs Eigen::RowMajor out and lse (PyTorch's layout)");
        static_assert(traits::rank == Rank,
                      "attend: out_a and out_b have one rank (3 or 4), lse_a and lse_b one axis less");
        static_assert(std::is_same_v<typename traits::scalar, T>,
                      "attend: the outs and lses of merge_partials have one scalar type");
    }
}

}  // namespace detail

/// Combines two parts: out = (e^(lse_a - m) out_a + e^(lse_b - m) out_b) / (e^(lse_a - m) + e^(lse_b - m)),
/// lse = m + log(e^(lse_a - m) + e^(lse_b - m)), m = max(lse_a, lse_b). out_a and out_b are `[batch, heads,
/// query_len, value_dim]` (or rank 3), lse_a and lse_b `[batch, heads, query_len]`: attend::tensor or TensorMap
/// views of caller memory, read without copies. A row empty in both parts stays zero with lse -inf. Throws
/// shape_error attend.shape.merge when shapes differ, value_error attend.value.lse on NaN or +inf,
/// resource_error attend.resource.allocation when the result cannot be allocated. The result is a fresh pair of
/// tensors, so it never aliases the parts.
template <class OutA, class LseA, class OutB, class LseB>
auto merge_partials(const OutA& out_a, const LseA& lse_a, const OutB& out_b, const LseB& lse_b) {
    using traits = detail::tensor_traits<std::decay_t<OutA>>;
    static_assert(traits::supported, "attend: merge_partials takes attend::tensor or an Eigen::TensorMap of one");
    using T = typename traits::scalar;
    constexpr int Rank = traits::rank;
    static_assert(Rank == 3 || Rank == 4, "attend: merge_partials takes outputs of rank 3 or 4");
    detail::require_partial<OutA, T, Rank>();
    detail::require_partial<OutB, T, Rank>();
    using Acc = accumulator_t<T>;  // lse is kept in the accumulation type (float for 16-bit outputs)
    detail::require_partial<LseA, Acc, Rank - 1>();
    detail::require_partial<LseB, Acc, Rank - 1>();
    bool same = true;
    // dimensions()[a]: Tensor::dimension takes a std::size_t, TensorMap::dimension an Index.
    const auto &oa = out_a.dimensions(), &ob = out_b.dimensions();
    const auto &la = lse_a.dimensions(), &lb = lse_b.dimensions();
    for (std::size_t a = 0; a < std::size_t(Rank); ++a) same = same && oa[a] == ob[a];
    for (std::size_t a = 0; a + 1 < std::size_t(Rank); ++a) same = same && la[a] == oa[a] && lb[a] == oa[a];
    if (!same)
        throw shape_error("attend.shape.merge",
                          detail::concat("partials differ: out_a ", detail::format_shape(out_a.dimensions()),
                                         ", lse_a ", detail::format_shape(lse_a.dimensions()), ", out_b ",
                                         detail::format_shape(out_b.dimensions()), ", lse_b ",
                                         detail::format_shape(lse_b.dimensions()),
                                         " (lse is out's shape without the value_dim axis)"));
    for (const Acc* lse : {lse_a.data(), lse_b.data()})
        for (index_t n = 0; n < lse_a.size(); ++n) {
            const Acc x = lse[n];
            if (std::isnan(x) || x == std::numeric_limits<Acc>::infinity())
                throw value_error("attend.value.lse",
                                  detail::concat("lse holds ", x, " at flat index ", n, "; it must be finite or -inf"));
        }
    partial_attention<T, Rank> r;
    const char* hint = "The merged out and lse are as large as one part's; split the call over the batch";
    detail::resize_guarded(r.out, out_a.dimensions(), "out", hint);
    detail::resize_guarded(r.lse, lse_a.dimensions(), "lse", hint);
    const index_t dim = out_a.dimension(Rank - 1);
    if constexpr (std::is_same_v<T, Acc>) {
        for (index_t row = 0; row < lse_a.size(); ++row)
            r.lse.data()[row] = detail::merge_row(out_a.data() + row * dim, lse_a.data()[row], out_b.data() + row * dim,
                                                  lse_b.data()[row], r.out.data() + row * dim, dim);
    } else {  // 16-bit outs: each row widened to Acc, merged there, rounded back once
        std::vector<Acc> a, b;
        detail::allocating(
            [&] {
                a.resize(static_cast<std::size_t>(dim));
                b.resize(static_cast<std::size_t>(dim));
            },
            [&] {
                return detail::allocation_text("merge_partials' row buffers", std::array<index_t, 2>{2, dim},
                                               sizeof(Acc));
            },
            "Split the call over the batch");
        for (index_t row = 0; row < lse_a.size(); ++row) {
            detail::widen(out_a.data() + row * dim, dim, a.data());
            detail::widen(out_b.data() + row * dim, dim, b.data());
            r.lse.data()[row] =
                detail::merge_row(a.data(), lse_a.data()[row], b.data(), lse_b.data()[row], a.data(), dim);
            detail::narrow(a.data(), dim, r.out.data() + row * dim);
        }
    }
    return r;
}

}  // namespace attend
