// SPDX-License-Identifier: MIT
// The seed's 3x3 causal example, built as a user of attend builds it: the umbrella header and attend::attend,
// in the examples' style (`using namespace attend;`) next to the C and POSIX headers an ordinary program
// includes, whose global names (POSIX index() among them) must not make attend's names ambiguous.
// Shared by the consumer projects in add_subdirectory/, fetchcontent/ and find_package/, each of which builds it.
#include <attend/attend.hpp>

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include <Eigen/Dense>
#include <cmath>
#include <cstdio>
#include <cstring>

using namespace attend;

int main() {
    const index_t len = 3;
    tensor<float, 3> q(1, len, 2), k(1, len, 2), v(1, len, 1);
    q.setZero();
    k.setZero();
    v(0, 0, 0) = 2.0f;
    v(0, 1, 0) = 4.0f;
    v(0, 2, 0) = 8.0f;
    sdpa_options options;
    options.need_weights = false;
    const auto r = scaled_dot_product_attention(q, k, v, causal(alignment::top_left), options);
    // Equal scores: query i averages the values of keys 0..i.
    const float expected[3] = {2.0f, 3.0f, 14.0f / 3.0f};
    int failures = 0;
    for (index_t i = 0; i < len; ++i) {
        const float got = r.out(0, i, 0);
        if (!(std::fabs(got - expected[i]) <= 1e-5f)) {
            std::fprintf(stderr, "out(0, %d, 0) = %.7g, expected %.7g\n", static_cast<int>(i), got, expected[i]);
            ++failures;
        }
    }
    // A window, a padding rule and an error, named without qualification.
    const auto window = sliding_window(1, 0, alignment::bottom_right) && key_padding({len});
    if (to_string(window, score_shape{1, 1, len, len}).empty()) ++failures;
    try {
        (void)sliding_window_from_config(0, alignment::bottom_right);
        ++failures;
    } catch (const error& e) {
        if (std::strcmp(e.id().c_str(), "attend.mask.window_from_config") != 0) ++failures;
    }
    std::printf("%s\n", failures == 0 ? "attend consumer: ok" : "attend consumer: FAILED");
    return failures == 0 ? 0 : 1;
}
