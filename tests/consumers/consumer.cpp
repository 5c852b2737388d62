// SPDX-License-Identifier: MIT
// The seed's 3x3 causal example, built as a user of attend builds it: the umbrella header and attend::attend.
// Shared by the consumer projects in add_subdirectory/, fetchcontent/ and find_package/, each of which builds it.
#include <attend/attend.hpp>

#include <cmath>
#include <cstdio>

int main() {
    attend::tensor<float, 3> q(1, 3, 2), k(1, 3, 2), v(1, 3, 1);
    q.setZero();
    k.setZero();
    v(0, 0, 0) = 2.0f;
    v(0, 1, 0) = 4.0f;
    v(0, 2, 0) = 8.0f;
    auto r = attend::scaled_dot_product_attention(q, k, v, attend::causal(attend::alignment::top_left));
    // Equal scores: query i averages the values of keys 0..i.
    const float expected[3] = {2.0f, 3.0f, 14.0f / 3.0f};
    int failures = 0;
    for (int i = 0; i < 3; ++i) {
        const float got = r.out(0, i, 0);
        if (!(std::fabs(got - expected[i]) <= 1e-5f)) {
            std::fprintf(stderr, "out(0, %d, 0) = %.7g, expected %.7g\n", i, got, expected[i]);
            ++failures;
        }
    }
    std::printf("%s\n", failures == 0 ? "attend consumer: ok" : "attend consumer: FAILED");
    return failures == 0 ? 0 : 1;
}
