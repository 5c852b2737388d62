// SPDX-License-Identifier: MIT
#pragma once
/// The cases of tests/data/score_features.json (tests/data/generate_goldens.py: PyTorch autograd, FlexAttention's
/// forward) run through attend, both kernels, forward and backward, against the file's values.

#include <algorithm>
#include <string>
#include <type_traits>

#include <gtest/gtest.h>

#include <attend/backward.hpp>
#include <attend/sdpa.hpp>

#include "compare.hpp"
#include "golden.hpp"

namespace attend_test {

/// The case named `name` of score_features.json under `mask` and `options` (plus the case's sinks and softcap
/// when it has them): out, lse, dq, dk, dv (and weights and the sinks' gradient when the case has them) within
/// 1e-12 of the file, relative to the largest magnitude (at least 1), for the reference and the tiled kernel.
template <class Mask>
void expect_score_feature_golden(const std::string& name, const Mask& mask, attend::sdpa_options options) {
    const auto doc = load_golden("score_features.json");
    const auto& c = find_case(doc, name);
    const bool sinks = c.contains("sinks");
    if (sinks) options.sinks = tensor_at<double, 1>(c, "sinks");
    if (const auto cap = to_optional_number(c.at("softcap"))) options.softcap = *cap;
    options.need_weights = c.contains("weights");
    const auto q = tensor_at<double, 4>(c, "q"), k = tensor_at<double, 4>(c, "k"), v = tensor_at<double, 4>(c, "v"),
               d_out = tensor_at<double, 4>(c, "d_out");
    const auto close = [&](const auto& got, const char* key) {
        const auto want = tensor_at<double, std::decay_t<decltype(got)>::NumIndices>(c, key);
        EXPECT_LE(max_abs_diff(got, want), 1e-12 * std::max(1.0, max_abs(want))) << name << ' ' << key;
    };
    for (const auto kernel : {attend::kernel::reference, attend::kernel::tiled}) {
        options.kernel = kernel;
        const auto f = attend::scaled_dot_product_attention(q, k, v, mask, options);
        const auto g = attend::scaled_dot_product_attention_backward(q, k, v, mask, f, d_out, options);
        close(f.out, "out");
        close(f.lse, "lse");
        close(g.d_query, "dq");
        close(g.d_key, "dk");
        close(g.d_value, "dv");
        if (options.need_weights) close(f.weights, "weights");
        if (sinks) close(g.d_sinks, "d_sinks");
    }
}

}  // namespace attend_test
