// SPDX-License-Identifier: MIT
#pragma once
/// nn.MultiheadAttention's parameters, 1:1: its state_dict under PyTorch's names to a multi_head_attention and
/// back. PyTorch keeps q, k and v stacked in one in_proj_weight `[3E, E]` when kdim == vdim == embed_dim, and as
/// q/k/v_proj_weight otherwise; attend keeps four separate weights (heads side by side in their rows, as PyTorch's).
/// mha.hpp includes this header at its end, so multi_head_attention<T>::from_torch and to_torch keep working
/// wherever mha.hpp is included.

#include <algorithm>
#include <array>
#include <cstddef>
#include <string>

#include "../error.hpp"
#include "../mha.hpp"
#include "../tensor.hpp"

namespace attend {

/// nn.MultiheadAttention's parameters under their PyTorch names (`out_proj.weight` is out_proj_weight). An
/// empty tensor (size 0) is an absent parameter: give in_proj_weight, or q/k/v_proj_weight (PyTorch uses them
/// when kdim or vdim != embed_dim), and the biases only when bias = true.
template <class T>
struct torch_mha_parameters {
    tensor<T, 2> in_proj_weight;   ///< `[3E, E]`, rows q, k, v
    tensor<T, 2> q_proj_weight;    ///< `[heads * head_dim, E]`
    tensor<T, 2> k_proj_weight;    ///< `[kv_heads * head_dim, kdim]`
    tensor<T, 2> v_proj_weight;    ///< `[kv_heads * head_dim, vdim]`
    tensor<T, 1> in_proj_bias;     ///< `[3E]` (q, k, v; `heads*head_dim + 2*kv_heads*head_dim` under GQA)
    tensor<T, 2> out_proj_weight;  ///< out_proj.weight `[E, heads * head_dim]`
    tensor<T, 1> out_proj_bias;    ///< out_proj.bias `[E]`
};

namespace detail {

/// Weights and biases (or their gradients) under PyTorch's names: q, k, v stacked into in_proj_weight when
/// `packed`, else q/k/v_proj_weight; the biases stacked into in_proj_bias unless they are empty.
template <class T>
torch_mha_parameters<T> torch_layout(bool packed, const tensor<T, 2>& wq, const tensor<T, 2>& wk,
                                     const tensor<T, 2>& wv, const tensor<T, 2>& wo, const tensor<T, 1>& bq,
                                     const tensor<T, 1>& bk, const tensor<T, 1>& bv, const tensor<T, 1>& bo) {
    torch_mha_parameters<T> p;
    if (packed) {
        p.in_proj_weight = tensor<T, 2>(wq.dimension(0) + wk.dimension(0) + wv.dimension(0), wq.dimension(1));
        T* w = std::copy(wq.data(), wq.data() + wq.size(), p.in_proj_weight.data());
        w = std::copy(wk.data(), wk.data() + wk.size(), w);
        std::copy(wv.data(), wv.data() + wv.size(), w);
    } else {
        p.q_proj_weight = wq;
        p.k_proj_weight = wk;
        p.v_proj_weight = wv;
    }
    if (bq.size() != 0) {
        p.in_proj_bias = tensor<T, 1>(bq.size() + bk.size() + bv.size());
        T* b = std::copy(bq.data(), bq.data() + bq.size(), p.in_proj_bias.data());
        b = std::copy(bk.data(), bk.data() + bk.size(), b);
        std::copy(bv.data(), bv.data() + bv.size(), b);
        p.out_proj_bias = bo;
    }
    p.out_proj_weight = wo;
    return p;
}

template <class T, int R>
void expect_torch_shape(const tensor<T, R>& t, const std::array<index_t, R>& expected, const char* name,
                        const char* meaning) {
    std::array<index_t, R> got{};
    for (std::size_t a = 0; a < got.size(); ++a) got[a] = t.dimension(a);
    if (got != expected)
        throw shape_error("attend.shape.torch_weight",
                          concat(name, ' ', format_shape(got), t.size() == 0 ? " (missing)" : "", " != expected ",
                                 format_shape(expected), " = ", meaning));
}

template <class T, int R>
void expect_torch_absent(const tensor<T, R>& t, const char* name, const char* why) {
    if (t.size() != 0)
        throw shape_error("attend.shape.torch_weight",
                          concat(name, ' ', format_shape(t.dimensions()), " given, expected none (shape [0]): ", why));
}

/// Every shape of `p` against the module `c` describes (resolved), before anything is copied.
template <class T>
void check_torch_parameters(const mha_config& c, bool packed, const torch_mha_parameters<T>& p) {
    const index_t E = c.model_dim, D = c.model_dim / c.heads;
    const index_t q_rows = c.heads * D, kv_rows = c.kv_heads * D;
    const bool separate = p.q_proj_weight.size() != 0 || p.k_proj_weight.size() != 0 || p.v_proj_weight.size() != 0;
    const auto shape_of = [](const auto& t) { return format_shape(t.dimensions()); };
    if (p.in_proj_weight.size() != 0) {
        if (!packed)
            throw shape_error("attend.shape.torch_weight",
                              concat("in_proj_weight ", shape_of(p.in_proj_weight),
                                     " is only for key_dim == value_dim == model_dim and kv_heads == heads; this "
                                     "config needs q_proj_weight [",
                                     q_rows, ',', E, "], k_proj_weight [", kv_rows, ',', c.key_dim,
                                     "], v_proj_weight [", kv_rows, ',', c.value_dim, ']'));
        if (separate)
            throw shape_error("attend.shape.torch_weight",
                              concat("both in_proj_weight ", shape_of(p.in_proj_weight), " and q/k/v_proj_weight ",
                                     shape_of(p.q_proj_weight), ", ", shape_of(p.k_proj_weight), ", ",
                                     shape_of(p.v_proj_weight), " given; give one form"));
        expect_torch_shape<T, 2>(p.in_proj_weight, {3 * E, E}, "in_proj_weight", "[3 * embed_dim, embed_dim]");
    } else {
        expect_torch_shape<T, 2>(p.q_proj_weight, {q_rows, E}, "q_proj_weight", "[heads * head_dim, embed_dim]");
        expect_torch_shape<T, 2>(p.k_proj_weight, {kv_rows, c.key_dim}, "k_proj_weight", "[kv_heads * head_dim, kdim]");
        expect_torch_shape<T, 2>(p.v_proj_weight, {kv_rows, c.value_dim}, "v_proj_weight",
                                 "[kv_heads * head_dim, vdim]");
    }
    expect_torch_shape<T, 2>(p.out_proj_weight, {E, q_rows}, "out_proj.weight", "[embed_dim, heads * head_dim]");
    if (c.bias) {
        expect_torch_shape<T, 1>(p.in_proj_bias, {q_rows + 2 * kv_rows}, "in_proj_bias",
                                 "[3 * embed_dim] (q, k, v biases)");
        expect_torch_shape<T, 1>(p.out_proj_bias, {E}, "out_proj.bias", "[embed_dim]");
    } else {
        expect_torch_absent(p.in_proj_bias, "in_proj_bias", "mha_config.bias is false");
        expect_torch_absent(p.out_proj_bias, "out_proj.bias", "mha_config.bias is false");
    }
}

}  // namespace detail

/// A multi_head_attention holding nn.MultiheadAttention's parameters 1:1 (see torch_mha_parameters); `config`
/// gives the sizes the state_dict cannot say (heads, kv_heads). Throws what the multi_head_attention constructor
/// throws, and shape_error `attend.shape.torch_weight` naming the parameter and both shapes when one has the wrong
/// shape, is missing, or is given where it has no place (in_proj_weight with kdim/vdim != embed_dim or kv_heads !=
/// heads, both in_proj_weight and q/k/v_proj_weight, a bias with bias = false).
template <class T>
multi_head_attention<T> mha_from_torch(const mha_config& config, const torch_mha_parameters<T>& p) {
    auto m = multi_head_attention<T>::zeros(config);
    detail::check_torch_parameters(m.config(), m.packed(), p);
    // parameters(): q, k, v, out weights, then q, k, v, out biases.
    const auto spans = m.parameters();
    const auto fill = [](const parameter_span<T>& to, const T* from) { std::copy(from, from + to.size, to.data); };
    if (p.in_proj_weight.size() != 0) {
        const T* w = p.in_proj_weight.data();
        for (std::size_t n = 0; n < 3; ++n) {
            fill(spans[n], w);
            w += spans[n].size;
        }
    } else {
        fill(spans[0], p.q_proj_weight.data());
        fill(spans[1], p.k_proj_weight.data());
        fill(spans[2], p.v_proj_weight.data());
    }
    fill(spans[3], p.out_proj_weight.data());
    if (m.config().bias) {
        const T* b = p.in_proj_bias.data();
        for (std::size_t n = 4; n < 7; ++n) {
            fill(spans[n], b);
            b += spans[n].size;
        }
        fill(spans[7], p.out_proj_bias.data());
    }
    return m;
}

/// The parameters of `m` under PyTorch's names, packed exactly when nn.MultiheadAttention would pack them
/// (key_dim == value_dim == model_dim and kv_heads == heads).
template <class T>
torch_mha_parameters<T> mha_to_torch(const multi_head_attention<T>& m) {
    return detail::torch_layout(m.packed(), m.q_weight(), m.k_weight(), m.v_weight(), m.out_weight(), m.q_bias(),
                                m.k_bias(), m.v_bias(), m.out_bias());
}

template <class T>
multi_head_attention<T> multi_head_attention<T>::from_torch(const mha_config& config,
                                                            const torch_mha_parameters<T>& p) {
    return mha_from_torch(config, p);
}

template <class T>
multi_head_attention<T> multi_head_attention<T>::from_torch(const mha_config& config,
                                                            const tensor<T, 2>& in_proj_weight,
                                                            const tensor<T, 1>& in_proj_bias,
                                                            const tensor<T, 2>& out_proj_weight,
                                                            const tensor<T, 1>& out_proj_bias) {
    torch_mha_parameters<T> p;
    p.in_proj_weight = in_proj_weight;
    p.in_proj_bias = in_proj_bias;
    p.out_proj_weight = out_proj_weight;
    p.out_proj_bias = out_proj_bias;
    return mha_from_torch(config, p);
}

template <class T>
multi_head_attention<T> multi_head_attention<T>::from_torch(const mha_config& config, const tensor<T, 2>& q_proj_weight,
                                                            const tensor<T, 2>& k_proj_weight,
                                                            const tensor<T, 2>& v_proj_weight,
                                                            const tensor<T, 1>& in_proj_bias,
                                                            const tensor<T, 2>& out_proj_weight,
                                                            const tensor<T, 1>& out_proj_bias) {
    torch_mha_parameters<T> p;
    p.q_proj_weight = q_proj_weight;
    p.k_proj_weight = k_proj_weight;
    p.v_proj_weight = v_proj_weight;
    p.in_proj_bias = in_proj_bias;
    p.out_proj_weight = out_proj_weight;
    p.out_proj_bias = out_proj_bias;
    return mha_from_torch(config, p);
}

template <class T>
torch_mha_parameters<T> multi_head_attention<T>::to_torch() const {
    return mha_to_torch(*this);
}

}  // namespace attend
