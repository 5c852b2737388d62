// SPDX-License-Identifier: MIT
// The output aliasing policy: every function that writes into caller memory (scaled_dot_product_attention_into,
// scaled_dot_product_attention_backward_into, kv_cache::append) rejects an output whose memory overlaps an input
// or another output with shape_error attend.shape.aliasing naming both tensors, before writing anything; buffers
// that merely touch are accepted and give the same bits as separate allocations.
//
// Every tensor of a case lives in one pool of memory at chosen offsets, so overlaps are exact and the test can
// check that the whole pool, inputs included, is unchanged after a throw.

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <attend/attend.hpp>

#include "support/errors.hpp"
#include "support/random.hpp"

namespace {

using attend::index_t;
using map4 = Eigen::TensorMap<attend::tensor<float, 4>>;
using map3 = Eigen::TensorMap<attend::tensor<float, 3>>;

constexpr float sentinel = -7777.25f;
constexpr index_t B = 1, H = 2, L = 3, S = 5, D = 4;
constexpr index_t q_size = B * H * L * D, kv_size = B * H * S * D, out_size = q_size, weights_size = B * H * L * S,
                  lse_size = B * H * L;

/// One block of memory for all tensors of a call: random where inputs go, the sentinel elsewhere.
struct pool {
    std::vector<float> memory;
    explicit pool(index_t size) : memory(static_cast<std::size_t>(size), sentinel) {}
    float* at(index_t offset) { return memory.data() + offset; }
    void randomize(index_t offset, index_t size, std::uint64_t seed) {
        attend_test::rng g(seed);
        for (index_t n = 0; n < size; ++n)
            memory[static_cast<std::size_t>(offset + n)] = static_cast<float>(g.uniform(-1, 1));
    }
};

/// The pool's elements from `got` on equal the tensor's, bit for bit.
template <class Tensor>
void expect_same_bits(const float* got, const Tensor& want) {
    for (index_t n = 0; n < want.size(); ++n) ASSERT_EQ(got[n], want.data()[n]) << "element " << n;
}

/// Offsets of the forward's tensors in a pool; the defaults place them back to back, touching but disjoint.
struct forward_layout {
    index_t q = 0, k = q_size, v = q_size + kv_size, out = q_size + 2 * kv_size, weights = out + out_size,
            lse = weights + weights_size, end = lse + lse_size;
};

/// Runs scaled_dot_product_attention_into on tensors placed by `at` in a fresh pool.
struct forward_case {
    forward_layout at;
    pool memory{forward_layout{}.end + 64};

    explicit forward_case(const forward_layout& layout) : at(layout) {
        memory.randomize(at.q, q_size, 1);
        memory.randomize(at.k, kv_size, 2);
        memory.randomize(at.v, kv_size, 3);
    }
    void run() {
        const Eigen::TensorMap<const attend::tensor<float, 4>> q(memory.at(at.q), B, H, L, D),
            k(memory.at(at.k), B, H, S, D), v(memory.at(at.v), B, H, S, D);
        map4 out(memory.at(at.out), B, H, L, D), weights(memory.at(at.weights), B, H, L, S);
        map3 lse(memory.at(at.lse), B, H, L);
        attend::scaled_dot_product_attention_into(q, k, v, attend::no_mask{}, {}, out, weights, lse);
    }
};

/// The call on tensors placed by `at` must throw attend.shape.aliasing naming both tensors and leave every byte
/// of the pool as it was.
template <class Case, class Layout>
void expect_aliasing(const Layout& at, const std::string& output, const std::string& other) {
    Case c(at);
    const std::vector<float> before = c.memory.memory;
    const std::string message =
        attend_test::expect_error<attend::shape_error>([&] { c.run(); }, "attend.shape.aliasing");
    EXPECT_NE(message.find("output " + output + " ["), std::string::npos) << message;
    EXPECT_NE(message.find(other + " ["), std::string::npos) << message;
    EXPECT_TRUE(c.memory.memory == before) << "the pool changed although the call threw";
}

/// One overlap: the output at `moved` is placed at `onto` + shift, which the message must name as `other`.
template <class Layout>
struct overlap {
    index_t Layout::*moved;
    index_t Layout::*onto;
    index_t shift;
    const char* output;
    const char* other;
};

template <class Case, class Layout>
void expect_every_overlap_rejected(std::initializer_list<overlap<Layout>> overlaps) {
    for (const auto& o : overlaps) {
        Layout at;
        at.*o.moved = at.*o.onto + o.shift;
        SCOPED_TRACE(std::string(o.output) + " on " + o.other);
        expect_aliasing<Case>(at, o.output, o.other);
    }
}

TEST(ForwardAliasing, AnOutputOverlappingAnInputOrAnotherOutputIsRejectedBeforeAnyWrite) {
    using at = forward_layout;
    expect_every_overlap_rejected<forward_case, at>({
        {&at::out, &at::q, 0, "out", "input query"},
        {&at::out, &at::v, kv_size - 1, "out", "input value"},  // one shared element
        {&at::weights, &at::k, 2, "weights", "input key"},
        {&at::lse, &at::weights, 1, "lse", "output weights"},
        {&at::weights, &at::out, out_size - 1, "weights", "output out"},
    });
}

TEST(ForwardAliasing, AdjacentBuffersAreAcceptedAndMatchSeparateTensors) {
    forward_case c{forward_layout{}};
    c.run();
    const forward_layout at;
    const Eigen::TensorMap<const attend::tensor<float, 4>> q(c.memory.at(at.q), B, H, L, D),
        k(c.memory.at(at.k), B, H, S, D), v(c.memory.at(at.v), B, H, S, D);
    attend::sdpa_options o;
    o.need_weights = true;
    o.need_lse = true;
    const auto r = attend::scaled_dot_product_attention(attend::tensor<float, 4>(q), attend::tensor<float, 4>(k),
                                                        attend::tensor<float, 4>(v), o);
    expect_same_bits(c.memory.at(at.out), r.out);
    expect_same_bits(c.memory.at(at.weights), r.weights);
    expect_same_bits(c.memory.at(at.lse), r.lse);
    EXPECT_EQ(c.memory.at(at.end)[0], sentinel) << "wrote past the last output";
}

// ---- backward -------------------------------------------------------------------------------------------------

/// Offsets of the backward's tensors: inputs q, k, v, out, d_out, lse, then outputs d_query, d_key, d_value.
struct backward_layout {
    index_t q = 0, k = q_size, v = k + kv_size, out = v + kv_size, d_out = out + out_size, lse = d_out + out_size,
            d_query = lse + lse_size, d_key = d_query + q_size, d_value = d_key + kv_size, end = d_value + kv_size;
};

struct backward_case {
    backward_layout at;
    pool memory{backward_layout{}.end + 64};

    explicit backward_case(const backward_layout& layout) : at(layout) {
        memory.randomize(at.q, q_size, 1);
        memory.randomize(at.k, kv_size, 2);
        memory.randomize(at.v, kv_size, 3);
        memory.randomize(at.d_out, out_size, 4);
        // out and lse of the forward pass, computed in separate memory.
        attend::sdpa_options o;
        o.need_lse = true;
        const auto r = attend::scaled_dot_product_attention(tensor(at.q, L), tensor(at.k, S), tensor(at.v, S), o);
        std::copy(r.out.data(), r.out.data() + out_size, memory.at(at.out));
        std::copy(r.lse.data(), r.lse.data() + lse_size, memory.at(at.lse));
    }
    attend::tensor<float, 4> tensor(index_t offset, index_t len) {
        return Eigen::TensorMap<attend::tensor<float, 4>>(memory.at(offset), B, H, len, D);
    }
    void run() {
        using cmap4 = Eigen::TensorMap<const attend::tensor<float, 4>>;
        const cmap4 q(memory.at(at.q), B, H, L, D), k(memory.at(at.k), B, H, S, D), v(memory.at(at.v), B, H, S, D),
            out(memory.at(at.out), B, H, L, D), d_out(memory.at(at.d_out), B, H, L, D);
        const Eigen::TensorMap<const attend::tensor<float, 3>> lse(memory.at(at.lse), B, H, L);
        map4 dq(memory.at(at.d_query), B, H, L, D), dk(memory.at(at.d_key), B, H, S, D),
            dv(memory.at(at.d_value), B, H, S, D);
        attend::scaled_dot_product_attention_backward_into(q, k, v, attend::no_mask{}, out, lse, d_out, dq, dk, dv);
    }
};

TEST(BackwardAliasing, AGradientOverlappingAnInputOrAnotherGradientIsRejectedBeforeAnyWrite) {
    using at = backward_layout;
    expect_every_overlap_rejected<backward_case, at>({
        {&at::d_query, &at::d_out, 0, "d_query", "input d_out"},
        {&at::d_key, &at::q, 1, "d_key", "input query"},
        {&at::d_value, &at::lse, 0, "d_value", "input lse"},
        {&at::d_value, &at::d_key, kv_size - 1, "d_value", "output d_key"},
    });
}

TEST(BackwardAliasing, AdjacentBuffersAreAcceptedAndMatchTheAllocatingForm) {
    backward_case c{backward_layout{}};
    c.run();
    const backward_layout at;
    const auto g = attend::scaled_dot_product_attention_backward(
        c.tensor(at.q, L), c.tensor(at.k, S), c.tensor(at.v, S), c.tensor(at.out, L),
        attend::tensor<float, 3>(Eigen::TensorMap<attend::tensor<float, 3>>(c.memory.at(at.lse), B, H, L)),
        c.tensor(at.d_out, L));
    expect_same_bits(c.memory.at(at.d_query), g.d_query);
    expect_same_bits(c.memory.at(at.d_key), g.d_key);
    expect_same_bits(c.memory.at(at.d_value), g.d_value);
    EXPECT_EQ(c.memory.at(at.end)[0], sentinel) << "wrote past the last output";
}

TEST(BackwardAliasing, InterleavedHeadsOfOneBufferCountAsOverlappingBecauseTheCheckIsByAddressRange) {
    // dq and dk as two heads of one projected [batch, len, 2 * head_dim] buffer share no element, but their
    // address ranges interleave; the documented, conservative rule rejects them.
    backward_case c{backward_layout{}};
    std::vector<float> projected(static_cast<std::size_t>(2 * q_size), sentinel);
    const auto head_group = [&](index_t first_head) {  // heads [first_head, first_head + H) of [B, L, 2 H D]
        attend::strided_view<float> x;
        x.data = projected.data() + first_head * D;
        x.dims = {B, H, L, D};
        x.strides = {L * 2 * H * D, D, 2 * H * D, 1};
        return x;
    };
    const attend::strided_view<float> dq = head_group(0), dk = head_group(H);
    const backward_layout at;
    using cmap4 = Eigen::TensorMap<const attend::tensor<float, 4>>;
    const cmap4 q(c.memory.at(at.q), B, H, L, D), out(c.memory.at(at.out), B, H, L, D),
        d_out(c.memory.at(at.d_out), B, H, L, D);
    const Eigen::TensorMap<const attend::tensor<float, 3>> lse(c.memory.at(at.lse), B, H, L);
    attend::tensor<float, 4> dv(B, H, L, D);
    dv.setConstant(sentinel);
    const std::string message = attend_test::expect_error<attend::shape_error>(
        [&] {
            attend::scaled_dot_product_attention_backward_into(q, q, q, attend::no_mask{}, out, lse, d_out, dq, dk, dv);
        },
        "attend.shape.aliasing");
    EXPECT_NE(message.find("output d_key [1,2,3,4] overlaps output d_query [1,2,3,4]"), std::string::npos) << message;
    for (float x : projected) EXPECT_EQ(x, sentinel);
}

// ---- kv_cache ---------------------------------------------------------------------------------------------------

TEST(KvCacheAliasing, AppendingTheCachesOwnKeysIsRejectedAndAppendsNothing) {
    attend::kv_cache<float> cache(attend::kv_cache_config{}.with_kv_heads(2).with_capacity(8).with_head_dim(4));
    const auto k = attend_test::random_tensor<float>(1, 1, 2, 3, 4);
    const auto v = attend_test::random_tensor<float>(2, 1, 2, 3, 4);
    cache.append(k, v);
    const std::string message =
        attend_test::expect_error<attend::shape_error>([&] { cache.append(cache.keys(), v); }, "attend.shape.aliasing");
    EXPECT_NE(message.find("output cache keys [1,2,8,4] overlaps input new keys [1,2,3,4]"), std::string::npos)
        << message;
    EXPECT_EQ(cache.length(), 3);
    for (index_t h = 0; h < 2; ++h)
        for (index_t i = 0; i < 3; ++i)
            for (index_t d = 0; d < 4; ++d) EXPECT_EQ(cache.keys().row(0, h, i)[d], k(0, h, i, d));
}

TEST(KvCacheAliasing, AppendingFromAnotherCacheIsAccepted) {
    attend::kv_cache<float> a(attend::kv_cache_config{}.with_kv_heads(2).with_capacity(8).with_head_dim(4)),
        b(attend::kv_cache_config{}.with_kv_heads(2).with_capacity(8).with_head_dim(4));
    const auto k = attend_test::random_tensor<float>(1, 1, 2, 3, 4);
    const auto v = attend_test::random_tensor<float>(2, 1, 2, 3, 4);
    a.append(k, v);
    b.append(a.keys(), a.values());
    EXPECT_EQ(b.length(), 3);
    for (index_t h = 0; h < 2; ++h)
        for (index_t i = 0; i < 3; ++i)
            for (index_t d = 0; d < 4; ++d) EXPECT_EQ(b.values().row(0, h, i)[d], v(0, h, i, d));
}

}  // namespace
