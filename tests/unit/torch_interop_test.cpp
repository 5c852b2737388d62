// SPDX-License-Identifier: MIT
// Tests of attend/interop/torch.hpp on its own: the free functions mha_from_torch / mha_to_torch and the
// multi_head_attention members that forward to them give the same module and parameters, both PyTorch layouts
// round-trip bit for bit, zeros() starts every parameter at 0, and misfitting parameters are
// attend.shape.torch_weight. (The PyTorch goldens run through from_torch in mha_test.cpp and
// safetensors_test.cpp.)
#include <attend/interop/torch.hpp>

#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "support/compare.hpp"
#include "support/errors.hpp"
#include "support/random.hpp"

namespace {

using attend::index_t;
using attend::tensor;
using attend_test::bit_equal;
using attend_test::expect_error;

template <class T>
void expect_same_parameters(const attend::multi_head_attention<T>& a, const attend::multi_head_attention<T>& b) {
    EXPECT_TRUE(bit_equal(a.q_weight(), b.q_weight()));
    EXPECT_TRUE(bit_equal(a.k_weight(), b.k_weight()));
    EXPECT_TRUE(bit_equal(a.v_weight(), b.v_weight()));
    EXPECT_TRUE(bit_equal(a.out_weight(), b.out_weight()));
    EXPECT_TRUE(bit_equal(a.q_bias(), b.q_bias()));
    EXPECT_TRUE(bit_equal(a.k_bias(), b.k_bias()));
    EXPECT_TRUE(bit_equal(a.v_bias(), b.v_bias()));
    EXPECT_TRUE(bit_equal(a.out_bias(), b.out_bias()));
}

TEST(TorchInterop, FreeFunctionsAndMembersAgreeForEveryLayout) {
    attend_test::rng g(7);
    for (int rep = 0; rep < attend_test::repeat(16); ++rep) {
        const index_t heads = g.uniform_int(1, 4), head_dim = g.uniform_int(1, 3), E = heads * head_dim;
        auto config = attend::mha_config{}.with_model_dim(E).with_heads(heads).with_bias(g.bernoulli(0.5));
        if (g.bernoulli(0.4)) config = config.with_key_dim(g.uniform_int(1, 7)).with_value_dim(g.uniform_int(1, 7));
        SCOPED_TRACE("rep " + std::to_string(rep));
        const attend::multi_head_attention<double> m(config, static_cast<std::uint64_t>(rep));
        const auto p = attend::mha_to_torch(m);
        EXPECT_EQ(p.in_proj_weight.size() != 0, m.packed());
        EXPECT_EQ(p.q_proj_weight.size() != 0, !m.packed());
        EXPECT_EQ(p.in_proj_bias.size() != 0, config.bias);
        const auto from_free = attend::mha_from_torch(config, p);
        const auto from_member = attend::multi_head_attention<double>::from_torch(config, m.to_torch());
        expect_same_parameters(from_free, m);
        expect_same_parameters(from_member, m);
        EXPECT_TRUE(bit_equal(attend::mha_to_torch(from_free).out_proj_weight, p.out_proj_weight));
    }
}

TEST(TorchInterop, ZerosStartsEveryParameterAtZero) {
    const auto m = attend::multi_head_attention<float>::zeros(attend::mha_config{}.with_model_dim(6).with_heads(3));
    auto copy = m;
    for (const auto& span : copy.parameters())
        for (index_t n = 0; n < span.size; ++n) EXPECT_EQ(span.data[n], 0.f) << span.name << ' ' << n;
    EXPECT_EQ(m.parameter_count(), 4 * 36 + 4 * 6);
}

TEST(TorchInterop, MisfittingParametersAreTorchWeight) {
    const auto config = attend::mha_config{}.with_model_dim(4).with_heads(2);
    auto p = attend::mha_to_torch(attend::multi_head_attention<double>(config, 3));
    p.out_proj_bias = tensor<double, 1>(3);
    auto msg = expect_error<attend::shape_error>([&] { (void)attend::mha_from_torch(config, p); },
                                                 "attend.shape.torch_weight");
    EXPECT_NE(msg.find("out_proj.bias [3] != expected [4]"), std::string::npos) << msg;
    p = attend::mha_to_torch(attend::multi_head_attention<double>(config, 3));
    msg = expect_error<attend::shape_error>([&] { (void)attend::mha_from_torch(config.with_bias(false), p); },
                                            "attend.shape.torch_weight");
    EXPECT_NE(msg.find("mha_config.bias is false"), std::string::npos) << msg;
}

}  // namespace
