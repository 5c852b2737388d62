// Regression tests of what the fuzzers in tests/fuzz found (docs/fuzzing.md lists each finding). Each input
// that failed is also in the fuzzers' committed corpus; these tests say the same thing in a readable form.
#include <cmath>
#include <limits>

#include <gtest/gtest.h>

#include <attend/attend.hpp>

#include "support/errors.hpp"

namespace {

using attend::index;

/// q, k = 1 and v = 1: every allowed weighting of v gives out = 1, so any saturated bias must still give 1.
template <class T>
struct constant_inputs {
    attend::tensor<T, 4> q{1, 1, 2, 2}, k{1, 1, 3, 2}, v{1, 1, 3, 2};
    constant_inputs() {
        q.setConstant(1);
        k.setConstant(1);
        v.setConstant(1);
    }
};

template <class T, class Mask>
void expect_saturated_rows(const constant_inputs<T>& x, const Mask& mask, index saturated_key) {
    for (const auto kernel : {attend::kernel::reference, attend::kernel::tiled}) {
        attend::sdpa_options o;
        o.kernel = kernel;
        o.need_weights = true;
        o.need_lse = true;
        const auto r = attend::scaled_dot_product_attention(x.q, x.k, x.v, mask, o);
        for (index i = 0; i < 2; ++i) {
            EXPECT_EQ(r.out(0, 0, i, 0), T(1)) << "query " << i;
            EXPECT_TRUE(std::isfinite(r.lse(0, 0, i))) << "query " << i;
        }
        // Query 0 has one key at the top of T's range: it takes all the weight.
        EXPECT_EQ(r.weights(0, 0, 0, saturated_key), T(1));
    }
}

// A finite additive entry above the largest float (a double mask on float inputs) used to become +inf, and
// inf - inf gave NaN (reference) or a zero row (tiled).
TEST(FuzzFindings, DoubleAdditiveAboveFloatRangeSaturates) {
    constant_inputs<float> x;
    attend::tensor<double, 2> bias(2, 3);
    bias.setZero();
    bias(0, 1) = 1e300;
    bias(1, 1) = 1e300;
    bias(1, 2) = 1e300;
    expect_saturated_rows(x, attend::additive_mask<double>::from_values(bias), 1);
}

// Two float max() entries added used to overflow to +inf in the same way.
TEST(FuzzFindings, SumOfLargestFloatsSaturates) {
    constant_inputs<float> x;
    attend::tensor<float, 2> bias(2, 3);
    bias.setZero();
    bias(0, 2) = std::numeric_limits<float>::max();
    bias(1, 0) = std::numeric_limits<float>::max();
    bias(1, 1) = std::numeric_limits<float>::max();
    const auto mask = attend::additive_mask<float>::from_values(bias);
    expect_saturated_rows(x, mask + mask, 2);
}

// A scale finite in double but inf (1e300) or 0 (1e-50) as a float passed the check and made every score inf,
// NaN or 0; it is now the same error as any other bad scale.
TEST(FuzzFindings, ScaleOutsideTheInputScalarTypeIsAnError) {
    constant_inputs<float> x;
    for (const double scale : {1e300, 1e-50}) {
        attend::sdpa_options o;
        o.scale = scale;
        attend_test::expect_error<attend::value_error>(
            [&] { (void)attend::scaled_dot_product_attention(x.q, x.k, x.v, o); }, "attend.value.scale");
    }
    constant_inputs<double> y;
    attend::sdpa_options o;
    o.scale = 1e-50;  // representable in double: accepted
    const auto r = attend::scaled_dot_product_attention(y.q, y.k, y.v, o);
    EXPECT_EQ(r.out(0, 0, 0, 0), 1.0);
}

}  // namespace
