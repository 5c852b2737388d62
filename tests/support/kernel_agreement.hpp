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
        r.backward.push_back(attend::scaled_dot_product_attention_backward(q, k, v, mask, r.forward.back(), d_out, o));
    }
    return r;
}

/// Every output and gradient of the tiled runs within 1e-12 of the reference's, relative to the largest
/// magnitude (at least 1), and the two tiled runs bit-identical.
inline void expect_kernels_agree(const kernel_runs& r) {
    const auto close = [](const auto& a, const auto& b, const char* what) {
        ASSERT_EQ(a.dimensions(), b.dimensions()) << what;
        double largest = 1, worst = 0;  // over finite entries; a -inf lse (a padded query) must match exactly
        for (attend::index_t n = 0; n < b.size(); ++n) {
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
    close(g[1].d_query, g[0].d_query, "dq");
    close(g[1].d_key, g[0].d_key, "dk");
    close(g[1].d_value, g[0].d_value, "dv");
    close(g[1].d_score_bias, g[0].d_score_bias, "d_score_bias");
    close(g[1].d_sinks, g[0].d_sinks, "d_sinks");
    EXPECT_TRUE(bit_equal(f[1].out, f[2].out));
    EXPECT_TRUE(bit_equal(g[1].d_query, g[2].d_query));
    EXPECT_TRUE(bit_equal(g[1].d_key, g[2].d_key));
    EXPECT_TRUE(bit_equal(g[1].d_sinks, g[2].d_sinks));
}

}  // namespace attend_test
