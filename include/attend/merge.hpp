#pragma once
/// merge_partials: attention over two disjoint key sets combined into attention over their union, exactly,
/// from each part's output and lse (split-KV decoding, ring attention across machines).

#include <cmath>
#include <limits>

#include "detail/memory.hpp"
#include "detail/merge_rows.hpp"
#include "error.hpp"
#include "tensor.hpp"

namespace attend {

/// Output and lse of attention over some set of keys. Rank is the rank of out (3 or 4); lse has one axis less.
template <class T, int Rank>
struct partial_attention {
    tensor<T, Rank> out;      ///< `[batch, heads, query_len, value_dim]`
    tensor<T, Rank - 1> lse;  ///< `[batch, heads, query_len]`; -inf where the part had no allowed key
};

/// Combines two parts: out = (e^(lse_a - m) out_a + e^(lse_b - m) out_b) / (e^(lse_a - m) + e^(lse_b - m)),
/// lse = m + log(e^(lse_a - m) + e^(lse_b - m)), m = max(lse_a, lse_b). A row empty in both parts stays zero with
/// lse -inf. Throws shape_error attend.shape.merge when shapes differ, value_error attend.value.lse on NaN or +inf,
/// resource_error attend.resource.allocation when the result cannot be allocated. The result is a fresh pair of
/// tensors, so it never aliases the parts.
template <class T, int Rank>
partial_attention<T, Rank> merge_partials(const tensor<T, Rank>& out_a, const tensor<T, Rank - 1>& lse_a,
                                          const tensor<T, Rank>& out_b, const tensor<T, Rank - 1>& lse_b) {
    static_assert(Rank == 3 || Rank == 4, "attend: merge_partials takes outputs of rank 3 or 4");
    bool same = true;
    for (std::size_t a = 0; a < std::size_t(Rank); ++a) same = same && out_a.dimension(a) == out_b.dimension(a);
    for (std::size_t a = 0; a + 1 < std::size_t(Rank); ++a)
        same = same && lse_a.dimension(a) == out_a.dimension(a) && lse_b.dimension(a) == out_a.dimension(a);
    if (!same)
        throw shape_error("attend.shape.merge",
                          detail::concat("partials differ: out_a ", detail::format_shape(out_a.dimensions()),
                                         ", lse_a ", detail::format_shape(lse_a.dimensions()), ", out_b ",
                                         detail::format_shape(out_b.dimensions()), ", lse_b ",
                                         detail::format_shape(lse_b.dimensions()),
                                         " (lse is out's shape without the value_dim axis)"));
    for (const auto* lse : {&lse_a, &lse_b})
        for (index n = 0; n < lse->size(); ++n) {
            const T x = lse->data()[n];
            if (std::isnan(x) || x == std::numeric_limits<T>::infinity())
                throw value_error("attend.value.lse", detail::concat("lse holds ", x, " at flat index ", n,
                                                                     "; it must be finite or -inf"));
        }
    partial_attention<T, Rank> r;
    const char* hint = "The merged out and lse are as large as one part's; split the call over the batch";
    detail::resize_guarded(r.out, out_a.dimensions(), "out", hint);
    detail::resize_guarded(r.lse, lse_a.dimensions(), "lse", hint);
    const index dim = out_a.dimension(Rank - 1);
    for (index row = 0; row < lse_a.size(); ++row)
        r.lse.data()[row] = detail::merge_row(out_a.data() + row * dim, lse_a.data()[row], out_b.data() + row * dim,
                                              lse_b.data()[row], r.out.data() + row * dim, dim);
    return r;
}

}  // namespace attend
