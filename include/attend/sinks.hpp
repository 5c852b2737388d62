// SPDX-License-Identifier: MIT
#pragma once
/// Attention sinks (gpt-oss; ONNX Runtime GQA's head_sink, ggml's add_sinks, MLX's sinks): one learned logit per
/// query head that joins every row's softmax denominator but carries no value. With scores s_j of a row and the
/// sink z of its head,
///   p_j = exp(s_j) / (exp(z) + sum_k exp(s_k)),   out = sum_j p_j v_j,   lse = log(exp(z) + sum_k exp(s_k)),
/// so the weights of a row sum to 1 - p_sink, a head can put its attention "nowhere", and lse includes the sink
/// (which is what makes merge_partials exact when exactly one of the merged calls passes the sinks).
/// Gradient: d loss / d z = -sum over (batch, query) of p_sink * rowsum(d_out * out).

#include <cmath>
#include <cstddef>
#include <initializer_list>
#include <limits>
#include <type_traits>
#include <vector>

#include "error.hpp"
#include "tensor.hpp"

namespace attend {

/// The sink logits of a call, `[heads]` (query heads), one per head. Empty: no sinks. Copies the values (a few
/// per call), so it stays valid after the tensor it came from goes away; kept in double, exact for float inputs.
class attention_sinks {
public:
    /// No sinks; empty() is true and the kernels skip them.
    attention_sinks() = default;
    /// From the logits of heads 0, 1, ...
    attention_sinks(std::initializer_list<double> logits) : values_(logits) {}
    /// From a std::vector<float> or std::vector<double> `[heads]`.
    template <class U, std::enable_if_t<std::is_floating_point_v<U>, int> = 0>
    attention_sinks(const std::vector<U>& logits) : values_(logits.begin(), logits.end()) {}  // NOLINT: a conversion
    /// From a rank-1 attend::tensor or TensorMap `[heads]` of a storage type (the module's learnable sinks).
    template <class X, std::enable_if_t<detail::tensor_traits<std::decay_t<X>>::supported &&
                                            detail::tensor_traits<std::decay_t<X>>::rank == 1,
                                        int> = 0>
    attention_sinks(const X& logits)  // NOLINT: a conversion, as from a vector
        : values_(logits.data(), logits.data() + logits.size()) {}

    bool empty() const { return values_.empty(); }                         ///< no sinks
    index_t size() const { return static_cast<index_t>(values_.size()); }  ///< how many logits (heads)
    /// The logit of query head h.
    double operator[](index_t h) const { return values_[static_cast<std::size_t>(h)]; }

    /// One logit per query head, finite also in T (the inputs' scalar type). Throws shape_error
    /// `attend.shape.sinks` for another count and value_error `attend.value.sinks` for NaN, +-inf or a value
    /// beyond T's range.
    template <class T>
    void validate(index_t heads) const {
        if (empty()) return;
        if (size() != heads)
            throw shape_error("attend.shape.sinks",
                              detail::concat("sinks [", size(), "] must have one logit per query head: [", heads, ']'));
        for (index_t h = 0; h < heads; ++h) {
            const double z = (*this)[h];
            if (!std::isfinite(z) || std::abs(z) > static_cast<double>(std::numeric_limits<T>::max()))
                throw value_error("attend.value.sinks",
                                  detail::concat("sink of head ", h, " is ", z, "; sinks must be finite, also as ",
                                                 detail::scalar_name<T>(), ", the scalar type of the inputs"));
        }
    }

private:
    std::vector<double> values_;
};

}  // namespace attend
