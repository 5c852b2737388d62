// SPDX-License-Identifier: MIT
#pragma once
/// Gradients by finite differences, and the acceptance rule of an analytic gradient against them (double only).

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <attend/tensor.hpp>

namespace attend_test {

/// Central differences with the five-point stencil f'(x) ~ (8 (f(x+h) - f(x-h)) - (f(x+2h) - f(x-2h))) / 12h.
/// Its truncation error is h^4 |f^(5)| / 30, about 3e-12 at h = 3e-3 for inputs of magnitude 1; its rounding
/// error about 1.5 eps |loss| / h ~ 1e-13. A gradient component c is accepted when
/// |analytic - fd| <= 1e-6 * max(|c|, 1e-4): relative error <= 1e-6, and for components below 1e-4 an absolute
/// floor of 1e-10, still a hundred times the stencil's error (the measured worst case is ~1e-13).
constexpr double fd_step = 3e-3;
constexpr double fd_relative = 1e-6;
constexpr double fd_floor = 1e-4;

/// d loss / d x[n] for the `size` values at x, each by the stencil; x is restored after each.
inline std::vector<double> fd_gradient(double* x, attend::index_t size, const std::function<double()>& loss) {
    std::vector<double> g(static_cast<std::size_t>(size));
    for (attend::index_t n = 0; n < size; ++n) {
        const double saved = x[n];
        const auto at = [&](double delta) {
            x[n] = saved + delta;
            return loss();
        };
        const double f1 = at(fd_step), fm1 = at(-fd_step), f2 = at(2 * fd_step), fm2 = at(-2 * fd_step);
        x[n] = saved;
        g[static_cast<std::size_t>(n)] = (8 * (f1 - fm1) - (f2 - fm2)) / (12 * fd_step);
    }
    return g;
}

template <int Rank>
attend::tensor<double, Rank> fd_gradient(attend::tensor<double, Rank>& x, const std::function<double()>& loss) {
    attend::tensor<double, Rank> g(x.dimensions());
    const auto flat = fd_gradient(x.data(), x.size(), loss);
    std::copy(flat.begin(), flat.end(), g.data());
    return g;
}

/// Every analytic[n] within the acceptance rule of fd[n]; reports the first five violations.
inline void expect_close_to_fd(const double* analytic, const double* fd, attend::index_t size,
                               const std::string& what) {
    int reported = 0;
    double worst = 0;
    for (attend::index_t n = 0; n < size; ++n) {
        const double a = analytic[n], f = fd[n];
        const double err = std::abs(a - f), allowed = fd_relative * std::max(std::abs(f), fd_floor);
        worst = std::max(worst, err / allowed);
        if (!(err <= allowed) && reported++ < 5)
            ADD_FAILURE() << what << " element " << n << ": analytic " << a << ", finite difference " << f << ", error "
                          << err << " > " << allowed;
    }
    EXPECT_LE(worst, 1.0) << what;
}

template <int Rank>
void expect_close_to_fd(const attend::tensor<double, Rank>& analytic, const attend::tensor<double, Rank>& fd,
                        const std::string& what) {
    ASSERT_EQ(analytic.size(), fd.size()) << what;
    expect_close_to_fd(analytic.data(), fd.data(), fd.size(), what);
}

/// The loss sum(out * w) of a finite-difference test: its gradient with respect to out is w, the d_out the
/// backward is given.
template <int Rank>
double linear_loss(const attend::tensor<double, Rank>& out, const attend::tensor<double, Rank>& w) {
    double sum = 0;
    for (attend::index_t n = 0; n < out.size(); ++n) sum += out.data()[n] * w.data()[n];
    return sum;
}

}  // namespace attend_test
