// SPDX-License-Identifier: MIT
// 16-bit storage against tests/data/storage16.json, written by tests/data/generate_goldens.py with PyTorch:
// float32 sources, their fp16 / bf16 bits as PyTorch rounds them, float64 attention on the rounded values
// (cross-checked there against PyTorch's SDPA in float64), and PyTorch's own 16-bit CPU attention. The invariants:
// - attend rounds float to half and bfloat16 as PyTorch does, bit for bit;
// - attend's 16-bit attention is within the accuracy target of the float64 result on the same rounded inputs
//   (bf16 2^-7, fp16 2^-10 of each row's largest magnitude), fp16 scores beyond 65504 included;
// - attend's 16-bit output is the float64 result rounded once (within one 16-bit step of it), and never further
//   from it than PyTorch's own 16-bit CPU attention, which rounds intermediates to 16 bits.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <string>

#include <gtest/gtest.h>

#include <attend/attend.hpp>

#include "support/golden.hpp"

namespace {

using attend::index_t;
using attend_test::json;

const json& storage16_doc() {
    static const json doc = attend_test::load_golden("storage16.json");
    return doc;
}

/// A tensor of 16-bit values from their bits.
template <class T>
attend::tensor<T, 4> from_bits(const json& t, const std::string& what) {
    const auto bits = attend_test::to_tensor<std::int64_t, 4>(t, what);
    attend::tensor<T, 4> x(bits.dimensions());
    for (index_t n = 0; n < bits.size(); ++n) {
        const auto b = static_cast<std::uint16_t>(bits.data()[n]);
        std::memcpy(static_cast<void*>(x.data() + n), &b, 2);
    }
    return x;
}

template <class T>
bool same_bits(const attend::tensor<T, 4>& a, const attend::tensor<T, 4>& b) {
    return a.dimensions() == b.dimensions() &&
           std::memcmp(a.data(), b.data(), static_cast<std::size_t>(a.size()) * sizeof(T)) == 0;
}

/// The spacing of T's values next to x (one rounding step).
template <class T>
double spacing(double x) {
    const T t(static_cast<float>(std::abs(x)));
    const double below = static_cast<double>(static_cast<float>(t));
    T up = t;
    std::uint16_t bits;
    std::memcpy(&bits, &up, 2);
    ++bits;
    std::memcpy(static_cast<void*>(&up), &bits, 2);
    return static_cast<double>(static_cast<float>(up)) - below;
}

template <class T>
void check_case(const json& c) {
    const std::string name = c.at("name");
    SCOPED_TRACE(name);
    // PyTorch's rounding of the float32 sources is Eigen's.
    for (const char* x : {"q", "k", "v"}) {
        const auto source = attend_test::to_tensor<float, 4>(c.at(std::string(x) + "_source"), x);
        const attend::tensor<T, 4> ours = source.cast<T>();
        EXPECT_TRUE(same_bits(ours, from_bits<T>(c.at(std::string(x) + "_bits"), x))) << x;
    }
    const auto q = from_bits<T>(c.at("q_bits"), "q"), k = from_bits<T>(c.at("k_bits"), "k"),
               v = from_bits<T>(c.at("v_bits"), "v");
    const auto want = attend_test::to_tensor<double, 4>(c.at("out"), "out");
    const auto want_lse = attend_test::to_tensor<double, 3>(c.at("lse"), "lse");
    const auto torch_out = from_bits<T>(c.at("torch_out_bits"), "torch_out");
    const double target = std::is_same_v<T, Eigen::bfloat16> ? std::ldexp(1.0, -7) : std::ldexp(1.0, -10);
    for (const auto kernel : {attend::kernel::tiled, attend::kernel::reference}) {
        attend::sdpa_options o;
        o.kernel = kernel;
        const auto got =
            attend::scaled_dot_product_attention(q, k, v, attend::causal(attend::alignment::bottom_right), o);
        const index_t dim = want.dimension(3);
        double worst_ours = 0, worst_theirs = 0;  // in rounding steps of T at the float64 value
        for (index_t r = 0; r < want.size() / dim; ++r) {
            double norm = 0;
            for (index_t d = 0; d < dim; ++d) norm = std::max(norm, std::abs(want.data()[r * dim + d]));
            for (index_t d = 0; d < dim; ++d) {
                const double exact = want.data()[r * dim + d], step = spacing<T>(exact);
                const double ours = static_cast<double>(static_cast<float>(got.out.data()[r * dim + d]));
                const double theirs = static_cast<double>(static_cast<float>(torch_out.data()[r * dim + d]));
                ASSERT_LE(std::abs(ours - exact), target * norm) << "row " << r << ", " << d;
                // Rounded once: within one step of the float64 value (half a step of rounding, plus float's).
                ASSERT_LE(std::abs(ours - exact), step) << "row " << r << ", " << d;
                worst_ours = std::max(worst_ours, std::abs(ours - exact) / step);
                worst_theirs = std::max(worst_theirs, std::abs(theirs - exact) / step);
            }
        }
        // PyTorch's 16-bit CPU attention rounds intermediates to 16 bits (several steps off here); attend is never
        // further from float64 than it.
        EXPECT_LE(worst_ours, worst_theirs);
        std::cout << name << ": worst error in 16-bit steps, attend " << worst_ours << ", PyTorch " << worst_theirs
                  << '\n';
        for (index_t n = 0; n < want_lse.size(); ++n)
            ASSERT_NEAR(got.lse.data()[n], want_lse.data()[n], 1e-5 * std::max(1.0, std::abs(want_lse.data()[n])));
    }
}

TEST(GoldenStorage16, SixteenBitAttentionMatchesPyTorchAndFloat64) {
    int cases = 0;
    for (const auto& c : storage16_doc().at("cases")) {
        if (c.at("dtype") == "half") check_case<Eigen::half>(c);
        else check_case<Eigen::bfloat16>(c);
        ++cases;
    }
    EXPECT_EQ(cases, 3);
    // The last case is the one whose scores leave fp16's range.
    EXPECT_GT(storage16_doc().at("cases")[2].at("max_score").get<double>(), 65504.0);
}

}  // namespace
