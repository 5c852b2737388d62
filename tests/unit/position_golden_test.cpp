// SPDX-License-Identifier: MIT
// attend/position.hpp against tests/data/positions.json, written by PyTorch (tests/data/generate_goldens.py).
#include <attend/position.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <string>

#include "support/compare.hpp"
#include "support/golden.hpp"

namespace {

using attend::index_t;
using attend_test::max_abs_diff;

constexpr double tolerance = 1e-10;

const attend_test::json& positions() {
    static const attend_test::json doc = attend_test::load_golden("positions.json");
    return doc;
}

void report(const std::string& what, double error) {
    std::cout << "[ golden   ] " << what << ": max abs error " << error << '\n';
}

TEST(PositionGolden, SinusoidalTableMatchesPyTorch) {
    const auto& s = attend_test::member(positions(), "sinusoidal");
    const auto length = attend_test::member(s, "length").get<index_t>();
    const auto dim = attend_test::member(s, "dim").get<index_t>();
    const auto want = attend_test::tensor_at<double, 2>(s, "table");
    ASSERT_EQ(want.dimension(0), length);
    ASSERT_EQ(want.dimension(1), dim);
    const auto got = attend::sinusoidal_positions<double>(length, dim);
    const double error = max_abs_diff(got, want);
    report("sinusoidal [" + std::to_string(length) + "," + std::to_string(dim) + "]", error);
    EXPECT_LE(error, tolerance);
}

TEST(PositionGolden, T5BucketsMatchHuggingFaceExactly) {
    const auto& cases = attend_test::member(attend_test::member(positions(), "t5_relative_position_bucket"), "cases");
    ASSERT_GE(cases.size(), 4u);
    for (const auto& c : cases) {
        const bool bidirectional = attend_test::member(c, "bidirectional").get<bool>();
        const auto num_buckets = attend_test::member(c, "num_buckets").get<index_t>();
        const auto max_distance = attend_test::member(c, "max_distance").get<index_t>();
        const auto rel = attend_test::tensor_at<long long, 1>(c, "relative_position");
        const auto want = attend_test::tensor_at<long long, 1>(c, "bucket");
        ASSERT_EQ(rel.size(), want.size());
        index_t mismatches = 0, max_difference = 0;
        for (index_t k = 0; k < rel.size(); ++k) {
            const index_t got = attend::relative_position_bucket(static_cast<index_t>(rel(k)), bidirectional,
                                                                 num_buckets, max_distance);
            if (got != want(k)) ++mismatches;
            max_difference = std::max<index_t>(max_difference, std::abs(got - static_cast<index_t>(want(k))));
            EXPECT_EQ(got, want(k)) << "relative " << rel(k) << " bidirectional " << bidirectional << " num_buckets "
                                    << num_buckets << " max_distance " << max_distance;
        }
        // Buckets are integers: the error is the number of positions whose bucket differs.
        std::cout << "[ golden   ] T5 buckets " << (bidirectional ? "bidirectional " : "unidirectional ") << num_buckets
                  << '/' << max_distance << ": " << mismatches << " of " << rel.size()
                  << " positions differ (max abs error " << max_difference << ")\n";
    }
}

TEST(PositionGolden, AlibiSlopesMatchTheReferenceGetSlopes) {
    const auto& cases = attend_test::member(attend_test::member(positions(), "alibi_slopes"), "cases");
    ASSERT_GE(cases.size(), 5u);
    for (const auto& c : cases) {
        const auto heads = attend_test::member(c, "heads").get<index_t>();
        const auto want = attend_test::tensor_at<double, 1>(c, "slopes");
        const auto got = attend::alibi_slopes(heads);
        ASSERT_EQ(static_cast<index_t>(got.size()), want.size());
        double error = 0;
        for (index_t h = 0; h < want.size(); ++h)
            error = std::max(error, std::abs(got[static_cast<std::size_t>(h)] - want(h)));
        report("ALiBi slopes, " + std::to_string(heads) + " heads", error);
        EXPECT_LE(error, tolerance) << heads << " heads";
    }
}

TEST(PositionGolden, RotaryMatchesPyTorchForBothLayoutsAndInverseRestoresTheInput) {
    const auto& cases = attend_test::member(attend_test::member(positions(), "rotary"), "cases");
    ASSERT_GE(cases.size(), 8u);
    for (const auto& c : cases) {
        const auto name = attend_test::member(c, "name").get<std::string>();
        const auto layout_name = attend_test::member(c, "layout").get<std::string>();
        ASSERT_TRUE(layout_name == "half_split" || layout_name == "interleaved") << layout_name;
        attend::rotary_embedding rope;
        rope.dim = attend_test::member(c, "dim").get<index_t>();
        rope.base = attend_test::member(c, "base").get<double>();
        rope.layout = layout_name == "half_split" ? attend::rotary_layout::half_split
                                                  : attend::rotary_layout::interleaved;
        const auto offset = attend_test::member(c, "position_offset").get<index_t>();
        const auto x = attend_test::tensor_at<double, 4>(c, "x");
        const auto want = attend_test::tensor_at<double, 4>(c, "out");
        attend::tensor<double, 4> got = x;
        rope.apply(got, offset);
        const double error = max_abs_diff(got, want);
        report("rotary " + name, error);
        EXPECT_LE(error, tolerance) << name;
        rope.apply_inverse(got, offset);
        EXPECT_LE(max_abs_diff(got, x), tolerance) << name << ": apply_inverse after apply";

        // The float path agrees to float precision.
        attend::tensor<float, 4> got_float = x.cast<float>();
        rope.apply(got_float, offset);
        const attend::tensor<double, 4> widened = got_float.cast<double>();
        EXPECT_LE(max_abs_diff(widened, want), 1e-5) << name << " (float)";
    }
}

}  // namespace
