// SPDX-License-Identifier: MIT
#pragma once
/// Backward of multi-head attention: the gradients of a loss with respect to the query, key and value inputs and
/// to every projection weight and bias, given d_out = d loss / d out `[batch, query_len, model_dim]` and what the
/// training forward saved (multi_head_attention::forward(..., saved)). With y = x W^T + b for each projection:
///   out projection:  dWo = d_out^T A,  dbo = colsum(d_out),  dA = d_out Wo    (A = heads side by side)
///   attention:       dQ, dK, dV from scaled_dot_product_attention's tiled backward on the heads of A, Q, K, V
///                    (dropout replayed from its seed; under grouped-query heads dK, dV sum over each group)
///   rotary:          dQ, dK rotated back (rotary_embedding::apply_inverse: a rotation's transpose is its inverse)
///   in projections:  dWq = dQ^T query, dbq = colsum(dQ), d_query = dQ Wq, and so for key and value.
/// Padded queries (query_padding in the mask) have a constant zero output row: their d_out rows are ignored.
/// Self-attention called as forward(x, x, x) has d x = d_query + d_key + d_value.

#include <algorithm>
#include <array>
#include <cstddef>
#include <vector>

#include <Eigen/Core>

#include "backward.hpp"
#include "error.hpp"
#include "mha.hpp"
#include "tensor.hpp"

namespace attend {

/// Gradients of multi-head attention. Parameter gradients have the shape of the parameter (see
/// multi_head_attention); bias gradients are empty for a module without biases.
template <class T>
struct mha_gradients {
    tensor<T, 3> d_query;       ///< `[batch, query_len, model_dim]`
    tensor<T, 3> d_key;         ///< `[batch, key_len, key_dim]`
    tensor<T, 3> d_value;       ///< `[batch, key_len, value_dim]`
    tensor<T, 2> d_q_weight;    ///< `[heads * head_dim, model_dim]`
    tensor<T, 2> d_k_weight;    ///< `[kv_heads * head_dim, key_dim]`
    tensor<T, 2> d_v_weight;    ///< `[kv_heads * head_dim, value_dim]`
    tensor<T, 2> d_out_weight;  ///< `[model_dim, heads * head_dim]`
    tensor<T, 1> d_q_bias;      ///< `[heads * head_dim]`
    tensor<T, 1> d_k_bias;      ///< `[kv_heads * head_dim]`
    tensor<T, 1> d_v_bias;      ///< `[kv_heads * head_dim]`
    tensor<T, 1> d_out_bias;    ///< `[model_dim]`
    tensor<T, 1> d_sinks;       ///< `[heads]`, empty without config.sinks

    /// The parameter gradients as flat storage, in the order of multi_head_attention::parameters().
    std::vector<parameter_span<const T>> parameters() const {
        std::vector<parameter_span<const T>> p{{"q_weight", d_q_weight.data(), d_q_weight.size()},
                                               {"k_weight", d_k_weight.data(), d_k_weight.size()},
                                               {"v_weight", d_v_weight.data(), d_v_weight.size()},
                                               {"out_weight", d_out_weight.data(), d_out_weight.size()}};
        if (d_q_bias.size() != 0) {
            p.push_back({"q_bias", d_q_bias.data(), d_q_bias.size()});
            p.push_back({"k_bias", d_k_bias.data(), d_k_bias.size()});
            p.push_back({"v_bias", d_v_bias.data(), d_v_bias.size()});
            p.push_back({"out_bias", d_out_bias.data(), d_out_bias.size()});
        }
        if (d_sinks.size() != 0) p.push_back({"sinks", d_sinks.data(), d_sinks.size()});
        return p;
    }
};

/// The gradients under PyTorch's parameter names, packed (in_proj_weight) exactly when `module` is: what
/// `param.grad` holds for each parameter of the equivalent nn.MultiheadAttention.
template <class T>
torch_mha_parameters<T> to_torch(const mha_gradients<T>& g, const multi_head_attention<T>& module) {
    return detail::torch_layout(module.packed(), g.d_q_weight, g.d_k_weight, g.d_v_weight, g.d_out_weight, g.d_q_bias,
                                g.d_k_bias, g.d_v_bias, g.d_out_bias);
}

namespace detail {

/// For y `[rows, out]` = x `[rows, in]` w^T + b: dw = dy^T x, db = colsum(dy) (when db is not empty) and, when dx is
/// not null, dx = dy w. Three Eigen GEMMs over all rows at once.
template <class T>
void linear_backward(const T* x, const T* dy, index_t rows, const tensor<T, 2>& w, tensor<T, 2>& dw, tensor<T, 1>& db,
                     T* dx) {
    using matrix = row_matrix<T>;
    const index_t out = w.dimension(0), in = w.dimension(1);
    Eigen::Map<const matrix> xm(x, rows, in), dym(dy, rows, out), wm(w.data(), out, in);
    dw = tensor<T, 2>(out, in);
    Eigen::Map<matrix>(dw.data(), out, in).noalias() = dym.transpose() * xm;
    if (db.size() != 0) Eigen::Map<Eigen::Matrix<T, 1, Eigen::Dynamic>>(db.data(), out) = dym.colwise().sum();
    if (dx) Eigen::Map<matrix>(dx, rows, in).noalias() = dym * wm;
}

/// `saved.<name>` has the expected dims, else shape_error attend.shape.mha_saved.
template <class T>
void check_saved(const tensor<T, 3>& t, const std::array<index_t, 3>& expected, const char* name, const char* meaning) {
    if (t.dimensions() != expected)
        throw shape_error("attend.shape.mha_saved",
                          concat("saved.", name, ' ', format_shape(t.dimensions()), " != expected ",
                                 format_shape(expected), " = ", meaning,
                                 " (pass the mha_saved that forward(query, key, value, mask, options, saved) filled "
                                 "for these inputs)"));
}

}  // namespace detail

/// Gradients of `module.forward(query, key, value, mask, options, saved)` for d_out = d loss / d out
/// `[batch, query_len, model_dim]`. Pass the same module (unchanged since), inputs, mask and options as the
/// forward: dropout is replayed from options.attention.dropout's seed, rotary rotated back at options.position_offset; threads
/// and kernel may differ (kernel::reference is the oracle). Returns the gradients of the three inputs and of every
/// parameter (mha_gradients; for self-attention add d_query + d_key + d_value).
/// Throws before computing anything: what forward throws for these inputs, mask and options; shape_error
/// `attend.shape.mha_d_out` for d_out not `[batch, query_len, model_dim]`, `attend.shape.mha_saved` for a saved
/// state of other shapes (from other inputs or another module); value_error `attend.value.non_finite` for NaN /
/// Inf in d_out (with check_finite).
template <class T, class Q, class K, class V, class Mask, class DOut>
mha_gradients<T> multi_head_attention_backward(const multi_head_attention<T>& module, const Q& query, const K& key,
                                               const V& value, const Mask& mask, const mha_saved<T>& saved,
                                               const DOut& d_out, const mha_options& options = {}) {
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                  "attend: multi_head_attention_backward trains float or double modules; train a float copy of a "
                  "16-bit module (scaled_dot_product_attention_backward takes 16-bit q, k, v)");
    detail::require_mha_mask<Mask>();
    detail::require_mha_input<Q, T>();
    detail::require_mha_input<K, T>();
    detail::require_mha_input<V, T>();
    detail::require_mha_input<DOut, T>();
    const mha_config& c = module.config();
    const auto qd = detail::dims3(query), kd = detail::dims3(key), vd = detail::dims3(value);
    const auto od = detail::dims3(d_out);
    detail::check_mha_inputs(c, qd, kd, vd);
    const index_t B = qd[0], L = qd[1], S = kd[1], E = c.model_dim;
    const index_t H = c.heads, G = c.kv_heads, D = module.head_dim();
    if (od != std::array<index_t, 3>{B, L, E})
        throw shape_error("attend.shape.mha_d_out",
                          detail::concat("d_out ", detail::format_shape(od), " != expected ",
                                         detail::format_shape(std::array<index_t, 3>{B, L, E}),
                                         " = [batch, query_len, model_dim], the shape of forward's out (query ",
                                         detail::format_shape(qd), ')'));
    detail::check_saved(saved.q, {B, L, H * D}, "q", "[batch, query_len, heads * head_dim]");
    detail::check_saved(saved.k, {B, S, G * D}, "k", "[batch, key_len, kv_heads * head_dim]");
    detail::check_saved(saved.v, {B, S, G * D}, "v", "[batch, key_len, kv_heads * head_dim]");
    detail::check_saved(saved.attention, {B, L, H * D}, "attention", "[batch, query_len, heads * head_dim]");
    detail::check_saved(saved.lse, {B, H, L}, "lse", "[batch, heads, query_len]");
    detail::check_layer_options(c, options, options.position_offset);
    if (options.attention.check_finite) {
        detail::check_finite_input(query.data(), qd, "query");
        detail::check_finite_input(key.data(), kd, "key");
        detail::check_finite_input(value.data(), vd, "value");
        detail::check_finite_input(d_out.data(), od, "d_out");
    }

    // Gradient buffers `[batch, len, heads * head_dim]`, seen per head through split_heads like the forward's.
    auto d_attention = detail::mha_buffer<T, 3>({B, L, H * D}, "d attention [batch, query_len, heads * head_dim]");
    auto dq = detail::mha_buffer<T, 3>({B, L, H * D}, "d projected query [batch, query_len, heads * head_dim]");
    auto dk = detail::mha_buffer<T, 3>({B, S, G * D}, "d projected key [batch, key_len, kv_heads * head_dim]");
    auto dv = detail::mha_buffer<T, 3>({B, S, G * D}, "d projected value [batch, key_len, kv_heads * head_dim]");
    detail::backward_inputs<T> in;
    in.q = split_heads(saved.q.data(), B, L, H, D);
    in.k = split_heads(saved.k.data(), B, S, G, D);
    in.v = split_heads(saved.v.data(), B, S, G, D);
    in.out = split_heads(saved.attention.data(), B, L, H, D);
    in.d_out = split_heads(static_cast<const T*>(d_attention.data()), B, L, H, D);
    in.lse = saved.lse.data();
    in.lse_dims = {B, H, L};
    detail::gradient_outputs<T> grads;
    grads.d_query = split_heads(dq.data(), B, L, H, D);
    grads.d_key = split_heads(dk.data(), B, S, G, D);
    grads.d_value = split_heads(dv.data(), B, S, G, D);

    mha_gradients<T> g;
    g.d_sinks = tensor<T, 1>(module.sinks().size());
    g.d_sinks.setZero();  // stays 0 when no query reads a key
    if (g.d_sinks.size() != 0) grads.d_sinks = g.d_sinks.data();
    // Named: the checked call keeps pointers into its options (the score_bias) until the kernels ran.
    const sdpa_options attention = detail::sdpa_options_for(options, module.sinks());
    detail::with_key_padding(mask, options.key_padding, B, S, [&](const auto& full_mask) {
        const auto checked = detail::check_backward(in, &grads, full_mask, attention);
        // Everything is checked: from here on nothing throws but allocation.
        // A padded query's output row is the constant 0, so its d_out row reaches nothing.
        auto d_y = detail::mha_buffer<T, 3>({B, L, E}, "d out [batch, query_len, model_dim]");
        std::copy(d_out.data(), d_out.data() + d_y.size(), d_y.data());
        for (index_t b = 0; b < B; ++b)
            for (index_t i = 0; i < L; ++i)
                if (checked.call.mask.query_padded(b, i)) {
                    T* row = d_y.data() + (b * L + i) * E;
                    std::fill(row, row + E, T(0));
                }
        g.d_out_bias = tensor<T, 1>(module.out_bias().size());
        detail::linear_backward(saved.attention.data(), d_y.data(), B * L, module.out_weight(), g.d_out_weight,
                                g.d_out_bias, d_attention.data());
        if (B * L > 0) {
            detail::run_backward(in, checked, grads);
        } else {  // no query reads any key
            dk.setZero();
            dv.setZero();
        }
    });
    if (options.rotary) {
        options.rotary->apply_inverse(split_heads(dq.data(), B, L, H, D), options.position_offset);
        options.rotary->apply_inverse(split_heads(dk.data(), B, S, G, D), options.position_offset);
    }
    g.d_query = detail::mha_buffer<T, 3>({B, L, E}, "d_query [batch, query_len, model_dim]");
    g.d_key = detail::mha_buffer<T, 3>(kd, "d_key [batch, key_len, key_dim]");
    g.d_value = detail::mha_buffer<T, 3>(vd, "d_value [batch, key_len, value_dim]");
    g.d_q_bias = tensor<T, 1>(module.q_bias().size());
    g.d_k_bias = tensor<T, 1>(module.k_bias().size());
    g.d_v_bias = tensor<T, 1>(module.v_bias().size());
    detail::linear_backward(query.data(), dq.data(), B * L, module.q_weight(), g.d_q_weight, g.d_q_bias,
                            g.d_query.data());
    detail::linear_backward(key.data(), dk.data(), B * S, module.k_weight(), g.d_k_weight, g.d_k_bias, g.d_key.data());
    detail::linear_backward(value.data(), dv.data(), B * S, module.v_weight(), g.d_v_weight, g.d_v_bias,
                            g.d_value.data());
    return g;
}

/// multi_head_attention_backward without a mask (besides options.key_padding).
template <class T, class Q, class K, class V, class DOut>
mha_gradients<T> multi_head_attention_backward(const multi_head_attention<T>& module, const Q& query, const K& key,
                                               const V& value, const mha_saved<T>& saved, const DOut& d_out,
                                               const mha_options& options = {}) {
    return multi_head_attention_backward(module, query, key, value, no_mask{}, saved, d_out, options);
}

}  // namespace attend
