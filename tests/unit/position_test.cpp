// SPDX-License-Identifier: MIT
// Tests of attend/position.hpp: sinusoidal and learned tables, rotary embeddings, T5 buckets and bias, ALiBi.
#include <attend/position.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <thread>
#include <typeinfo>
#include <utility>
#include <vector>

#include "support/compare.hpp"
#include "support/errors.hpp"
#include "support/random.hpp"

namespace {

using attend_test::bit_equal;
using attend_test::expect_error;

using attend::index_t;
using attend::tensor;

template <class T, int R>
void fill_sentinel(tensor<T, R>& t) {
    t.setConstant(static_cast<T>(-12345.25));
}

template <class T, int R>
bool all_sentinel(const tensor<T, R>& t) {
    for (index_t k = 0; k < t.size(); ++k)
        if (t.data()[k] != static_cast<T>(-12345.25)) return false;
    return true;
}

// ---------------------------------------------------------------------------------------------------------
// sinusoidal_positions

TEST(Sinusoidal, ShapeIsLengthByDim) {
    const auto pe = attend::sinusoidal_positions(7, 10);
    EXPECT_EQ(pe.dimension(0), 7);
    EXPECT_EQ(pe.dimension(1), 10);
    EXPECT_EQ(attend::sinusoidal_positions<float>(0, 3).size(), 0);
}

TEST(Sinusoidal, PositionZeroIsSinZeroCosOne) {
    const auto pe = attend::sinusoidal_positions(3, 9);
    for (index_t c = 0; c < 9; ++c) EXPECT_EQ(pe(0, c), c % 2 == 0 ? 0.0 : 1.0) << "column " << c;
}

TEST(Sinusoidal, KnownValuesFollowThePaperFormulaWithInterleavedSinCos) {
    const auto pe = attend::sinusoidal_positions(4, 4);
    EXPECT_DOUBLE_EQ(pe(1, 0), std::sin(1.0));
    EXPECT_DOUBLE_EQ(pe(1, 1), std::cos(1.0));
    EXPECT_DOUBLE_EQ(pe(1, 2), std::sin(0.01));  // 1 / 10000^(2/4)
    EXPECT_DOUBLE_EQ(pe(1, 3), std::cos(0.01));
    EXPECT_DOUBLE_EQ(pe(3, 0), std::sin(3.0));
    EXPECT_DOUBLE_EQ(pe(3, 3), std::cos(0.03));
    const auto wide = attend::sinusoidal_positions(60, 512);
    EXPECT_NEAR(wide(50, 100), std::sin(50.0 / std::pow(10000.0, 100.0 / 512.0)), 1e-15);
    EXPECT_NEAR(wide(59, 511), std::cos(59.0 / std::pow(10000.0, 510.0 / 512.0)), 1e-15);
}

TEST(Sinusoidal, OddDimEndsWithASinColumn) {
    const auto pe = attend::sinusoidal_positions(5, 5);
    for (index_t p = 0; p < 5; ++p)
        EXPECT_DOUBLE_EQ(pe(p, 4), std::sin(static_cast<double>(p) / std::pow(10000.0, 4.0 / 5.0)));
    const auto one = attend::sinusoidal_positions(3, 1);
    EXPECT_DOUBLE_EQ(one(2, 0), std::sin(2.0));
}

TEST(Sinusoidal, SinSquaredPlusCosSquaredIsOneForEveryPair) {
    attend_test::rng g(11);
    for (int rep = 0; rep < attend_test::repeat(200); ++rep) {
        const index_t length = g.uniform_int(1, 40), dim = g.uniform_int(1, 33);
        const auto pe = attend::sinusoidal_positions(length, dim);
        for (index_t p = 0; p < length; ++p)
            for (index_t i = 0; 2 * i + 1 < dim; ++i)
                ASSERT_NEAR(pe(p, 2 * i) * pe(p, 2 * i) + pe(p, 2 * i + 1) * pe(p, 2 * i + 1), 1.0, 1e-15)
                    << "length " << length << " dim " << dim << " p " << p << " pair " << i;
    }
}

TEST(Sinusoidal, FloatIsTheDoubleTableRoundedOnce) {
    const auto d = attend::sinusoidal_positions<double>(30, 12);
    const auto f = attend::sinusoidal_positions<float>(30, 12);
    for (index_t k = 0; k < d.size(); ++k) EXPECT_EQ(f.data()[k], static_cast<float>(d.data()[k]));
}

TEST(Sinusoidal, RejectsDimBelowOneAndNegativeLength) {
    expect_error<attend::value_error>([] { attend::sinusoidal_positions(4, 0); }, "attend.value.position_dim");
    expect_error<attend::value_error>([] { attend::sinusoidal_positions<float>(4, -2); }, "attend.value.position_dim");
    expect_error<attend::value_error>([] { attend::sinusoidal_positions(-1, 4); }, "attend.value.position_length");
}

// ---------------------------------------------------------------------------------------------------------
// learned_positions

TEST(LearnedPositions, TableIsMaxLenByDimAndDeterministicPerSeed) {
    attend::learned_positions<double> a(20, 6, 42), b(20, 6, 42), c(20, 6, 43);
    EXPECT_EQ(a.max_len(), 20);
    EXPECT_EQ(a.dim(), 6);
    EXPECT_EQ(a.table().dimension(0), 20);
    EXPECT_EQ(a.table().dimension(1), 6);
    EXPECT_TRUE(bit_equal(a.table(), b.table()));
    EXPECT_FALSE(bit_equal(a.table(), c.table()));
    attend::learned_positions<float> f(20, 6, 42);
    for (index_t k = 0; k < a.table().size(); ++k)
        EXPECT_EQ(f.table().data()[k], static_cast<float>(a.table().data()[k]));
}

TEST(LearnedPositions, InitialisationIsStandardNormalLikeNnEmbedding) {
    attend::learned_positions<double> p(400, 100, 7);
    double sum = 0, sum_sq = 0;
    index_t within_one = 0;
    const auto n = static_cast<double>(p.table().size());
    for (index_t k = 0; k < p.table().size(); ++k) {
        const double x = p.table().data()[k];
        sum += x;
        sum_sq += x * x;
        if (std::abs(x) < 1) ++within_one;
    }
    EXPECT_NEAR(sum / n, 0.0, 0.02);
    EXPECT_NEAR(sum_sq / n, 1.0, 0.02);
    EXPECT_NEAR(static_cast<double>(within_one) / n, 0.6827, 0.01);
}

TEST(LearnedPositions, LookupReturnsTheRowsOfTheRequestedPositions) {
    attend::learned_positions<double> p(16, 5, 3);
    const auto rows = p.lookup(9, 7);  // 9 .. 15: ends exactly at the last row
    ASSERT_EQ(rows.dimension(0), 7);
    ASSERT_EQ(rows.dimension(1), 5);
    for (index_t r = 0; r < 7; ++r)
        for (index_t c = 0; c < 5; ++c) EXPECT_EQ(rows(r, c), p.table()(9 + r, c));
    EXPECT_EQ(p.lookup(16, 0).size(), 0);
}

TEST(LearnedPositions, AddToAddsTheSameRowsToEveryBatchEntry) {
    attend::learned_positions<float> p(12, 4, 5);
    auto x = attend_test::random_tensor<float>(21, 3, 5, 4);
    const tensor<float, 3> before = x;
    p.add_to(x, 6);
    for (index_t b = 0; b < 3; ++b)
        for (index_t i = 0; i < 5; ++i)
            for (index_t c = 0; c < 4; ++c) EXPECT_EQ(x(b, i, c), before(b, i, c) + p.table()(6 + i, c));
}

TEST(LearnedPositions, PositionsPastTheTableThrowAndNeverWrap) {
    attend::learned_positions<double> p(10, 3, 1);
    expect_error<attend::position_error>([&] { p.lookup(8, 3); }, "attend.position.past_table");
    expect_error<attend::position_error>([&] { p.lookup(10, 1); }, "attend.position.past_table");
    expect_error<attend::position_error>([&] { p.lookup(-1, 2); }, "attend.position.past_table");
    expect_error<attend::position_error>([&] { p.lookup(std::numeric_limits<index_t>::max(), 5); },
                                         "attend.position.past_table");
    try {
        p.lookup(8, 3);
    } catch (const attend::position_error& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find("position 10"), std::string::npos) << what;
        EXPECT_NE(what.find("max_len 10"), std::string::npos) << what;
    }
    expect_error<attend::value_error>([&] { p.lookup(0, -1); }, "attend.value.position_length");

    tensor<double, 3> x(2, 4, 3);
    fill_sentinel(x);
    expect_error<attend::position_error>([&] { p.add_to(x, 7); }, "attend.position.past_table");
    EXPECT_TRUE(all_sentinel(x));
    expect_error<attend::position_error>([&] { p.add_to(x, -3); }, "attend.position.past_table");
    EXPECT_TRUE(all_sentinel(x));
    p.add_to(x, 6);  // 6 .. 9 fits exactly
    EXPECT_FALSE(all_sentinel(x));
}

TEST(LearnedPositions, AddToRejectsAWrongDimBeforeWriting) {
    attend::learned_positions<float> p(10, 3, 1);
    tensor<float, 3> x(2, 4, 5);
    fill_sentinel(x);
    expect_error<attend::shape_error>([&] { p.add_to(x, 0); }, "attend.shape.position_dim");
    EXPECT_TRUE(all_sentinel(x));
}

TEST(LearnedPositions, ConstructorRejectsEmptyTables) {
    expect_error<attend::value_error>([] { attend::learned_positions<double>(0, 4); }, "attend.value.position_max_len");
    expect_error<attend::value_error>([] { attend::learned_positions<float>(4, 0); }, "attend.value.position_dim");
}

// ---------------------------------------------------------------------------------------------------------
// rotary_embedding

constexpr attend::rotary_layout layouts[] = {attend::rotary_layout::half_split, attend::rotary_layout::interleaved};

const char* name(attend::rotary_layout l) {
    return l == attend::rotary_layout::half_split ? "half_split" : "interleaved";
}

double dot(const double* a, const double* b, index_t n) {
    double s = 0;
    for (index_t k = 0; k < n; ++k) s += a[k] * b[k];
    return s;
}

TEST(Rotary, KnownValuesForBothLayouts) {
    // One vector per layout with a 1 in the first feature of each pair; position 3, dim 4, base 10000:
    // pair 0 turns by 3 rad, pair 1 by 3 / 100 rad.
    tensor<double, 3> half(1, 1, 6), inter(1, 1, 6);
    half.setValues({{{1, 0.5, 0, 0, 7, 8}}});   // pairs (0, 2) and (1, 3)
    inter.setValues({{{1, 0, 0.5, 0, 7, 8}}});  // pairs (0, 1) and (2, 3)
    attend::rotary_embedding{4, 10000, attend::rotary_layout::half_split}.apply(half, 3);
    attend::rotary_embedding{4, 10000, attend::rotary_layout::interleaved}.apply(inter, 3);
    EXPECT_DOUBLE_EQ(half(0, 0, 0), std::cos(3.0));
    EXPECT_DOUBLE_EQ(half(0, 0, 2), std::sin(3.0));
    EXPECT_DOUBLE_EQ(half(0, 0, 1), 0.5 * std::cos(0.03));
    EXPECT_DOUBLE_EQ(half(0, 0, 3), 0.5 * std::sin(0.03));
    EXPECT_DOUBLE_EQ(inter(0, 0, 0), std::cos(3.0));
    EXPECT_DOUBLE_EQ(inter(0, 0, 1), std::sin(3.0));
    EXPECT_DOUBLE_EQ(inter(0, 0, 2), 0.5 * std::cos(0.03));
    EXPECT_DOUBLE_EQ(inter(0, 0, 3), 0.5 * std::sin(0.03));
    EXPECT_EQ(half(0, 0, 4), 7);
    EXPECT_EQ(inter(0, 0, 5), 8);
    // A second feature of a pair rotates the other way round: (0, 1) -> (-sin, cos).
    tensor<double, 3> y(1, 1, 2);
    y.setValues({{{0, 1}}});
    attend::rotary_embedding{2, 10000, attend::rotary_layout::interleaved}.apply(y, 1);
    EXPECT_DOUBLE_EQ(y(0, 0, 0), -std::sin(1.0));
    EXPECT_DOUBLE_EQ(y(0, 0, 1), std::cos(1.0));
}

TEST(Rotary, FrequenciesKeptFromAnotherDimOrBaseChangeNoBit) {
    // The calling thread keeps the last (dim, base)'s frequencies: a rotation after one of another dim or base
    // gives the bits of a thread that computed nothing before (a fresh thread's keep is empty).
    const auto x = attend_test::random_tensor<double>(5, 1, 2, 3, 8);
    const auto rotated = [&](index_t dim, double base) {
        tensor<double, 4> y = x;
        attend::rotary_embedding{dim, base}.apply(y, 11);
        return y;
    };
    using config = std::pair<index_t, double>;  // dim, base
    for (const config& c : {config{8, 10000}, config{8, 500}, config{4, 500}, config{4, 10000}}) {
        tensor<double, 4> fresh;
        std::thread([&] { fresh = rotated(c.first, c.second); }).join();
        for (const config& other : {config{8, 10000}, config{8, 500}, config{4, 10000}}) {
            (void)rotated(other.first, other.second);
            EXPECT_TRUE(bit_equal(rotated(c.first, c.second), fresh))
                << c.first << ' ' << c.second << " after " << other.first << ' ' << other.second;
        }
    }
}

TEST(Rotary, PositionZeroIsTheIdentity) {
    for (auto layout : layouts) {
        auto x = attend_test::random_tensor<double>(3, 2, 3, 1, 8);
        const tensor<double, 4> before = x;
        attend::rotary_embedding{8, 10000, layout}.apply(x, 0);
        EXPECT_TRUE(bit_equal(x, before)) << name(layout);
    }
}

TEST(Rotary, PreservesTheNormOfEveryHeadVector) {
    attend_test::rng g(101);
    for (int rep = 0; rep < attend_test::repeat(200); ++rep) {
        const index_t batch = g.uniform_int(1, 3), heads = g.uniform_int(1, 4), len = g.uniform_int(1, 9);
        const index_t head_dim = g.uniform_int(1, 20), dim = 2 * g.uniform_int(1, head_dim / 2 + (head_dim < 2));
        if (dim > head_dim) continue;
        const auto layout = layouts[g.uniform_int(0, 1)];
        const double base = g.bernoulli(0.5) ? 10000.0 : g.uniform(1.5, 1e6);
        const index_t offset = g.uniform_int(0, 5000);
        auto x = attend_test::random_tensor<double>(g.next(), batch, heads, len, head_dim);
        const tensor<double, 4> before = x;
        attend::rotary_embedding{dim, base, layout}.apply(x, offset);
        for (index_t b = 0; b < batch; ++b)
            for (index_t h = 0; h < heads; ++h)
                for (index_t i = 0; i < len; ++i) {
                    const double* r0 = &before(b, h, i, 0);
                    const double* r1 = &x(b, h, i, 0);
                    ASSERT_NEAR(dot(r1, r1, head_dim), dot(r0, r0, head_dim), 1e-12)
                        << name(layout) << " dim " << dim << " head_dim " << head_dim << " offset " << offset;
                }
    }
}

TEST(Rotary, ApplyThenApplyInverseIsTheIdentity) {
    attend_test::rng g(202);
    for (int rep = 0; rep < attend_test::repeat(200); ++rep) {
        const index_t head_dim = g.uniform_int(2, 24), dim = 2 * g.uniform_int(1, head_dim / 2);
        const auto layout = layouts[g.uniform_int(0, 1)];
        const index_t offset = g.uniform_int(0, 100000);
        auto x = attend_test::random_tensor<double>(g.next(), g.uniform_int(1, 3), g.uniform_int(1, 3),
                                                    g.uniform_int(1, 7), head_dim);
        const tensor<double, 4> before = x;
        const attend::rotary_embedding rope{dim, 10000, layout};
        rope.apply(x, offset);
        rope.apply_inverse(x, offset);
        for (index_t k = 0; k < x.size(); ++k)
            ASSERT_NEAR(x.data()[k], before.data()[k], 1e-14) << name(layout) << " dim " << dim << " offset " << offset;
        // The inverse is the transpose: <R x, y> == <x, R^T y>.
        auto y = attend_test::random_tensor<double>(g.next(), 1, 1, 1, head_dim);
        auto rx = attend_test::random_tensor<double>(g.next(), 1, 1, 1, head_dim);
        const tensor<double, 4> x0 = rx, y0 = y;
        rope.apply(rx, offset);
        rope.apply_inverse(y, offset);
        ASSERT_NEAR(dot(rx.data(), y0.data(), head_dim), dot(x0.data(), y.data(), head_dim), 1e-13);
    }
}

TEST(Rotary, DotProductsDependOnlyOnTheRelativePosition) {
    attend_test::rng g(303);
    for (int rep = 0; rep < attend_test::repeat(200); ++rep) {
        const index_t head_dim = 2 * g.uniform_int(1, 32), dim = 2 * g.uniform_int(1, head_dim / 2);
        const auto layout = layouts[g.uniform_int(0, 1)];
        const attend::rotary_embedding rope{dim, g.bernoulli(0.5) ? 10000.0 : 500000.0, layout};
        const index_t p = g.uniform_int(0, 300), p_key = g.uniform_int(0, 300), t = g.uniform_int(0, 300);
        const auto q = attend_test::random_tensor<double>(g.next(), 1, 1, head_dim);
        const auto k = attend_test::random_tensor<double>(g.next(), 1, 1, head_dim);
        tensor<double, 3> q1 = q, k1 = k, q2 = q, k2 = k;
        rope.apply(q1, p);
        rope.apply(k1, p_key);
        rope.apply(q2, p + t);
        rope.apply(k2, p_key + t);
        ASSERT_NEAR(dot(q1.data(), k1.data(), head_dim), dot(q2.data(), k2.data(), head_dim), 1e-12)
            << name(layout) << " dim " << dim << " head_dim " << head_dim << " p " << p << " p' " << p_key << " t "
            << t;
    }
}

TEST(Rotary, PartialRotaryLeavesTheTailFeaturesBitIdentical) {
    attend_test::rng g(404);
    for (int rep = 0; rep < attend_test::repeat(100); ++rep) {
        const index_t head_dim = g.uniform_int(3, 30), dim = 2 * g.uniform_int(1, (head_dim - 1) / 2);
        const auto layout = layouts[g.uniform_int(0, 1)];
        auto x = attend_test::random_tensor<float>(g.next(), 2, 3, 5, head_dim);
        const tensor<float, 4> before = x;
        attend::rotary_embedding{dim, 10000, layout}.apply(x, g.uniform_int(1, 50));
        for (index_t b = 0; b < 2; ++b)
            for (index_t h = 0; h < 3; ++h)
                for (index_t i = 0; i < 5; ++i)
                    for (index_t c = dim; c < head_dim; ++c) ASSERT_EQ(x(b, h, i, c), before(b, h, i, c));
    }
}

TEST(Rotary, OffsetSevenEqualsRowsSevenOnOfALongerSequence) {
    for (auto layout : layouts) {
        const attend::rotary_embedding rope{8, 10000, layout};
        auto longer = attend_test::random_tensor<double>(5, 2, 3, 7 + 6, 10);
        tensor<double, 4> shorter(2, 3, 6, 10);
        for (index_t b = 0; b < 2; ++b)
            for (index_t h = 0; h < 3; ++h)
                for (index_t i = 0; i < 6; ++i)
                    for (index_t c = 0; c < 10; ++c) shorter(b, h, i, c) = longer(b, h, 7 + i, c);
        rope.apply(longer, 0);
        rope.apply(shorter, 7);
        for (index_t b = 0; b < 2; ++b)
            for (index_t h = 0; h < 3; ++h)
                for (index_t i = 0; i < 6; ++i)
                    for (index_t c = 0; c < 10; ++c)
                        ASSERT_EQ(shorter(b, h, i, c), longer(b, h, 7 + i, c)) << name(layout);
    }
}

TEST(Rotary, InterleavedIsHalfSplitOnPermutedFeatures) {
    attend_test::rng g(505);
    for (int rep = 0; rep < attend_test::repeat(50); ++rep) {
        const index_t half = g.uniform_int(1, 8), dim = 2 * half, head_dim = dim + g.uniform_int(0, 3);
        auto inter = attend_test::random_tensor<double>(g.next(), 1, 2, 4, head_dim);
        tensor<double, 4> split = inter;
        for (index_t h = 0; h < 2; ++h)
            for (index_t i = 0; i < 4; ++i)
                for (index_t k = 0; k < half; ++k) {
                    split(0, h, i, k) = inter(0, h, i, 2 * k);
                    split(0, h, i, k + half) = inter(0, h, i, 2 * k + 1);
                }
        const index_t offset = g.uniform_int(0, 1000);
        attend::rotary_embedding{dim, 10000, attend::rotary_layout::interleaved}.apply(inter, offset);
        attend::rotary_embedding{dim, 10000, attend::rotary_layout::half_split}.apply(split, offset);
        for (index_t h = 0; h < 2; ++h)
            for (index_t i = 0; i < 4; ++i)
                for (index_t k = 0; k < half; ++k) {
                    ASSERT_EQ(split(0, h, i, k), inter(0, h, i, 2 * k));
                    ASSERT_EQ(split(0, h, i, k + half), inter(0, h, i, 2 * k + 1));
                }
    }
}

TEST(Rotary, StridedHeadViewsMatchAContiguousTensor) {
    // Heads read out of a projected [batch, len, heads * head_dim] buffer rotate like a [batch, heads, len,
    // head_dim] copy.
    const index_t batch = 2, len = 5, heads = 3, head_dim = 6;
    auto projected = attend_test::random_tensor<double>(9, batch, len, heads * head_dim);
    tensor<double, 4> copy(batch, heads, len, head_dim);
    for (index_t b = 0; b < batch; ++b)
        for (index_t i = 0; i < len; ++i)
            for (index_t h = 0; h < heads; ++h)
                for (index_t c = 0; c < head_dim; ++c) copy(b, h, i, c) = projected(b, i, h * head_dim + c);
    for (auto layout : layouts) {
        const attend::rotary_embedding rope{4, 10000, layout};
        rope.apply(attend::split_heads(projected.data(), batch, len, heads, head_dim), 11);
        rope.apply(copy, 11);
        for (index_t b = 0; b < batch; ++b)
            for (index_t i = 0; i < len; ++i)
                for (index_t h = 0; h < heads; ++h)
                    for (index_t c = 0; c < head_dim; ++c)
                        ASSERT_EQ(copy(b, h, i, c), projected(b, i, h * head_dim + c)) << name(layout);
    }
}

TEST(Rotary, RankThreeIsOneHead) {
    auto x3 = attend_test::random_tensor<double>(4, 2, 6, 8);
    tensor<double, 4> x4(2, 1, 6, 8);
    for (index_t k = 0; k < x3.size(); ++k) x4.data()[k] = x3.data()[k];
    const attend::rotary_embedding rope{6, 500, attend::rotary_layout::interleaved};
    rope.apply(x3, 2);
    rope.apply(x4, 2);
    for (index_t k = 0; k < x3.size(); ++k) EXPECT_EQ(x3.data()[k], x4.data()[k]);
    rope.apply_inverse(x3, 2);
    rope.apply_inverse(x4, 2);
    for (index_t k = 0; k < x3.size(); ++k) EXPECT_EQ(x3.data()[k], x4.data()[k]);
}

TEST(Rotary, FloatAgreesWithDoubleToFloatPrecision) {
    for (auto layout : layouts) {
        auto xd = attend_test::random_tensor<double>(6, 2, 2, 40, 16);
        tensor<float, 4> xf = xd.cast<float>();
        const attend::rotary_embedding rope{16, 10000, layout};
        rope.apply(xd, 1000);
        rope.apply(xf, 1000);
        for (index_t k = 0; k < xd.size(); ++k) ASSERT_NEAR(static_cast<double>(xf.data()[k]), xd.data()[k], 2e-6);
    }
}

TEST(Rotary, EmptyTensorsAreValidAndStillValidated) {
    tensor<double, 4> empty(0, 2, 3, 8);
    attend::rotary_embedding{8}.apply(empty, 0);
    tensor<double, 4> no_rows(2, 2, 0, 8);
    attend::rotary_embedding{8}.apply(no_rows, 4);
    expect_error<attend::shape_error>([&] { attend::rotary_embedding{10}.apply(empty, 0); }, "attend.shape.rotary_dim");
}

template <class T, class Call>
void expect_rotary_error_leaves_x_unchanged(const attend::rotary_embedding& rope, index_t offset, const std::string& id,
                                            Call) {
    using E = typename Call::type;
    tensor<T, 4> x4(2, 3, 4, 8);
    tensor<T, 3> x3(2, 4, 8);
    for (bool inverse : {false, true}) {
        fill_sentinel(x4);
        fill_sentinel(x3);
        expect_error<E>([&] { inverse ? rope.apply_inverse(x4, offset) : rope.apply(x4, offset); }, id);
        expect_error<E>([&] { inverse ? rope.apply_inverse(x3, offset) : rope.apply(x3, offset); }, id);
        expect_error<E>(
            [&] {
                auto v = attend::split_heads(x3.data(), 2, 2, 2, 8);  // x3's memory read as 2 heads of 2 tokens
                inverse ? rope.apply_inverse(v, offset) : rope.apply(v, offset);
            },
            id);
        EXPECT_TRUE(all_sentinel(x4)) << id;
        EXPECT_TRUE(all_sentinel(x3)) << id;
    }
}

template <class E>
struct throws {
    using type = E;
};

TEST(Rotary, InvalidConfigurationsThrowTypedErrorsBeforeWriting) {
    using attend::rotary_embedding;
    const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
    for (index_t bad_dim : {index_t{3}, index_t{0}, index_t{-2}}) {
        expect_rotary_error_leaves_x_unchanged<double>(rotary_embedding{bad_dim}, 0, "attend.value.rotary_dim",
                                                       throws<attend::value_error>{});
        expect_rotary_error_leaves_x_unchanged<float>(rotary_embedding{bad_dim}, 0, "attend.value.rotary_dim",
                                                      throws<attend::value_error>{});
    }
    expect_rotary_error_leaves_x_unchanged<double>(rotary_embedding{10}, 0, "attend.shape.rotary_dim",
                                                   throws<attend::shape_error>{});
    for (double bad_base : {0.0, -10000.0, inf, nan}) {
        expect_rotary_error_leaves_x_unchanged<double>(rotary_embedding{6, bad_base}, 0, "attend.value.rotary_base",
                                                       throws<attend::value_error>{});
        expect_rotary_error_leaves_x_unchanged<float>(rotary_embedding{6, bad_base}, 0, "attend.value.rotary_base",
                                                      throws<attend::value_error>{});
    }
    expect_rotary_error_leaves_x_unchanged<double>(rotary_embedding{6}, -1, "attend.position.negative_offset",
                                                   throws<attend::position_error>{});
    expect_rotary_error_leaves_x_unchanged<float>(rotary_embedding{6}, -7, "attend.position.negative_offset",
                                                  throws<attend::position_error>{});
}

// ---------------------------------------------------------------------------------------------------------
// relative_position_bucket

struct bucket_config {
    bool bidirectional;
    index_t num_buckets;
    index_t max_distance;
};
constexpr bucket_config bucket_configs[] = {{true, 32, 128}, {false, 32, 128}, {true, 16, 64}, {false, 16, 64},
                                            {true, 8, 20},   {false, 9, 128},  {false, 2, 5},  {true, 4, 3}};

TEST(RelativePositionBucket, KnownValuesOfT5Defaults) {
    using attend::relative_position_bucket;
    // relative = key - query; bidirectional 32 / 128: keys before the query in 0..15, after it in 16..31.
    const index_t rel[] = {0,   -1,  1,   -7,  -8,  -11,  -12,  -15,   -16, -22, -23, -31, -32, -45,
                           -46, -63, -64, -90, -91, -127, -128, -1000, 7,   8,   16,  128, 1000};
    const index_t bi_32[] = {0,  1,  17, 7,  8,  8,  9,  9,  10, 10, 11, 11, 12, 12,
                             13, 13, 14, 14, 15, 15, 15, 15, 23, 24, 26, 31, 31};
    const index_t uni_32[] = {0,  1,  0,  7,  8,  11, 12, 15, 16, 18, 18, 21, 21, 23,
                              24, 26, 26, 29, 29, 31, 31, 31, 0,  0,  0,  0,  0};
    const index_t bi_16[] = {0, 1, 9, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 12, 13, 14, 15, 15};
    const index_t uni_16[] = {0,  1,  0,  7,  8,  9,  9,  10, 10, 11, 12, 13, 13, 14,
                              14, 15, 15, 15, 15, 15, 15, 15, 0,  0,  0,  0,  0};
    for (std::size_t k = 0; k < std::size(rel); ++k) {
        EXPECT_EQ(relative_position_bucket(rel[k], true), bi_32[k]) << rel[k];
        EXPECT_EQ(relative_position_bucket(rel[k], false), uni_32[k]) << rel[k];
        EXPECT_EQ(relative_position_bucket(rel[k], true, 16, 64), bi_16[k]) << rel[k];
        EXPECT_EQ(relative_position_bucket(rel[k], false, 16, 64), uni_16[k]) << rel[k];
    }
}

TEST(RelativePositionBucket, LogBranchIsComputedInSinglePrecisionLikeT5) {
    // Configurations where double arithmetic would truncate to a different bucket than T5's float32 does
    // (value from float32 emulation of `_relative_position_bucket`; double gives the second number).
    using attend::relative_position_bucket;
    EXPECT_EQ(relative_position_bucket(-64, false, 9, 128), 8);   // double: 7
    EXPECT_EQ(relative_position_bucket(-16, false, 9, 128), 6);   // double: 5
    EXPECT_EQ(relative_position_bucket(-18, false, 17, 27), 13);  // double: 14
    EXPECT_EQ(relative_position_bucket(-64, true, 18, 128), 8);   // double: 7
    EXPECT_EQ(relative_position_bucket(-80, false, 10, 160), 9);  // double: 8
    // Exact powers at T5's defaults land on the bucket boundary, not below it.
    EXPECT_EQ(relative_position_bucket(-16, true), 10);
    EXPECT_EQ(relative_position_bucket(-32, true), 12);
    EXPECT_EQ(relative_position_bucket(-64, true), 14);
}

TEST(RelativePositionBucket, MonotoneInDistanceOnEachSide) {
    for (const auto& cfg : bucket_configs) {
        index_t previous_before = -1, previous_after = -1;
        for (index_t d = 0; d <= 4 * cfg.max_distance + 10; ++d) {
            const index_t before =
                attend::relative_position_bucket(-d, cfg.bidirectional, cfg.num_buckets, cfg.max_distance);
            ASSERT_GE(before, previous_before) << "distance " << d << " num_buckets " << cfg.num_buckets;
            ASSERT_LE(before - previous_before, 1) << "no bucket is skipped, distance " << d;
            previous_before = before;
            if (d == 0) continue;
            const index_t after =
                attend::relative_position_bucket(d, cfg.bidirectional, cfg.num_buckets, cfg.max_distance);
            ASSERT_GE(after, previous_after) << "distance " << d << " num_buckets " << cfg.num_buckets;
            previous_after = after;
        }
    }
}

TEST(RelativePositionBucket, BidirectionalSplitsBucketsBySignAndUnidirectionalFoldsTheFuture) {
    for (const auto& cfg : bucket_configs) {
        const index_t half = cfg.bidirectional ? cfg.num_buckets / 2 : cfg.num_buckets;
        for (index_t r = -3 * cfg.max_distance; r <= 3 * cfg.max_distance; ++r) {
            const index_t b = attend::relative_position_bucket(r, cfg.bidirectional, cfg.num_buckets, cfg.max_distance);
            ASSERT_GE(b, 0);
            ASSERT_LT(b, cfg.num_buckets);
            if (cfg.bidirectional && r > 0) {
                ASSERT_GE(b, half) << r;
                ASSERT_EQ(b - half, attend::relative_position_bucket(-r, true, cfg.num_buckets, cfg.max_distance))
                    << "mirror of " << r;
            } else if (cfg.bidirectional) {
                ASSERT_LT(b, half) << r;
            } else if (r > 0) {
                ASSERT_EQ(b, 0) << r;
            }
        }
        // Far away and at the extremes of index: the last bucket of each side, no overflow.
        const index_t lo = std::numeric_limits<index_t>::min(), hi = std::numeric_limits<index_t>::max();
        EXPECT_EQ(attend::relative_position_bucket(lo, cfg.bidirectional, cfg.num_buckets, cfg.max_distance), half - 1);
        EXPECT_EQ(attend::relative_position_bucket(hi, cfg.bidirectional, cfg.num_buckets, cfg.max_distance),
                  cfg.bidirectional ? cfg.num_buckets - 1 : 0);
    }
}

TEST(RelativePositionBucket, ExactBucketsBelowMaxExact) {
    for (const auto& cfg : bucket_configs) {
        const index_t half = cfg.bidirectional ? cfg.num_buckets / 2 : cfg.num_buckets;
        for (index_t d = 0; d < half / 2; ++d)
            EXPECT_EQ(attend::relative_position_bucket(-d, cfg.bidirectional, cfg.num_buckets, cfg.max_distance), d);
        EXPECT_EQ(attend::relative_position_bucket(-cfg.max_distance, cfg.bidirectional, cfg.num_buckets,
                                                   cfg.max_distance),
                  half - 1);
    }
}

TEST(RelativePositionBucket, RejectsBadConfigurations) {
    const auto bad = [](bool bidirectional, index_t num_buckets, index_t max_distance) {
        expect_error<attend::value_error>(
            [&] { attend::relative_position_bucket(-5, bidirectional, num_buckets, max_distance); },
            "attend.value.bucket_config");
    };
    bad(false, 1, 128);
    bad(false, 0, 128);
    bad(true, -4, 128);
    bad(true, 31, 128);  // odd when bidirectional
    bad(true, 2, 128);   // one bucket per side leaves no exact range
    bad(true, 32, 8);    // max_distance <= max_exact (8)
    bad(false, 32, 16);  // max_exact 16
    bad(false, 32, -1);
    EXPECT_NO_THROW(attend::relative_position_bucket(-5, true, 32, 9));
    EXPECT_NO_THROW(attend::relative_position_bucket(-5, false, 3, 2));
}

// ---------------------------------------------------------------------------------------------------------
// relative_position_bias

TEST(RelativePositionBias, TableHasT5LayoutBucketsByHeads) {
    attend::relative_position_bias<double> bias(6, true);
    EXPECT_EQ(bias.table().dimension(0), 32);
    EXPECT_EQ(bias.table().dimension(1), 6);
    EXPECT_EQ(bias.heads(), 6);
    EXPECT_EQ(bias.num_buckets(), 32);
    EXPECT_EQ(bias.max_distance(), 128);
    EXPECT_TRUE(bias.bidirectional());
    attend::relative_position_bias<float> small(2, false, 16, 64, 9);
    EXPECT_EQ(small.table().dimension(0), 16);
    EXPECT_EQ(small.table().dimension(1), 2);
}

TEST(RelativePositionBias, ValueIsTheTableEntryOfTheBucketOfKeyMinusQuery) {
    attend::relative_position_bias<double> bias(4, true, 32, 128, 3);
    attend_test::rng g(606);
    for (int rep = 0; rep < attend_test::repeat(1000); ++rep) {
        const index_t h = g.uniform_int(0, 3), q = g.uniform_int(0, 400), k = g.uniform_int(0, 400);
        const index_t b = attend::relative_position_bucket(k - q, true, 32, 128);
        ASSERT_EQ(bias.bucket(q, k), b);
        ASSERT_EQ(bias.value(h, q, k), bias.table()(b, h));
        const index_t t = g.uniform_int(-100, 100);
        ASSERT_EQ(bias.value(h, q + t, k + t), bias.value(h, q, k)) << "translation invariance";
    }
}

TEST(RelativePositionBias, LoadedWeightsAreWhatValueReads) {
    attend::relative_position_bias<float> bias(2, false, 8, 20);
    for (index_t b = 0; b < 8; ++b)
        for (index_t h = 0; h < 2; ++h) bias.table()(b, h) = static_cast<float>(10 * b + h);
    EXPECT_EQ(bias.value(1, 5, 5), 1.0f);
    EXPECT_EQ(bias.value(0, 5, 2), 30.0f);
    EXPECT_EQ(bias.value(1, 5, 9), 1.0f);  // future keys fold to bucket 0 when unidirectional
}

TEST(RelativePositionBias, RejectsBadHeadsConfigurationsAndHeadIndices) {
    expect_error<attend::value_error>([] { attend::relative_position_bias<double>(0, true); },
                                      "attend.value.bias_heads");
    expect_error<attend::value_error>([] { attend::relative_position_bias<double>(4, true, 7); },
                                      "attend.value.bucket_config");
    expect_error<attend::value_error>([] { attend::relative_position_bias<float>(4, false, 32, 4); },
                                      "attend.value.bucket_config");
    attend::relative_position_bias<double> bias(3, true);
    expect_error<attend::shape_error>([&] { bias.value(3, 0, 0); }, "attend.shape.bias_head");
    expect_error<attend::shape_error>([&] { bias.value(-1, 0, 0); }, "attend.shape.bias_head");
}

// ---------------------------------------------------------------------------------------------------------
// alibi_slopes

TEST(AlibiSlopes, EightHeadsAreOneHalfToOneOver256) {
    const auto s = attend::alibi_slopes(8);
    ASSERT_EQ(s.size(), 8u);
    for (std::size_t h = 0; h < 8; ++h) EXPECT_EQ(s[h], std::ldexp(1.0, -static_cast<int>(h + 1))) << h;
}

TEST(AlibiSlopes, PowersOfTwoAreGeometricFromTwoToTheMinusEightOverN) {
    for (index_t n : {1, 2, 4, 16, 32, 64}) {
        const auto s = attend::alibi_slopes(n);
        ASSERT_EQ(static_cast<index_t>(s.size()), n);
        for (index_t h = 0; h < n; ++h)
            EXPECT_NEAR(s[static_cast<std::size_t>(h)],
                        std::pow(2.0, -8.0 * static_cast<double>(h + 1) / static_cast<double>(n)), 1e-15)
                << n << " heads, head " << h;
    }
    EXPECT_EQ(attend::alibi_slopes(1), std::vector<double>{1.0 / 256});
}

TEST(AlibiSlopes, TwelveHeadsAreEightThenEveryOtherOfSixteen) {
    const auto s = attend::alibi_slopes(12);
    ASSERT_EQ(s.size(), 12u);
    for (int h = 0; h < 8; ++h) EXPECT_NEAR(s[static_cast<std::size_t>(h)], std::pow(2.0, -(h + 1)), 1e-16);
    const double expected_tail[] = {std::pow(2.0, -0.5), std::pow(2.0, -1.5), std::pow(2.0, -2.5), std::pow(2.0, -3.5)};
    for (int k = 0; k < 4; ++k) EXPECT_NEAR(s[static_cast<std::size_t>(8 + k)], expected_tail[k], 1e-16);
}

TEST(AlibiSlopes, NonPowersOfTwoKeepThePowerOfTwoPrefixAndStayInZeroOne) {
    for (index_t n = 1; n <= 100; ++n) {
        const auto s = attend::alibi_slopes(n);
        ASSERT_EQ(static_cast<index_t>(s.size()), n);
        index_t closest = 1;
        while (closest * 2 <= n) closest *= 2;
        const auto prefix = attend::alibi_slopes(closest);
        const auto doubled = attend::alibi_slopes(2 * closest);
        for (index_t h = 0; h < n; ++h) {
            const auto u = static_cast<std::size_t>(h);
            ASSERT_GT(s[u], 0.0);
            ASSERT_LT(s[u], 1.0);
            if (h < closest) ASSERT_EQ(s[u], prefix[u]);
            else ASSERT_EQ(s[u], doubled[static_cast<std::size_t>(2 * (h - closest))]);
        }
    }
}

TEST(AlibiSlopes, RejectsFewerThanOneHead) {
    expect_error<attend::value_error>([] { attend::alibi_slopes(0); }, "attend.value.alibi_heads");
    expect_error<attend::value_error>([] { attend::alibi_slopes(-3); }, "attend.value.alibi_heads");
}

}  // namespace
