// SPDX-License-Identifier: MIT
#pragma once
/// The reference kernel: materializes the scores of one (batch, head) `[query_len, key_len]`, masks them, takes a
/// max-subtracted softmax along the key axis and multiplies by V. It is the oracle the fast kernel is tested
/// against, so it is written for obviousness, not speed.

#include <algorithm>
#include <cmath>
#include <limits>

#include <Eigen/Core>

#include "../score_bias.hpp"
#include "../shape.hpp"
#include "dropout.hpp"
#include "kernel_interface.hpp"
#include "mask_nodes.hpp"
#include "memory.hpp"

namespace attend::detail {

/// The oracle on a type-erased mask, one instance per scalar type.
template <class T>
void reference_forward(const strided_view<const T>& q, const strided_view<const T>& k, const strided_view<const T>& v,
                       const attention_shape& s, const mask_tiles& mask, const kernel_params<T>& p,
                       const attention_outputs<T>& o) {
    const index_t L = s.query_len, S = s.key_len;
    row_matrix<T> scores =
        allocating([&] { return row_matrix<T>(L, S); },
                   [&] {
                       return allocation_text("the reference kernel's scores", std::array<index_t, 2>{L, S}, sizeof(T));
                   },
                   "kernel::reference materializes the scores [query_len, key_len] of one "
                   "(batch, head); kernel::tiled needs O(threads x tile)");
    for (index_t b = 0; b < s.batch; ++b)
        for (index_t h = 0; h < s.heads; ++h) {
            const index_t kvh = s.kv_head(h);
            auto out = matrix_of(o.out, b, h);
            if (L == 0) continue;
            scores.noalias() = matrix_of(q, b, h) * matrix_of(k, b, kvh).transpose();
            scores *= p.scale;
            if (p.softcap > 0) scores = scores.unaryExpr([&](T x) { return p.softcap * std::tanh(x / p.softcap); });
            if (p.score_mod) p.score_mod->apply(tile{b, h, 0, L, 0, S}, scores.data(), S, nullptr);
            if (p.bias && !p.bias->empty()) p.bias->add_tile(h, 0, 0, L, S, L, S, scores.data(), S);
            mask.apply(tile{b, h, 0, L, 0, S}, scores.data(), S);
            for (index_t i = 0; i < L; ++i) {
                auto row = scores.row(i);
                const bool padded = mask.query_padded(b, i);
                const T row_max = padded || S == 0 ? -std::numeric_limits<T>::infinity() : row.maxCoeff();
                // A sink is one more score in the denominator (sinks.hpp); it makes an empty row's mass all sink.
                const T max = p.has_sinks() && !padded ? std::max(row_max, p.sink(h)) : row_max;
                T* lse = o.lse ? o.lse + (b * s.heads + h) * L + i : nullptr;
                T* weights = o.weights ? o.weights + ((b * s.heads + h) * L + i) * S : nullptr;
                if (max == -std::numeric_limits<T>::infinity()) {  // padded query, or empty row under the zero policy
                    row.setZero();
                    if (lse) *lse = max;
                    if (weights) std::fill(weights, weights + S, T(0));
                    continue;
                }
                // std::exp, not Eigen's vectorized exp: that one returns ~3e-39 for -inf in some builds, and a
                // forbidden weight must be exactly 0.
                for (index_t j = 0; j < S; ++j) row(j) = std::exp(row(j) - max);
                const T sum = row.sum() + (p.has_sinks() ? std::exp(p.sink(h) - max) : T(0));
                if (lse) *lse = max + std::log(sum);
                row /= sum;
                if (weights && !p.weights_after_dropout) std::copy(row.data(), row.data() + S, weights);
                if (p.dropout.active())
                    for (index_t j = 0; j < S; ++j)
                        row(j) = p.dropout.keep(b, h, i, j) ? row(j) * static_cast<T>(p.dropout.keep_scale) : T(0);
                if (weights && p.weights_after_dropout) std::copy(row.data(), row.data() + S, weights);
            }
            out.noalias() = scores * matrix_of(v, b, kvh);
        }
}

/// The reference kernel for any bound mask: through the one type-erased instance, as the public API's calls go.
template <class T, class Bound>
void reference_attention(const strided_view<const T>& q, const strided_view<const T>& k, const strided_view<const T>& v,
                         const attention_shape& s, const Bound& mask, const kernel_params<T>& p,
                         const attention_outputs<T>& o) {
    with_mask_tiles(mask, [&](const mask_tiles& m) { reference_forward<T>(q, k, v, s, m, p, o); });
}

#if defined(ATTEND_KERNEL_INSTANCE)
#define ATTEND_REFERENCE_FORWARD_INSTANCE(T)                                                                     \
    ATTEND_KERNEL_INSTANCE void reference_forward<T>(const strided_view<const T>&, const strided_view<const T>&, \
                                                     const strided_view<const T>&, const attention_shape&,       \
                                                     const mask_tiles&, const kernel_params<T>&,                 \
                                                     const attention_outputs<T>&);
ATTEND_REFERENCE_FORWARD_INSTANCE(float)
ATTEND_REFERENCE_FORWARD_INSTANCE(double)
#undef ATTEND_REFERENCE_FORWARD_INSTANCE
#endif

}  // namespace attend::detail
