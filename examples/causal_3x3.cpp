// SPDX-License-Identifier: MIT
// The seed's 3x3 causal example: q = k = 0, so every allowed key scores the same and each query averages the
// values it may see: 2, (2 + 4) / 2 = 3, (2 + 4 + 8) / 3 = 4.66667. A mask with inverted meaning, or a causal
// diagonal in the wrong place, changes these numbers at once.
#include <iomanip>
#include <iostream>

#include <attend/attend.hpp>

int main() {
    attend::tensor<float, 3> q(1, 3, 2), k(1, 3, 2), v(1, 3, 1);  // [batch, len, dim]
    q.setZero();
    k.setZero();
    v.setValues({{{2.f}, {4.f}, {8.f}}});

    const auto rule = attend::causal(attend::alignment::top_left);
    std::cout << "allowed keys (causal, top_left):\n" << attend::to_string(rule, {1, 1, 3, 3});

    attend::sdpa_options options;
    options.need_weights = true;
    const auto r = attend::scaled_dot_product_attention(q, k, v, rule, options);
    std::cout << std::fixed << std::setprecision(5) << "weights:\n";
    for (int i = 0; i < 3; ++i)
        std::cout << "  " << r.weights(0, i, 0) << ' ' << r.weights(0, i, 1) << ' ' << r.weights(0, i, 2) << '\n';
    std::cout << std::defaultfloat << std::setprecision(6) << "out: " << r.out(0, 0, 0) << ' ' << r.out(0, 1, 0) << ' '
              << r.out(0, 2, 0) << '\n';

    // The same rule in nn.MultiheadAttention's convention: true = blocked (the strict upper triangle).
    attend::tensor<bool, 2> blocked(3, 3);
    for (int i = 0; i < 3; ++i)
        for (int j = 0; j < 3; ++j) blocked(i, j) = j > i;
    const auto forbidden = attend::forbidden_mask::query_key_grid(blocked);
    const auto again = attend::scaled_dot_product_attention(q, k, v, attend::to_allowed(forbidden));
    std::cout << "out from forbidden_mask via to_allowed: " << again.out(0, 0, 0) << ' ' << again.out(0, 1, 0) << ' '
              << again.out(0, 2, 0) << '\n';
    const bool identical = again.out(0, 0, 0) == r.out(0, 0, 0) && again.out(0, 1, 0) == r.out(0, 1, 0) &&
                           again.out(0, 2, 0) == r.out(0, 2, 0);
    std::cout << (identical ? "identical: yes\n" : "identical: NO\n");
    return identical ? 0 : 1;
}
