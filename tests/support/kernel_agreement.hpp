// SPDX-License-Identifier: MIT
#pragma once
/// Tiled against reference on one call, forward and backward: the differential check every score feature's
/// tests run (sinks, packed segments, ...), in one place.

#include <algorithm>
#include <cmath>
#include <vector>

#include <gtest/gtest.h>

#include <attend/backward.hpp>
#include <attend/sdpa.hpp>

#include "compare.hpp"

namespace attend_test {

/// Forward and backward of one double call by the reference kernel, the tiled kernel on 1 thread and on 2.
struct kernel_runs {
    std::vector<attend::attention_result<double, 4>> forward;      ///< reference, tiled x1, tiled x2
    std::vector<attend::attention_gradients<double, 4>> backward;  ///< the same order
};

template <class Mask>
kernel_runs run_every_kernel(const attend::tensor<double, 4>& q, const attend::tensor<double, 4>& k,
                             const attend::tensor<double, 4>& v, const attend::tensor<double, 4>& d_out,
                             const Mask& mask, attend::sdpa_options o) {
    kernel_runs r;
    for (const auto kernel : {attend::kernel::reference, attend::kernel::tiled, attend::kernel::tiled}) {
        o.kernel = kernel;
        o.threads = r.forward.size() == 2 ? 2 : 1;
        r.forward.push_back(attend::scaled_dot_product_attention(q, k, v, mask, o));
        r.backward.push_back(attend::scaled_dot_product_attention_backward(q, k, v, r.forward.back(), d_out, mask, o));
    }
    return r;
}

/// Every output and gradient of the tiled runs within 1e-12 of the reference's, relative to the largest
/// magnitude (at least 1), and the two tiled runs bit-identical.
inline void expect_kernels_agree(const kernel_runs& r) {
    const auto close = [](const auto& a, const auto& b, const char* what) {
        ASSERT_EQ(a.dimensions(), b.dimensions()) << what;
        double largest = 1, worst = 0;  // over finite entries; a -inf lse (a padded query) must match exactly
        for (attend::index n = 0; n < b.size(); ++n) {
            const double x = a.data()[n], y = b.data()[n];
            if (std::isfinite(y)) largest = std::max(largest, std::abs(y));
            worst = std::max(worst, x == y ? 0.0 : std::abs(x - y));
        }
        EXPECT_LE(worst, 1e-12 * largest) << what;
    };
    const auto& f = r.forward;
    const auto& g = r.backward;
    close(f[1].out, f[0].out, "out");
    close(f[1].lse, f[0].lse, "lse");
    close(f[1].weights, f[0].weights, "weights");
    close(g[1].dq, g[0].dq, "dq");
    close(g[1].dk, g[0].dk, "dk");
    close(g[1].dv, g[0].dv, "dv");
    close(g[1].score_bias_gradient, g[0].score_bias_gradient, "score_bias_gradient");
    close(g[1].sink_gradient, g[0].sink_gradient, "sink_gradient");
    EXPECT_TRUE(bit_equal(f[1].out, f[2].out));
    EXPECT_TRUE(bit_equal(g[1].dq, g[2].dq));
    EXPECT_TRUE(bit_equal(g[1].dk, g[2].dk));
    EXPECT_TRUE(bit_equal(g[1].sink_gradient, g[2].sink_gradient));
}

}  // namespace attend_test
