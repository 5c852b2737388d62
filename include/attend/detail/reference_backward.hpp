// SPDX-License-Identifier: MIT
#pragma once
/// The reference backward: the oracle the tiled backward is tested against (backward.hpp has the formulas). Per
/// (batch, head) it materializes the scores `[query_len, key_len]` and recomputes the softmax from scratch,
/// reading neither out nor lse; sequential, written for obviousness, independent of the score pipeline.

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

#include <Eigen/Core>

#include "kernel_interface.hpp"
#include "mask_nodes.hpp"
#include "memory.hpp"

namespace attend::detail {

/// Gradients dq, dk, dv (and the score_bias gradient) by the textbook formulas of backward.hpp's file comment, on a
/// type-erased mask, one instance per scalar type.
template <class T>
void reference_gradients(const backward_inputs<T>& in, const attention_shape& s, const mask_tiles& mask,
                         const kernel_params<T>& p, const gradient_outputs<T>& o) {
    const index_t L = s.query_len, S = s.key_len, diagonals = L + S - 1;
    const bool bias = p.bias && !p.bias->empty();
    const bool capped = p.softcap > 0 || p.score_mod;  // a modifier whose slope is not 1: keep the slope
    row_matrix<T> probs, dropped, dp, slope;           // allocated before the first write to an output
    allocating(
        [&] {
            probs.resize(L, S);
            dropped.resize(L, S);
            dp.resize(L, S);
            if (capped) slope.resize(L, S);
        },
        [&] {
            return allocation_text(capped ? "the reference backward's score matrices (4 x query_len x key_len)"
                                          : "the reference backward's score matrices (3 x query_len x key_len)",
                                   std::array<index_t, 3>{capped ? 4 : 3, L, S}, sizeof(T));
        },
        "kernel::reference materializes the scores of one (batch, head); the tiled backward needs O(threads x tile)");
    for (index_t b = 0; b < s.batch; ++b) {
        for (index_t h = 0; h < s.heads; ++h) matrix_of(o.d_query, b, h).setZero();
        for (index_t h = 0; h < s.kv_heads; ++h) {
            matrix_of(o.d_key, b, h).setZero();
            matrix_of(o.d_value, b, h).setZero();
        }
    }
    if (o.d_score_bias && bias) std::fill(o.d_score_bias, o.d_score_bias + s.heads * diagonals, T(0));
    const bool sinks = p.has_sinks() && o.d_sinks;
    if (sinks) std::fill(o.d_sinks, o.d_sinks + s.heads, T(0));
    std::vector<T> sink_probability(sinks ? static_cast<std::size_t>(L) : 0);  // [query_len] of one (batch, head)
    if (L == 0) return;
    const T keep_scale = static_cast<T>(p.dropout.keep_scale);
    for (index_t b = 0; b < s.batch; ++b)
        for (index_t h = 0; h < s.heads; ++h) {
            const index_t kvh = s.kv_head(h);
            const auto q = matrix_of(in.q, b, h), k = matrix_of(in.k, b, kvh), v = matrix_of(in.v, b, kvh);
            const auto d_out = matrix_of(in.d_out, b, h);
            probs.noalias() = q * k.transpose();
            probs *= p.scale;
            if (capped) slope.setOnes();
            if (p.softcap > 0)  // s -> c tanh(s / c), whose derivative is 1 - tanh(s / c)^2
                for (index_t i = 0; i < L; ++i)
                    for (index_t j = 0; j < S; ++j) {
                        const T t = std::tanh(probs(i, j) / p.softcap);
                        probs(i, j) = p.softcap * t;
                        slope(i, j) = 1 - t * t;
                    }
            if (p.score_mod) p.score_mod->apply(tile{b, h, 0, L, 0, S}, probs.data(), S, slope.data());
            if (bias) p.bias->add_tile(h, 0, 0, L, S, L, S, probs.data(), S);
            mask.apply(tile{b, h, 0, L, 0, S}, probs.data(), S);
            for (index_t i = 0; i < L; ++i) {
                auto row = probs.row(i);
                const bool padded = mask.query_padded(b, i);
                const T row_max = padded || S == 0 ? minus_infinity<T>() : row.maxCoeff();
                const T max = p.has_sinks() && !padded ? std::max(row_max, p.sink(h)) : row_max;
                if (sinks) sink_probability[static_cast<std::size_t>(i)] = 0;
                if (max == minus_infinity<T>()) {  // padded query or empty row: constant zero output
                    row.setZero();
                    continue;
                }
                // std::exp: forbidden probabilities must be exactly 0 (see reference_kernel.hpp).
                for (index_t j = 0; j < S; ++j) row(j) = std::exp(row(j) - max);
                const T sink = p.has_sinks() ? std::exp(p.sink(h) - max) : T(0);  // the sink's share, unnormalized
                const T sum = row.sum() + sink;
                row /= sum;
                if (sinks) sink_probability[static_cast<std::size_t>(i)] = sink / sum;
            }
            dropped = probs;
            if (p.dropout.active())
                for (index_t i = 0; i < L; ++i)
                    for (index_t j = 0; j < S; ++j)
                        dropped(i, j) = p.dropout.keep(b, h, i, j) ? probs(i, j) * keep_scale : T(0);
            matrix_of(o.d_value, b, kvh).noalias() += dropped.transpose() * d_out;
            dp.noalias() = d_out * v.transpose();  // d loss / d (dropped weights)
            if (p.dropout.active())
                for (index_t i = 0; i < L; ++i)
                    for (index_t j = 0; j < S; ++j)
                        dp(i, j) = p.dropout.keep(b, h, i, j) ? dp(i, j) * keep_scale : T(0);
            for (index_t i = 0; i < L; ++i) {  // dS = P * (dP - rowsum(P * dP)), in place of dP
                const T delta = probs.row(i).dot(dp.row(i));
                dp.row(i) = (probs.row(i).array() * (dp.row(i).array() - delta)).matrix();
                // The sink is a score whose dP is 0 (it has no value): d sink = p_sink (0 - delta).
                if (sinks) o.d_sinks[h] -= sink_probability[static_cast<std::size_t>(i)] * delta;
            }
            if (o.d_score_bias && bias)
                for (index_t i = 0; i < L; ++i)
                    for (index_t j = 0; j < S; ++j) o.d_score_bias[h * diagonals + j - i + L - 1] += dp(i, j);
            if (capped) dp = (dp.array() * slope.array()).matrix();  // d loss / d (scaled q.k)
            matrix_of(o.d_query, b, h).noalias() = p.scale * (dp * k);
            matrix_of(o.d_key, b, kvh).noalias() += p.scale * (dp.transpose() * q);
        }
}

/// The reference backward for any bound mask: through the one type-erased instance, as the public API's calls go.
template <class T, class Bound>
void reference_backward(const backward_inputs<T>& in, const attention_shape& s, const Bound& mask,
                        const kernel_params<T>& p, const gradient_outputs<T>& o) {
    with_mask_tiles(mask, [&](const mask_tiles& m) { reference_gradients<T>(in, s, m, p, o); });
}

#if defined(ATTEND_KERNEL_INSTANCE)
#define ATTEND_REFERENCE_BACKWARD_INSTANCE(T)                                                             \
    ATTEND_KERNEL_INSTANCE void reference_gradients<T>(const backward_inputs<T>&, const attention_shape&, \
                                                       const mask_tiles&, const kernel_params<T>&,        \
                                                       const gradient_outputs<T>&);
ATTEND_REFERENCE_BACKWARD_INSTANCE(float)
ATTEND_REFERENCE_BACKWARD_INSTANCE(double)
#undef ATTEND_REFERENCE_BACKWARD_INSTANCE
#endif

}  // namespace attend::detail
