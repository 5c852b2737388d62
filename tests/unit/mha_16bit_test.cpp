// SPDX-License-Identifier: MIT
// multi_head_attention<T> stored in 16 bits (Eigen::half, Eigen::bfloat16: PyTorch's module.to(dtype)). The
// invariants:
// - every product accumulates in float: a projection whose 16-bit running sum would stall (each step a tie that
//   rounds back down) comes out exact;
// - against a double module holding the same (rounded) weights on the same inputs, the output is within 8 units
//   of the type's rounding per row's largest value: five roundings to 16 bits (q, k and v projections, attention
//   output, output projection), none of them of a running sum (measured: 1 to 1.7 units); the averaged weights
//   within the same bound;
// - decoding token by token into a 16-bit kv_cache gives the causal forward within that same bound, and the
//   module's cache holds 16-bit keys and values; a ragged batch over a 16-bit paged cache gives the same bits;
// - from_torch / to_torch and .safetensors files in F16 or BF16 carry the parameters bit for bit;
// - non-finite 16-bit inputs are value_error before anything is computed.

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <type_traits>
#include <vector>

#include <attend/attend.hpp>
#include <attend/interop/safetensors.hpp>

#include "support/errors.hpp"
#include "support/q8_blocks.hpp"
#include "support/random.hpp"
#include "support/scratch_files.hpp"
#include "support/storage16.hpp"

namespace {

using attend::index_t;
using attend_test::worst_row_error;

/// Unit roundoff of T: half the distance from 1 to the next value (bf16 2^-8, fp16 2^-11).
template <class T>
double unit_roundoff() {
    return std::is_same_v<T, Eigen::bfloat16> ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
}

template <class T>
attend::tensor<T, 3> random3(std::uint64_t seed, index_t b, index_t len, index_t dim) {
    attend::tensor<float, 3> t(b, len, dim);
    attend_test::fill_uniform(t, seed, -1.0, 1.0);
    return t.cast<T>();
}

/// A double module holding exactly the values of a 16-bit one.
template <class T>
attend::multi_head_attention<double> widened(attend::multi_head_attention<T> m) {
    auto wide = attend::multi_head_attention<double>::zeros(m.config());
    auto from = m.parameters();
    auto to = wide.parameters();
    for (std::size_t n = 0; n < from.size(); ++n)
        for (index_t k = 0; k < from[n].size; ++k)
            to[n].data[k] = static_cast<double>(static_cast<float>(from[n].data[k]));
    return wide;
}

template <class T>
class Mha16 : public ::testing::Test {};
TYPED_TEST_SUITE(Mha16, attend_test::storage16_types, attend_test::storage16_names);

TYPED_TEST(Mha16, ProjectionsAccumulateInFloatWhereA16BitSumWouldStall) {
    using T = TypeParam;
    // Every weight 2^-12 and every input 1: each projection sums 2560 steps of 2^-12. A 16-bit running sum stops
    // at 0.5 (fp16) or 0.0625 (bf16), where adding 2^-12 is a tie that rounds back; in float it is 0.625. One key,
    // so the attention output is v itself, and out = 2560 * 2^-12 * 0.625 = 0.390625 (exact in both types).
    const index_t E = 2560;
    auto m = attend::multi_head_attention<T>::zeros(attend::mha_config{E, 1});
    for (const auto& p : m.parameters())
        if (std::string(p.name).find("weight") != std::string::npos)
            std::fill(p.data, p.data + p.size, T(std::ldexp(1.0f, -12)));
    attend::tensor<T, 3> x(1, 1, E);
    x.setConstant(T(1.0f));
    const auto r = m.forward(x, x, x);
    for (index_t e = 0; e < E; ++e) ASSERT_EQ(static_cast<float>(r.out(0, 0, e)), 0.390625f) << "feature " << e;
}

TYPED_TEST(Mha16, ForwardIsTheDoubleModuleWithinFiveRoundings) {
    using T = TypeParam;
    const double bound = 8 * unit_roundoff<T>();
    struct shape {
        index_t model_dim, heads, kv_heads, batch, len;
        bool causal;
    };
    for (const shape s : {shape{64, 4, 4, 2, 9, false}, shape{96, 6, 2, 1, 17, true}, shape{128, 2, 1, 2, 33, true}}) {
        SCOPED_TRACE(::testing::Message() << "E " << s.model_dim << " heads " << s.heads << "/" << s.kv_heads);
        const attend::multi_head_attention<T> m(attend::mha_config{s.model_dim, s.heads}.with_kv_heads(s.kv_heads),
                                                static_cast<std::uint64_t>(s.model_dim));
        const auto wide = widened(m);
        const auto x = random3<T>(7, s.batch, s.len, s.model_dim);
        const attend::tensor<double, 3> xd = x.template cast<float>().template cast<double>();
        attend::mha_options o;
        o.attention.need_weights = true;
        const auto mask = attend::causal(attend::alignment::top_left);
        const auto got = s.causal ? m.forward(x, x, x, mask, o) : m.forward(x, x, x, o);
        const auto want = s.causal ? wide.forward(xd, xd, xd, mask, o) : wide.forward(xd, xd, xd, o);
        const double err = worst_row_error(got.out, want.out);
        EXPECT_LE(err, bound);
        EXPECT_GT(err, 0.0);  // rounded somewhere: the 16-bit path really ran
        EXPECT_LE(worst_row_error(got.weights, want.weights), bound);
    }
}

/// Options of a decoder with rotary positions over the first `dim` features of each head.
attend::mha_options rotary_options(index_t dim) {
    attend::mha_options o;
    attend::rotary_embedding rotary;
    rotary.dim = dim;
    o.rotary = rotary;
    return o;
}

TYPED_TEST(Mha16, DecodingOverAnInt8CacheStoresTheModulesProjectionsQuantizedAndStaysNearItsOwnCache) {
    // An fp16 or bf16 model with an int8 cache (ONNX Runtime's GroupQueryAttention with a quantized cache): the
    // cache holds the projections the module's own 16-bit cache holds, quantized once, and the outputs differ from
    // decoding over that 16-bit cache only by the quantization (its reading, 16-bit queries over int8 keys and
    // values, is q8_cache_test's; an int8 paged pool under a 16-bit module, paged_cache_test's).
    using T = TypeParam;
    const attend::multi_head_attention<T> m(attend::mha_config{128, 4}.with_kv_heads(2), 13);  // head_dim 32
    const index_t B = 2, L = 10;
    const auto x = random3<T>(5, B, L, 128);
    const attend::mha_options o = rotary_options(32);
    auto own = m.make_cache(B, L);
    auto int8 = m.template make_cache<attend::q8_0_block>(B, L);
    double worst = 0;
    for (index_t i = 0; i < L; ++i) {
        const attend::tensor<T, 3> token = x.slice(std::array<index_t, 3>{0, i, 0}, std::array<index_t, 3>{B, 1, 128});
        const auto near = m.forward_cached(token, own, o);
        const auto got = m.forward_cached(token, int8, o);
        const attend::tensor<double, 3> near_out = near.out.template cast<float>().template cast<double>();
        worst = std::max(worst, worst_row_error(got.out, near_out));
    }
    attend::q8_kv_cache quantized(
        attend::kv_cache_config{}.with_batch(B).with_kv_heads(2).with_capacity(L).with_head_dim(32));
    quantized.append(own.keys(), own.values());
    EXPECT_EQ(attend_test::state_of(int8), attend_test::state_of(quantized));
    EXPECT_GT(worst, 0.0);       // the int8 cache really was read
    EXPECT_LE(worst, 1.0 / 64);  // 0.009 (fp16) and 0.010 (bf16) here
}

TYPED_TEST(Mha16, DecodingIntoA16BitCacheIsTheCausalForward) {
    using T = TypeParam;
    const double bound = 8 * unit_roundoff<T>();
    const attend::multi_head_attention<T> m(attend::mha_config{64, 4}.with_kv_heads(2), 11);
    const index_t B = 2, L = 12;
    const auto x = random3<T>(3, B, L, 64);
    const attend::mha_options o = rotary_options(16);
    const auto wide = widened(m);
    const attend::tensor<double, 3> xd = x.template cast<float>().template cast<double>();
    const auto want = wide.forward(xd, xd, xd, attend::causal(attend::alignment::top_left), o).out;
    auto cache = m.make_cache(B, L);
    static_assert(std::is_same_v<decltype(cache), attend::kv_cache<T>>, "a 16-bit module caches 16-bit K and V");
    attend::tensor<T, 3> got(B, L, 64);
    for (index_t i = 0; i < L; ++i) {
        const attend::tensor<T, 3> token = x.slice(std::array<index_t, 3>{0, i, 0}, std::array<index_t, 3>{B, 1, 64});
        const auto r = m.forward_cached(token, cache, o);
        got.slice(std::array<index_t, 3>{0, i, 0}, std::array<index_t, 3>{B, 1, 64}) = r.out;
    }
    EXPECT_EQ(cache.length(), L);
    EXPECT_LE(worst_row_error(got, want), bound);
    // The same tokens as a ragged batch over a 16-bit paged cache: each sequence bit for bit its own decode.
    attend::paged_cache_config pc;
    pc.kv_heads = 2;
    pc.head_dim = 16;
    pc.blocks = 8;
    pc.max_sequences = 2;
    attend::paged_kv_cache<T> paged(pc);
    const std::vector<index_t> ids = {paged.add_sequence(), paged.add_sequence()};
    for (index_t i = 0; i < L; ++i) {
        const attend::tensor<T, 3> token = x.slice(std::array<index_t, 3>{0, i, 0}, std::array<index_t, 3>{B, 1, 64});
        const auto r = m.forward_cached(token, paged, ids, std::vector<index_t>{1, 1}, o);
        for (index_t b = 0; b < B; ++b)
            for (index_t e = 0; e < 64; ++e)
                ASSERT_EQ(Eigen::numext::bit_cast<std::uint16_t>(r.out(b, 0, e)),
                          Eigen::numext::bit_cast<std::uint16_t>(got(b, i, e)))
                    << "token " << i << " sequence " << b << " feature " << e;
    }
}

TYPED_TEST(Mha16, FromTorchAndToTorchCarryTheBits) {
    using T = TypeParam;
    attend::multi_head_attention<T> m(attend::mha_config{16, 2}, 5);
    auto back = attend::multi_head_attention<T>::from_torch(m.config(), m.to_torch());
    const auto a = m.parameters(), b = back.parameters();
    ASSERT_EQ(a.size(), b.size());
    for (std::size_t n = 0; n < a.size(); ++n)
        EXPECT_EQ(std::memcmp(a[n].data, b[n].data, static_cast<std::size_t>(a[n].size) * sizeof(T)), 0) << a[n].name;
}

TYPED_TEST(Mha16, NonFiniteInputsAreValueErrors) {
    using T = TypeParam;
    const attend::multi_head_attention<T> m(attend::mha_config{8, 2}, 1);
    auto x = random3<T>(1, 1, 3, 8);
    x(0, 2, 5) = T(std::numeric_limits<float>::infinity());
    const auto msg =
        attend_test::expect_error<attend::value_error>([&] { (void)m.forward(x, x, x); }, "attend.value.non_finite");
    EXPECT_NE(msg.find("query"), std::string::npos) << msg;
}

// ---- .safetensors in 16 bits ---------------------------------------------------------------------------------

void put_u64(std::string& out, std::uint64_t n) {
    for (int k = 0; k < 8; ++k) out.push_back(static_cast<char>((n >> (8 * k)) & 0xff));
}
template <class U>
std::string bytes_of(const std::vector<U>& values) {  // little-endian host (x86, arm64)
    std::string out(values.size() * sizeof(U), '\0');
    std::memcpy(out.data(), values.data(), out.size());
    return out;
}
std::string write_safetensors(const std::string& name, const std::string& header, const std::string& data) {
    const std::string path = attend_test::scratch_files::path("mha16_" + name + ".safetensors");
    std::string file;
    put_u64(file, header.size());
    file += header + data;
    std::ofstream(path, std::ios::binary) << file;
    return path;
}

TEST(Safetensors16, HalfAndBfloat16ReadBitForBitAndWidenExactly) {
    const std::vector<std::uint16_t> half_bits = {0x3c00, 0xc100, 0x7bff, 0x0001};  // 1, -2.5, 65504, 2^-24
    const std::vector<std::uint16_t> bf16_bits = {0x3f80, 0xc049, 0x7f7f, 0x0001};  // 1, -3.140625, max, subnormal
    const std::string path = write_safetensors(
        "bits",
        R"({"h":{"dtype":"F16","shape":[4],"data_offsets":[0,8]},"b":{"dtype":"BF16","shape":[4],"data_offsets":[8,16]}})",
        bytes_of(half_bits) + bytes_of(bf16_bits));
    const attend::safetensors_file f(path);
    const auto h = f.read<Eigen::half, 1>("h");
    const auto b = f.read<Eigen::bfloat16, 1>("b");
    const auto hd = f.read<double, 1>("h");
    const auto bf = f.read<float, 1>("b");
    for (index_t n = 0; n < 4; ++n) {
        EXPECT_EQ(Eigen::numext::bit_cast<std::uint16_t>(h(n)), half_bits[static_cast<std::size_t>(n)]) << n;
        EXPECT_EQ(Eigen::numext::bit_cast<std::uint16_t>(b(n)), bf16_bits[static_cast<std::size_t>(n)]) << n;
        EXPECT_EQ(hd(n), static_cast<double>(static_cast<float>(h(n)))) << n;
        EXPECT_EQ(bf(n), static_cast<float>(b(n))) << n;
    }
    EXPECT_EQ(hd(2), 65504.0);
    EXPECT_EQ(hd(3), std::ldexp(1.0, -24));
    EXPECT_EQ(bf(1), -3.140625f);
}

TEST(Safetensors16, FloatsRoundToNearestEvenLikeTorchTo) {
    // Ties between two 16-bit neighbours go to the even one; just past a tie rounds up.
    const std::vector<float> values = {1 + std::ldexp(1.0f, -8), 1 + 3 * std::ldexp(1.0f, -8),
                                       1 + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20), 1 + std::ldexp(1.0f, -11),
                                       1 + 3 * std::ldexp(1.0f, -11)};
    const std::string path =
        write_safetensors("round", R"({"x":{"dtype":"F32","shape":[5],"data_offsets":[0,20]}})", bytes_of(values));
    const attend::safetensors_file f(path);
    const auto b = f.read<Eigen::bfloat16, 1>("x");
    const auto h = f.read<Eigen::half, 1>("x");
    EXPECT_EQ(static_cast<float>(b(0)), 1.0f);
    EXPECT_EQ(static_cast<float>(b(1)), 1 + std::ldexp(1.0f, -6));
    EXPECT_EQ(static_cast<float>(b(2)), 1 + std::ldexp(1.0f, -7));
    EXPECT_EQ(static_cast<float>(h(3)), 1.0f);
    EXPECT_EQ(static_cast<float>(h(4)), 1 + std::ldexp(1.0f, -9));
}

TEST(Safetensors16, ABfloat16StateDictLoadsIntoABfloat16Module) {
    const attend::multi_head_attention<Eigen::bfloat16> m(attend::mha_config{8, 2}, 9);
    const auto p = m.to_torch();
    const auto raw = [](const auto& t) {
        std::string s(static_cast<std::size_t>(t.size()) * 2, '\0');
        std::memcpy(s.data(), t.data(), s.size());
        return s;
    };
    const std::string header = R"({"in_proj_weight":{"dtype":"BF16","shape":[24,8],"data_offsets":[0,384]},)"
                               R"("in_proj_bias":{"dtype":"BF16","shape":[24],"data_offsets":[384,432]},)"
                               R"("out_proj.weight":{"dtype":"BF16","shape":[8,8],"data_offsets":[432,560]},)"
                               R"("out_proj.bias":{"dtype":"BF16","shape":[8],"data_offsets":[560,576]}})";
    const std::string path = write_safetensors(
        "module", header, raw(p.in_proj_weight) + raw(p.in_proj_bias) + raw(p.out_proj_weight) + raw(p.out_proj_bias));
    const auto loaded = attend::load_torch_mha<Eigen::bfloat16>(path, attend::mha_config{8, 2});
    const auto x = random3<Eigen::bfloat16>(4, 1, 5, 8);
    const auto a = m.forward(x, x, x).out, b = loaded.forward(x, x, x).out;
    EXPECT_EQ(std::memcmp(a.data(), b.data(), static_cast<std::size_t>(a.size()) * 2), 0);
    // The same file read into float widens each value exactly.
    const auto wide = attend::load_torch_mha<float>(path, attend::mha_config{8, 2});
    for (index_t k = 0; k < wide.q_weight().size(); ++k)
        ASSERT_EQ(wide.q_weight().data()[k], static_cast<float>(m.q_weight().data()[k])) << k;
}

}  // namespace
