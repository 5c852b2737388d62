// SPDX-License-Identifier: MIT
// The tiled kernel's micro-kernels (detail/micro_kernel.hpp) on every edge their blocking has: row counts around
// the row group, key counts around the panel, head and value dims around the packet, strided rows. Built once per
// instruction set this machine can target (tests/CMakeLists.txt), since each one takes other packets and other
// register tiles.
//
// Against a double-precision sum: |kernel - exact| <= 4 n eps sum |a b| per element (n the inner length), a bound a
// sum in any order meets. Row groups: each output element is computed the same way whatever rows it shares a call
// with, which the tiled kernel's thread-count determinism and its slabs rely on, so a call on all rows and calls
// on one row at a time give the same bits.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <limits>
#include <utility>
#include <vector>

#include <attend/detail/micro_kernel.hpp>
#include <attend/detail/micro_kernel_amx.hpp>
#include <attend/detail/micro_kernel_bf16.hpp>
#include <attend/detail/row_kernel.hpp>
#include <attend/detail/score_pipeline.hpp>
#include <attend/detail/widen.hpp>

#include "support/random.hpp"
#include "support/scalar_names.hpp"
#include "support/soft_cap_check.hpp"

namespace {

using attend::index_t;
using attend::detail::micro_tile;
using bf16 = Eigen::bfloat16;

template <class T>
std::vector<T> random_values(attend_test::rng& g, index_t n) {
    std::vector<T> x(static_cast<std::size_t>(n));
    for (auto& v : x) v = static_cast<T>(g.uniform(-1.0, 1.0));
    return x;
}

/// Sizes around a blocking unit (a packet, a panel, a row group): 1, 2, and the unit and twice it, each -1 / +1.
std::vector<index_t> edge_sizes(index_t unit) {
    std::vector<index_t> sizes;
    for (index_t n : {index_t(1), index_t(2), unit - 1, unit, unit + 1, 2 * unit - 1, 2 * unit + 3, 3 * unit + 1})
        if (n >= 1 && std::find(sizes.begin(), sizes.end(), n) == sizes.end()) sizes.push_back(n);
    return sizes;
}

template <class T>
class MicroKernel : public ::testing::Test {};
TYPED_TEST_SUITE(MicroKernel, attend_test::scalar_types, attend_test::scalar_names);

TYPED_TEST(MicroKernel, ScoresFromPanelsEqualQTimesKTransposedAndWriteNothingPastTheirColumns) {
    using T = TypeParam;
    using mt = micro_tile<T>;
    attend_test::rng g(11);
    const T guard = T(12345);
    for (index_t rows : edge_sizes(mt::rows))
        for (index_t nk : edge_sizes(mt::cols))
            for (index_t head_dim : edge_sizes(mt::lanes)) {
                const index_t ldq = head_dim + 3, ldk = head_dim + 1, lds = nk + 5;
                const auto q = random_values<T>(g, rows * ldq), k = random_values<T>(g, nk * ldk);
                std::vector<T> panels(static_cast<std::size_t>(mt::panel_elements(nk, head_dim)));
                attend::detail::pack_key_panels(k.data(), ldk, nk, head_dim, panels.data());
                std::vector<T> scores(static_cast<std::size_t>(rows * lds), guard);
                attend::detail::scores_from_panels(q.data(), ldq, rows, head_dim, panels.data(), nk, scores.data(),
                                                   lds);
                for (index_t r = 0; r < rows; ++r)
                    for (index_t j = 0; j < lds; ++j) {
                        const T got = scores[static_cast<std::size_t>(r * lds + j)];
                        if (j >= nk) {
                            ASSERT_EQ(got, guard) << "wrote past column " << nk << " of row " << r;
                            continue;
                        }
                        double exact = 0, magnitude = 0;
                        for (index_t x = 0; x < head_dim; ++x) {
                            const double p = static_cast<double>(q[static_cast<std::size_t>(r * ldq + x)]) *
                                             static_cast<double>(k[static_cast<std::size_t>(j * ldk + x)]);
                            exact += p;
                            magnitude += std::abs(p);
                        }
                        const double bound =
                            4.0 * static_cast<double>(head_dim) * std::numeric_limits<T>::epsilon() * magnitude;
                        ASSERT_LE(std::abs(static_cast<double>(got) - exact), bound)
                            << "rows " << rows << " keys " << nk << " head_dim " << head_dim << " at " << r << ", "
                            << j;
                    }
            }
}

TYPED_TEST(MicroKernel, AccumulateFromValuesAddsPTimesVToWhatWasThere) {
    using T = TypeParam;
    using mt = micro_tile<T>;
    attend_test::rng g(12);
    for (index_t rows : edge_sizes(mt::rows))
        for (index_t nk : {index_t(1), index_t(7), mt::cols + 1, index_t(300)})
            for (index_t dv : edge_sizes(mt::cols)) {  // around a packet too: cols is two packets
                // 300 keys 600 apart: many of the L1-sized key slices accumulate_from_values cuts V into.
                const index_t ldp = nk + 2, ldv = nk == 300 ? 600 : dv + 3, lda = dv + 1;
                const auto p = random_values<T>(g, rows * ldp), v = random_values<T>(g, nk * ldv);
                const auto before = random_values<T>(g, rows * lda);
                auto acc = before;
                std::vector<T> panels(static_cast<std::size_t>(nk * dv));
                attend::detail::pack_value_panels(v.data(), ldv, nk, dv, panels.data());
                attend::detail::accumulate_from_values(p.data(), ldp, index_t(1), rows, nk, v.data(), ldv, dv,
                                                       panels.data(), nk * mt::cols, acc.data(), lda);
                for (index_t r = 0; r < rows; ++r)
                    for (index_t e = 0; e < lda; ++e) {
                        const auto at = static_cast<std::size_t>(r * lda + e);
                        if (e >= dv) {
                            ASSERT_EQ(acc[at], before[at]) << "wrote past value column " << dv;
                            continue;
                        }
                        double exact = static_cast<double>(before[at]), magnitude = std::abs(exact);
                        for (index_t j = 0; j < nk; ++j) {
                            const double t = static_cast<double>(p[static_cast<std::size_t>(r * ldp + j)]) *
                                             static_cast<double>(v[static_cast<std::size_t>(j * ldv + e)]);
                            exact += t;
                            magnitude += std::abs(t);
                        }
                        const double bound =
                            4.0 * static_cast<double>(nk + 1) * std::numeric_limits<T>::epsilon() * magnitude;
                        ASSERT_LE(std::abs(static_cast<double>(acc[at]) - exact), bound)
                            << "rows " << rows << " keys " << nk << " dv " << dv << " at " << r << ", " << e;
                    }
            }
}

TYPED_TEST(MicroKernel, ARowGetsTheSameBitsWhateverRowsShareItsCall) {
    using T = TypeParam;
    using mt = micro_tile<T>;
    attend_test::rng g(13);
    const index_t rows = 2 * mt::rows + 1, nk = 2 * mt::cols + 3, head_dim = 3 * mt::lanes + 1, dv = head_dim;
    const auto q = random_values<T>(g, rows * head_dim), k = random_values<T>(g, nk * head_dim);
    const auto v = random_values<T>(g, nk * dv);
    std::vector<T> panels(static_cast<std::size_t>(mt::panel_elements(nk, head_dim)));
    attend::detail::pack_key_panels(k.data(), head_dim, nk, head_dim, panels.data());

    std::vector<T> together(static_cast<std::size_t>(rows * nk)), alone(together.size());
    attend::detail::scores_from_panels(q.data(), head_dim, rows, head_dim, panels.data(), nk, together.data(), nk);
    for (index_t r = 0; r < rows; ++r)
        attend::detail::scores_from_panels(q.data() + r * head_dim, head_dim, 1, head_dim, panels.data(), nk,
                                           alone.data() + r * nk, nk);
    ASSERT_EQ(std::memcmp(together.data(), alone.data(), together.size() * sizeof(T)), 0);

    std::vector<T> value_panels(static_cast<std::size_t>(nk * dv));
    attend::detail::pack_value_panels(v.data(), dv, nk, dv, value_panels.data());
    std::vector<T> acc_together(static_cast<std::size_t>(rows * dv), T(0)), acc_alone(acc_together);
    attend::detail::accumulate_from_values(together.data(), nk, index_t(1), rows, nk, v.data(), dv, dv,
                                           value_panels.data(), nk * mt::cols, acc_together.data(), dv);
    for (index_t r = 0; r < rows; ++r)
        attend::detail::accumulate_from_values(together.data() + r * nk, nk, index_t(1), 1, nk, v.data(), dv, dv,
                                               value_panels.data(), nk * mt::cols, acc_alone.data() + r * dv, dv);
    EXPECT_EQ(std::memcmp(acc_together.data(), acc_alone.data(), acc_together.size() * sizeof(T)), 0);
}

TEST(MicroKernelRowGroups, CoverEveryRowOnceInOrderAndNoneIsShortWhereAWholeTileFits) {
    for (index_t tile : {index_t(6), index_t(12)})
        for (index_t rows = 0; rows <= 5 * tile; ++rows) {
            std::vector<std::pair<index_t, index_t>> groups;
            attend::detail::for_each_row_group(rows, tile, [&](index_t r0, index_t m) { groups.emplace_back(r0, m); });
            index_t next = 0;
            for (const auto& [r0, m] : groups) {
                EXPECT_EQ(r0, next) << "tile " << tile << " rows " << rows;
                EXPECT_TRUE(m >= 1 && m <= tile) << "tile " << tile << " rows " << rows << " group of " << m;
                // At least half a tile whenever the rows fill one: 256 rows of 12 end in 8 + 8, not 12 + 4.
                EXPECT_TRUE(rows < tile || 2 * m >= tile) << "tile " << tile << " rows " << rows << " group of " << m;
                next = r0 + m;
            }
            EXPECT_EQ(next, rows) << "tile " << tile;
        }
}

TYPED_TEST(MicroKernel, AccumulatingFromATransposedTileEqualsAccumulatingFromItsTransposedCopy) {
    // The backward's dV += Pᵀ dO reads P by columns (row stride 1, column stride ld): the same result as the same
    // call on a row-major copy of Pᵀ, for every edge of the row groups and column blocks.
    using T = TypeParam;
    using mt = micro_tile<T>;
    attend_test::rng g(15);
    for (index_t rows : edge_sizes(mt::rows))
        for (index_t dv : edge_sizes(mt::cols)) {
            const index_t nk = 2 * mt::rows + 1, ld = rows + 3;  // p stored [nk, ld], read as its transpose [rows, nk]
            const auto stored = random_values<T>(g, nk * ld), v = random_values<T>(g, nk * dv);
            std::vector<T> copy(static_cast<std::size_t>(rows * nk));
            for (index_t r = 0; r < rows; ++r)
                for (index_t j = 0; j < nk; ++j)
                    copy[static_cast<std::size_t>(r * nk + j)] = stored[static_cast<std::size_t>(j * ld + r)];
            std::vector<T> panels(static_cast<std::size_t>(nk * dv));
            attend::detail::pack_value_panels(v.data(), dv, nk, dv, panels.data());
            std::vector<T> by_columns(static_cast<std::size_t>(rows * dv), T(0.5)), by_rows(by_columns);
            attend::detail::accumulate_from_values(stored.data(), index_t(1), ld, rows, nk, v.data(), dv, dv,
                                                   panels.data(), nk * mt::cols, by_columns.data(), dv);
            attend::detail::accumulate_from_values(copy.data(), nk, index_t(1), rows, nk, v.data(), dv, dv,
                                                   panels.data(), nk * mt::cols, by_rows.data(), dv);
            // Columns in packets: the same pmadd sequence, the same bits. The last dv % lanes columns are a plain
            // loop the compiler may contract into FMAs differently for the two strides: within rounding.
            const index_t in_packets = dv / mt::lanes * mt::lanes;
            for (index_t r = 0; r < rows; ++r)
                for (index_t e = 0; e < dv; ++e) {
                    const auto at = static_cast<std::size_t>(r * dv + e);
                    if (e < in_packets)
                        ASSERT_EQ(std::memcmp(&by_columns[at], &by_rows[at], sizeof(T)), 0)
                            << "rows " << rows << " dv " << dv << " at " << r << ", " << e;
                    else
                        ASSERT_NEAR(by_columns[at], by_rows[at],
                                    4.0 * nk * (nk + 1) * std::numeric_limits<T>::epsilon())
                            << "rows " << rows << " dv " << dv << " at " << r << ", " << e;
                }
        }
}

TYPED_TEST(MicroKernel, PackedPanelsHoldEachKeyDimensionOnceAndZerosPastTheLastKey) {
    using T = TypeParam;
    using mt = micro_tile<T>;
    attend_test::rng g(14);
    const index_t nk = mt::cols + mt::lanes + 1, head_dim = mt::lanes + 2, ld = head_dim + 1;
    const auto k = random_values<T>(g, nk * ld);
    std::vector<T> panels(static_cast<std::size_t>(mt::panel_elements(nk, head_dim)), T(-7));
    ASSERT_EQ(panels.size(), static_cast<std::size_t>(2 * mt::cols * head_dim));
    attend::detail::pack_key_panels(k.data(), ld, nk, head_dim, panels.data());
    for (index_t p0 = 0; p0 < 2 * mt::cols; p0 += mt::cols)
        for (index_t x = 0; x < head_dim; ++x)
            for (index_t c = 0; c < mt::cols; ++c) {
                const T got = panels[static_cast<std::size_t>(p0 * head_dim + x * mt::cols + c)];
                const index_t key = p0 + c;
                ASSERT_EQ(got, key < nk ? k[static_cast<std::size_t>(key * ld + x)] : T(0)) << key << ", " << x;
            }
}

/// packet_exp's bounds: ln FLT_MIN rounded up (exp of it is at least FLT_MIN; below it, 0) and ln FLT_MAX (its upper
/// clamp).
constexpr float exp_lowest = -87.3365402f, exp_highest = 88.7228394f;

/// A float's bits, and the float of given bits: negative floats' bits grow with their magnitude.
std::uint32_t float_bits(float x) {
    std::uint32_t u = 0;
    std::memcpy(&u, &x, sizeof u);
    return u;
}
float float_of_bits(std::uint32_t u) {
    float x = 0;
    std::memcpy(&x, &u, sizeof x);
    return x;
}

/// Every 4099th float from low up to -0 and from 0 up to high (low < 0 < high), evenly in their ordering.
void push_floats_spread(std::vector<float>& xs, float low, float high) {
    for (std::uint32_t u = float_bits(low); u > float_bits(-0.0f); u -= 4099) xs.push_back(float_of_bits(u));
    for (std::uint32_t u = 0; u < float_bits(high); u += 4099) xs.push_back(float_of_bits(u));
}

/// `count` consecutive floats from the one `below` floats under centre.
void push_floats_from(std::vector<float>& xs, float centre, int below, int count) {
    const float inf = std::numeric_limits<float>::infinity();
    float x = centre;
    for (int i = 0; i < below; ++i) x = std::nextafter(x, -inf);
    for (int i = 0; i < count; ++i, x = std::nextafter(x, inf)) xs.push_back(x);
}

/// packet_exp<NotAboveHighest> on xs (padded to whole packets), in place.
template <bool NotAboveHighest = false>
void packet_exp_of(std::vector<float>& xs) {
    using exp_type = attend::detail::packet_exp<NotAboveHighest>;
    constexpr std::size_t lanes = Eigen::internal::packet_traits<float>::size;
    xs.resize((xs.size() + lanes - 1) / lanes * lanes, 0.0f);
    const exp_type exp;
    for (std::size_t j = 0; j < xs.size(); j += lanes)
        Eigen::internal::pstoreu(xs.data() + j, exp(Eigen::internal::ploadu<typename exp_type::value>(xs.data() + j)));
}

// The softmax's float exp (packet_exp, in exp_shifted_sum) on this instruction set's packets, over floats spread
// evenly through its whole range, every float next to its range's ends and where 2^m changes, and the specials:
// within 2 ulp of exp, never subnormal, 0 below ln FLT_MIN and for -inf, exactly 1 at 0, +inf past 88.37 (past ln
// FLT_MAX on AVX-512), NaN kept.
TEST(PacketExp, IsWithinTwoUlpOfExpAndNeverSubnormal) {
    const float lowest = exp_lowest, highest = exp_highest, inf = std::numeric_limits<float>::infinity();
    std::vector<float> xs;
    push_floats_spread(xs, lowest, highest);  // about 500 000 floats
    for (const float centre : {lowest, highest, 88.3762626f, 0.0f, 0.34657359f, -0.34657359f, 1.03972077f, -45.0f})
        push_floats_from(xs, centre, 3000, 6000);
    const std::vector<float> specials = {
        -inf, inf, std::numeric_limits<float>::quiet_NaN(), -0.0f, 0.0f, -1e30f, 1e30f, -88.0f, -100.0f};
    xs.insert(xs.end(), specials.begin(), specials.end());
    const std::size_t n = xs.size();
    std::vector<float> es = xs;
    packet_exp_of(es);
    for (std::size_t j = 0; j < n; ++j) {
        const float x = xs[j], e = es[j];
        if (std::isnan(x)) {
            EXPECT_TRUE(std::isnan(e));
        } else if (x < lowest) {
            ASSERT_EQ(e, 0.0f) << x;
        } else if (std::isinf(e)) {
            ASSERT_GT(x, 88.376f) << x;  // +inf only where exp is within 1.25 of FLT_MAX or above it
#if defined(EIGEN_VECTORIZE_AVX512)
            ASSERT_GT(x, 88.7228317f) << x;  // scalef: +inf only where exp overflows, past ln FLT_MAX
#endif
        } else {
            const double want = std::exp(static_cast<double>(x));
            const float near = static_cast<float>(want);
            const double ulp = static_cast<double>(std::nextafter(near, inf)) - static_cast<double>(near);
            ASSERT_GE(e, std::numeric_limits<float>::min()) << x;
            ASSERT_LE(std::abs(static_cast<double>(e) - want), 2 * ulp) << x;
        }
    }
    EXPECT_EQ(es[n - 6], 1.0f);  // -0 and 0: exactly 1, the weight of a row's maximum
    EXPECT_EQ(es[n - 5], 1.0f);
    EXPECT_EQ(es[n - 8], inf);
    EXPECT_EQ(es[n - 9], 0.0f);
}

// The online softmax's exp of scores minus their own row's maximum (at most 0) leaves out packet_exp's upper clamp:
// the same bits as with it for every argument up to ln FLT_MAX, the clamp's bound, and for -inf and NaN. Floats
// spread evenly through that range in their ordering, and every float next to its ends and to 0.
TEST(PacketExp, WithoutTheUpperClampGivesTheSameBitsUpToLnFltMax) {
    const float lowest = exp_lowest, highest = exp_highest, inf = std::numeric_limits<float>::infinity();
    std::vector<float> xs;
    push_floats_spread(xs, -inf, highest);
    for (const float centre : {lowest, highest, 0.0f})
        push_floats_from(xs, centre, 3000, centre == highest ? 3001 : 6000);
    xs.insert(xs.end(), {-inf, -0.0f, std::numeric_limits<float>::quiet_NaN(), highest});
    ASSERT_EQ(xs.back(), highest);
    std::vector<float> clamped = xs, unclamped = xs;
    packet_exp_of<false>(clamped);
    packet_exp_of<true>(unclamped);
    for (std::size_t j = 0; j < xs.size(); ++j) ASSERT_EQ(float_bits(unclamped[j]), float_bits(clamped[j])) << xs[j];
}

// max_of (the online softmax's row maximum over a tile's scores): the largest element wherever it sits, for every
// length around the four packets it keeps side by side and the scalar tail, at any start alignment; a row of -inf
// (every key masked) gives -inf.
TYPED_TEST(MicroKernel, MaxOfIsTheLargestElementWhereverItSitsAndWhateverTheLength) {
    using T = TypeParam;
    using attend::detail::max_of;
    constexpr index_t lanes = Eigen::internal::packet_traits<T>::size;
    const T minus_inf = -std::numeric_limits<T>::infinity();
    attend_test::rng g(31);
    const auto pool = random_values<T>(g, 6 * lanes + 8);
    for (index_t offset = 0; offset < 2; ++offset)
        for (index_t n = 1; n <= 5 * lanes + 3; ++n)
            for (index_t at = 0; at < n; ++at) {
                std::vector<T> x(pool.begin() + offset, pool.begin() + offset + n);
                x[static_cast<std::size_t>(at)] = T(9);
                if (n > 2) x[static_cast<std::size_t>((at + 1) % n)] = minus_inf;
                ASSERT_EQ(max_of(x.data(), n), T(9)) << n << ", " << at << ", " << offset;
            }
    const std::vector<T> masked(static_cast<std::size_t>(3 * lanes + 1), minus_inf);
    EXPECT_EQ(max_of(masked.data(), static_cast<index_t>(masked.size())), minus_inf);
}

// The soft-cap that finish_tile applies, on this instruction set's packets (support/soft_cap_check.hpp).
TYPED_TEST(MicroKernel, SoftCapOnPacketsAndTailIsWithinFourEpsilonsOfTanh) {
    attend_test::expect_soft_cap_within_four_epsilons<TypeParam>();
}

// Soft-capping fused into the products (the capped_tanh epilogue, how the tiled kernels cap float scores) gives the
// bits of capping the stored products afterwards (soft_cap, the decode path's GEMV rows), edge panels included.
TEST(MicroKernelEpilogue, ProductsCappedInRegistersEqualSoftCapOfTheStoredProductsBitForBit) {
    using mt = micro_tile<float>;
    attend_test::rng g(23);
    const float guard = 12345.0f, cap = 3.0f;
    for (index_t rows : edge_sizes(mt::rows))
        for (index_t nk : edge_sizes(mt::cols))
            for (index_t head_dim : {index_t(1), index_t(7), index_t(64)}) {
                const index_t lds = nk + 5;
                auto q = random_values<float>(g, rows * head_dim);
                for (auto& x : q) x *= 6.0f;  // scores from about 0 to far past the cap
                const auto k = random_values<float>(g, nk * head_dim);
                std::vector<float> panels(static_cast<std::size_t>(mt::panel_elements(nk, head_dim)));
                attend::detail::pack_key_panels(k.data(), head_dim, nk, head_dim, panels.data());
                std::vector<float> after(static_cast<std::size_t>(rows * lds), guard), fused = after;
                attend::detail::scores_from_panels(q.data(), head_dim, rows, head_dim, panels.data(), nk, after.data(),
                                                   lds);
                for (index_t r = 0; r < rows; ++r) attend::detail::soft_cap(after.data() + r * lds, nk, cap);
                attend::detail::scores_from_panels(q.data(), head_dim, rows, head_dim, panels.data(), nk, fused.data(),
                                                   lds, attend::detail::capped_tanh(cap));
                ASSERT_EQ(std::memcmp(after.data(), fused.data(), after.size() * sizeof(float)), 0)
                    << rows << " rows, " << nk << " keys, head_dim " << head_dim;
            }
}

// The row kernels (row_kernel.hpp): a few query rows against key and value rows read where they are stored.

/// n rows of `dim` values of storage S holding `values` (already representable in S), and their q8_0 blocks.
template <class S>
std::vector<S> stored_as(const std::vector<float>& values) {
    std::vector<S> x(values.size());
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<S>(values[i]);
    return x;
}

/// Random values that bf16, fp16 and q8_0 (block scale 2^-7 x 127 / 127) all hold exactly: multiples of 2^-7 in
/// [-127, 127] x 2^-7 with at most 8 significant bits, and one value per 32 at the block's extreme, so the q8_0
/// scale is 2^-7 exactly.
std::vector<float> representable_values(attend_test::rng& g, index_t n) {
    std::vector<float> x(static_cast<std::size_t>(n));
    for (index_t i = 0; i < n; ++i) {
        const int q = i % 32 == 0 ? 127 : static_cast<int>(std::lround(g.uniform(-127.0, 127.0)));
        x[static_cast<std::size_t>(i)] = std::ldexp(static_cast<float>(q), -7);
    }
    return x;
}

/// Values a q4_0 block holds exactly: (n - 8) / 8 with n in [0, 15], each block's first value -1 (its extreme, so
/// d = 1 / 8).
std::vector<float> representable_q4_values(attend_test::rng& g, index_t n) {
    std::vector<float> x(static_cast<std::size_t>(n));
    for (index_t i = 0; i < n; ++i) {
        const int q = i % 32 == 0 ? 0 : static_cast<int>(g.uniform_int(0, 15));
        x[static_cast<std::size_t>(i)] = std::ldexp(static_cast<float>(q - 8), -3);
    }
    return x;
}

/// Rows of `dim` values quantized into blocks of type Block.
template <class Block>
std::vector<Block> quantized_rows(const std::vector<float>& values, index_t dim) {
    std::vector<Block> b(values.size() / static_cast<std::size_t>(Block::size));
    for (std::size_t r = 0; r < values.size() / static_cast<std::size_t>(dim); ++r)
        attend::detail::quantize_row(values.data() + r * static_cast<std::size_t>(dim), dim,
                                     b.data() + r * static_cast<std::size_t>(dim / Block::size));
    return b;
}

/// Scores and P V of `rows` rows from the row kernels over keys and values stored as S (rows `dim` apart; q8_0
/// rows dim / 32 blocks apart), with the scan on.
template <class S>
struct row_results {
    std::vector<float> scores, acc;
    bool non_finite_keys = false, non_finite_values = false;
    float largest_key = 0;
};
template <class S>
row_results<S> run_row_kernels(const std::vector<float>& q, const std::vector<float>& p, index_t rows, index_t nk,
                               index_t dim, const std::vector<S>& k, const std::vector<S>& v, index_t row_elements) {
    row_results<S> out;
    out.scores.assign(static_cast<std::size_t>(rows * nk), 0.0f);
    out.acc.assign(static_cast<std::size_t>(rows * dim), 0.5f);
    attend::detail::row_scan<float> keys, values;
    attend::detail::scores_of_rows(
        rows, q.data(), dim, dim, nk, [&](index_t j) { return k.data() + j * row_elements; }, out.scores.data(), nk,
        &keys);
    attend::detail::accumulate_rows(
        rows, p.data(), nk, nk, dim, [&](index_t j) { return v.data() + j * row_elements; }, out.acc.data(), dim,
        &values);
    out.non_finite_keys = keys.non_finite();
    out.non_finite_values = values.non_finite();
    out.largest_key = keys.largest();
    return out;
}

TEST(RowKernels, EveryStorageGivesTheBitsOfFloatRowsHoldingItsValuesAndEachRowTheBitsItGetsAlone) {
    attend_test::rng g(41);
    // 544: 17 blocks, one more than a row's cached scales (widening_row), so the last widens its own.
    for (index_t dim : {index_t(32), index_t(64), index_t(96), index_t(128), index_t(544)})
        for (index_t rows = 1; rows <= attend::detail::row_kernel_rows; ++rows)
            for (index_t nk : {index_t(1), index_t(5), index_t(300)}) {
                const auto q = random_values<float>(g, rows * dim), k = representable_values(g, nk * dim),
                           v = representable_values(g, nk * dim);
                auto p = random_values<float>(g, rows * nk);
                const auto want = run_row_kernels<float>(q, p, rows, nk, dim, k, v, dim);
                // Against double: sums of rounded products within the usual bound.
                for (index_t r = 0; r < rows; ++r)
                    for (index_t j = 0; j < nk; ++j) {
                        double exact = 0, magnitude = 0;
                        for (index_t x = 0; x < dim; ++x) {
                            const double t = double(q[static_cast<std::size_t>(r * dim + x)]) *
                                             k[static_cast<std::size_t>(j * dim + x)];
                            exact += t;
                            magnitude += std::abs(t);
                        }
                        ASSERT_NEAR(want.scores[static_cast<std::size_t>(r * nk + j)], exact,
                                    4.0 * double(dim) * 0x1p-24 * magnitude);
                    }
                const auto check = [&](const auto& got, const char* name) {
                    ASSERT_EQ(std::memcmp(got.scores.data(), want.scores.data(), want.scores.size() * 4), 0) << name;
                    ASSERT_EQ(std::memcmp(got.acc.data(), want.acc.data(), want.acc.size() * 4), 0) << name;
                    ASSERT_EQ(got.largest_key, want.largest_key) << name;
                };
                check(run_row_kernels<bf16>(q, p, rows, nk, dim, stored_as<bf16>(k), stored_as<bf16>(v), dim), "bf16");
                check(run_row_kernels<Eigen::half>(q, p, rows, nk, dim, stored_as<Eigen::half>(k),
                                                   stored_as<Eigen::half>(v), dim),
                      "fp16");
                check(run_row_kernels<attend::q8_0_block>(q, p, rows, nk, dim,
                                                          quantized_rows<attend::q8_0_block>(k, dim),
                                                          quantized_rows<attend::q8_0_block>(v, dim), dim / 32),
                      "q8_0");
                // q4_0 holds other values exactly: against float rows of those.
                const auto k4 = representable_q4_values(g, nk * dim), v4 = representable_q4_values(g, nk * dim);
                const auto want4 = run_row_kernels<float>(q, p, rows, nk, dim, k4, v4, dim);
                const auto got4 = run_row_kernels<attend::q4_0_block>(q, p, rows, nk, dim,
                                                                      quantized_rows<attend::q4_0_block>(k4, dim),
                                                                      quantized_rows<attend::q4_0_block>(v4, dim),
                                                                      dim / 32);
                ASSERT_EQ(std::memcmp(got4.scores.data(), want4.scores.data(), want4.scores.size() * 4), 0) << "q4_0";
                ASSERT_EQ(std::memcmp(got4.acc.data(), want4.acc.data(), want4.acc.size() * 4), 0) << "q4_0";
                ASSERT_EQ(got4.largest_key, want4.largest_key) << "q4_0";
                for (index_t r = 0; r < rows; ++r) {  // alone
                    const std::vector<float> q1(q.begin() + r * dim, q.begin() + (r + 1) * dim),
                        p1(p.begin() + r * nk, p.begin() + (r + 1) * nk);
                    const auto one = run_row_kernels<float>(q1, p1, 1, nk, dim, k, v, dim);
                    ASSERT_EQ(std::memcmp(one.scores.data(), want.scores.data() + r * nk,
                                          static_cast<std::size_t>(nk) * 4),
                              0);
                    ASSERT_EQ(std::memcmp(one.acc.data(), want.acc.data() + r * dim, static_cast<std::size_t>(dim) * 4),
                              0);
                }
            }
}

/// accumulate_rows on `rows` rows, `dim` columns and nk keys against a double sum of the same products.
void expect_accumulates_p_times_v(attend_test::rng& g, index_t rows, index_t dim, index_t nk) {
    const auto v = random_values<float>(g, nk * dim);
    const auto p = random_values<float>(g, rows * nk);
    std::vector<float> acc = random_values<float>(g, rows * dim);
    const auto before = acc;
    attend::detail::accumulate_rows(
        rows, p.data(), nk, nk, dim, [&](index_t j) { return v.data() + j * dim; }, acc.data(), dim,
        static_cast<attend::detail::row_scan<float>*>(nullptr));
    for (index_t r = 0; r < rows; ++r)
        for (index_t e = 0; e < dim; ++e) {
            double exact = before[static_cast<std::size_t>(r * dim + e)], magnitude = std::abs(exact);
            for (index_t j = 0; j < nk; ++j) {
                const double t =
                    double(p[static_cast<std::size_t>(r * nk + j)]) * v[static_cast<std::size_t>(j * dim + e)];
                exact += t;
                magnitude += std::abs(t);
            }
            ASSERT_NEAR(acc[static_cast<std::size_t>(r * dim + e)], exact, 4.0 * double(nk + 1) * 0x1p-24 * magnitude)
                << rows << " rows, column " << e << " of " << dim << ", " << nk << " keys";
        }
}

TEST(RowKernels, AccumulateAddsPTimesVToWhatWasThereOnEveryColumnEdge) {
    attend_test::rng g(42);
    for (index_t dim : edge_sizes(micro_tile<float>::lanes))
        for (index_t rows : {index_t(1), index_t(3), index_t(8)})
            for (index_t nk : {index_t(1), index_t(9), index_t(700)}) expect_accumulates_p_times_v(g, rows, dim, nk);
}

/// The value kernel splits the columns into groups of the widths it has kernels for (powers of two and the widest
/// the registers allow, which depends on the row count): every split, remainders included, adds each column once.
TEST(RowKernels, AccumulateAddsEveryColumnOnceWhateverGroupsItsWidthSplitsInto) {
    attend_test::rng g(7);
    const index_t lanes = attend::detail::row_lanes<float>;
    for (index_t rows = 1; rows <= attend::detail::row_kernel_rows; ++rows)
        for (index_t packets = 1; packets <= attend::detail::rows::register_budget + 3; ++packets)
            for (index_t tail : {index_t(0), index_t(1)})
                expect_accumulates_p_times_v(g, rows, packets * lanes + tail, 5);
}

/// Float, fp16 and bf16 rows (16-bit keys are noted on their own bits, 32 at a time, on AVX-512): dims with and
/// without a tail of packets and of 32-value runs, the value first, last, and in the middle of a run.
TEST(RowKernels, TheScanFindsTheLargestKeyAndAnyNaNOrInfinityInPacketsAndTails) {
    attend_test::rng g(43);
    const auto check = [&](auto stored) {
        using S = decltype(stored);
        const auto as_stored = [](const std::vector<float>& x) {
            if constexpr (std::is_same_v<S, float>) return x;
            else return stored_as<S>(x);
        };
        for (index_t dim : {index_t(7), index_t(64), index_t(67), index_t(80), index_t(128)})
            for (const float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                                    -std::numeric_limits<float>::infinity(), 0.0f})
                for (index_t at : {index_t(0), dim / 2, dim - 1}) {  // first packet, middle, tail when dim has one
                    SCOPED_TRACE(std::string(sizeof(S) == 4            ? "float"
                                             : std::is_same_v<S, bf16> ? "bf16"
                                                                       : "fp16") +
                                 ", dim " + std::to_string(dim) + ", at " + std::to_string(at) + ", value " +
                                 std::to_string(bad));
                    const index_t nk = 5, rows = 2;
                    const auto q = random_values<float>(g, rows * dim), p = random_values<float>(g, rows * nk);
                    auto k = random_values<float>(g, nk * dim), v = k;
                    k[static_cast<std::size_t>(3 * dim + at)] = -7.5f;
                    const auto clean = run_row_kernels<S>(q, p, rows, nk, dim, as_stored(k), as_stored(v), dim);
                    EXPECT_FALSE(clean.non_finite_keys);
                    EXPECT_FALSE(clean.non_finite_values);
                    EXPECT_EQ(clean.largest_key, 7.5f);
                    k[static_cast<std::size_t>(2 * dim + at)] = bad;
                    v[static_cast<std::size_t>(4 * dim + at)] = bad;
                    const auto found = run_row_kernels<S>(q, p, rows, nk, dim, as_stored(k), as_stored(v), dim);
                    const bool finite = std::isfinite(bad);
                    EXPECT_EQ(found.non_finite_keys, !finite);
                    EXPECT_EQ(found.non_finite_values, !finite);
                    if (finite) {
                        EXPECT_EQ(found.largest_key, 7.5f);
                    }
                }
    };
    check(float{});
    check(bf16{});
    check(Eigen::half{});
}

/// The value kernel tells a NaN or an inf among the values from the sums they reach: found where every
/// probability is 0 (0 x inf is NaN), where a +inf and a -inf meet in one sum, on every row count and column group;
/// and finite values whose products overflow the sums are not taken for one (the scan of the values decides).
TEST(RowKernels, ValuesAreFoundNonFiniteThroughTheirSumsOnlyWhenOneIs) {
    attend_test::rng g(46);
    const float inf = std::numeric_limits<float>::infinity();
    for (index_t dim : {index_t(16), index_t(67), index_t(128), index_t(400)})
        for (index_t rows = 1; rows <= attend::detail::row_kernel_rows; ++rows) {
            const index_t nk = 40;
            const auto q = random_values<float>(g, rows * dim);
            const auto k = random_values<float>(g, nk * dim);
            std::vector<float> zeros(static_cast<std::size_t>(rows * nk), 0.0f), ones(zeros.size(), 1.0f);
            for (const index_t at : {index_t(0), dim / 2, dim - 1}) {
                SCOPED_TRACE("dim " + std::to_string(dim) + ", rows " + std::to_string(rows) + ", column " +
                             std::to_string(at));
                auto v = random_values<float>(g, nk * dim);
                v[static_cast<std::size_t>(7 * dim + at)] = inf;
                EXPECT_TRUE(run_row_kernels<float>(q, zeros, rows, nk, dim, k, v, dim).non_finite_values);
                v[static_cast<std::size_t>(30 * dim + at)] = -inf;
                EXPECT_TRUE(run_row_kernels<float>(q, ones, rows, nk, dim, k, v, dim).non_finite_values);
                // 40 values of 3e38 times 1: the sums overflow to +inf, the values are finite.
                std::vector<float> large(static_cast<std::size_t>(nk * dim), 3e38f);
                const auto overflowed = run_row_kernels<float>(q, ones, rows, nk, dim, k, large, dim);
                EXPECT_TRUE(std::isinf(overflowed.acc[static_cast<std::size_t>(at)]));
                EXPECT_FALSE(overflowed.non_finite_values);
            }
        }
}

/// Float keys noted two packets at a time (AVX-512) tell a NaN by their scores, which a finite key whose scores
/// overflow makes inf too: the keys' own scan then finds them finite, with their largest magnitude.
TEST(RowKernels, KeysWhoseScoresOverflowAreFoundFiniteWithTheirLargestMagnitude) {
    attend_test::rng g(47);
    for (index_t dim : {index_t(16), index_t(67), index_t(128)})
        for (index_t rows : {index_t(1), index_t(4), index_t(8)}) {
            const index_t nk = 9;
            const std::vector<float> q(static_cast<std::size_t>(rows * dim), 1e20f);
            const auto p = random_values<float>(g, rows * nk);
            auto k = random_values<float>(g, nk * dim);
            k[static_cast<std::size_t>(5 * dim + dim / 2)] = 3e19f;  // q.k about 3e39: +inf in float
            const auto found = run_row_kernels<float>(q, p, rows, nk, dim, k, k, dim);
            EXPECT_TRUE(std::isinf(found.scores[5])) << "dim " << dim << ", rows " << rows;
            EXPECT_FALSE(found.non_finite_keys) << "dim " << dim << ", rows " << rows;
            EXPECT_EQ(found.largest_key, 3e19f) << "dim " << dim << ", rows " << rows;
        }
}

/// sums_of_packets<N> for one N: each sum against predux of the same packet, bit for bit.
template <class Acc, int N>
void expect_predux_bits(attend_test::rng& g) {
    using packet = attend::detail::row_packet<Acc>;
    constexpr index_t lanes = attend::detail::row_lanes<Acc>;
    packet a[N];
    for (int n = 0; n < N; ++n) {
        // Magnitudes over many binades, so that the order of the additions shows in the rounding.
        alignas(64) Acc x[lanes];
        for (index_t l = 0; l < lanes; ++l)
            x[l] = static_cast<Acc>(g.uniform(-1.0, 1.0) * std::ldexp(1.0, static_cast<int>(g.uniform(-30.0, 30.0))));
        a[n] = Eigen::internal::pload<packet>(x);
    }
    Acc sums[N];
    attend::detail::sums_of_packets(a, sums);
    for (int n = 0; n < N; ++n) {
        const Acc want = Eigen::internal::predux(a[n]);
        EXPECT_EQ(std::memcmp(&sums[n], &want, sizeof(Acc)), 0) << N << " packets, packet " << n;
    }
}
template <class Acc, int... N>
void expect_predux_bits_for(attend_test::rng& g, std::integer_sequence<int, N...>) {
    for (int round = 0; round < 50; ++round) (expect_predux_bits<Acc, N + 1>(g), ...);
}

TEST(RowKernels, ADotOfTwoRowsIsExactOnSmallValuesAndTheSameForEveryStorage) {
    // The backward's delta = rowsum(dO * O) (dot_of_rows): values k / 16, |k| <= 64, are exact in float, fp16 and
    // bf16, and so are their products and sums of a few hundred of them, so every storage type must give the exact
    // sum (a dropped or repeated product, or a wrong tail, would not), whatever the length around the packets.
    attend_test::rng g(29);
    for (index_t n : {index_t(1), index_t(7), index_t(15), index_t(16), index_t(17), index_t(31), index_t(32),
                      index_t(33), index_t(48), index_t(64), index_t(100), index_t(128), index_t(257)}) {
        std::vector<float> a(static_cast<std::size_t>(n)), b(a.size());
        double exact = 0;
        for (std::size_t x = 0; x < a.size(); ++x) {
            a[x] = static_cast<float>(static_cast<int>(g.uniform() * 129) - 64) / 16;
            b[x] = static_cast<float>(static_cast<int>(g.uniform() * 129) - 64) / 16;
            exact += static_cast<double>(a[x]) * b[x];
        }
        std::vector<Eigen::half> ah(a.begin(), a.end()), bh(b.begin(), b.end());
        std::vector<Eigen::bfloat16> ab(a.begin(), a.end()), bb(b.begin(), b.end());
        std::vector<double> ad(a.begin(), a.end()), bd(b.begin(), b.end());
        EXPECT_EQ(attend::detail::dot_of_rows<float>(a.data(), b.data(), n), static_cast<float>(exact)) << n;
        EXPECT_EQ(attend::detail::dot_of_rows<float>(ah.data(), bh.data(), n), static_cast<float>(exact)) << n;
        EXPECT_EQ(attend::detail::dot_of_rows<float>(ab.data(), bb.data(), n), static_cast<float>(exact)) << n;
        EXPECT_EQ(attend::detail::dot_of_rows<double>(ad.data(), bd.data(), n), exact) << n;
    }
}

TEST(RowKernels, SumsOfManyPacketsAtOnceHaveTheBitsOfOnePreduxEach) {
    attend_test::rng g(44);
    expect_predux_bits_for<float>(g, std::make_integer_sequence<int, 20>{});
    expect_predux_bits_for<double>(g, std::make_integer_sequence<int, 6>{});
}

TEST(RowKernels, AKeyScoredInAGroupOfKeysGetsTheBitsItGetsAlone) {
    attend_test::rng g(45);
    for (index_t dim : {index_t(16), index_t(67), index_t(128)})
        for (index_t rows = 1; rows <= attend::detail::row_kernel_rows; ++rows) {
            const index_t nk = 11;
            const auto q = random_values<float>(g, rows * dim), k = random_values<float>(g, nk * dim);
            std::vector<float> together(static_cast<std::size_t>(rows * nk)), alone(together.size());
            attend::detail::scores_of_rows(
                rows, q.data(), dim, dim, nk, [&](index_t j) { return k.data() + j * dim; }, together.data(), nk,
                static_cast<attend::detail::row_scan<float>*>(nullptr));
            for (index_t j = 0; j < nk; ++j)
                attend::detail::scores_of_rows(
                    rows, q.data(), dim, dim, 1, [&](index_t) { return k.data() + j * dim; }, alone.data() + j, nk,
                    static_cast<attend::detail::row_scan<float>*>(nullptr));
            ASSERT_EQ(std::memcmp(together.data(), alone.data(), together.size() * sizeof(float)), 0)
                << rows << " rows, dim " << dim;
        }
}

#if ATTEND_BF16_DOT_PRODUCTS
// The bf16 pair kernels (micro_kernel_bf16.hpp), on targets with AVX-512 BF16. A product of two bf16 values is
// exact in float, so the bound against the double sum of the same products is the float summation's.

using attend::detail::bf16_tile;
std::vector<bf16> random_bf16(attend_test::rng& g, index_t n) {
    std::vector<bf16> x(static_cast<std::size_t>(n));
    for (auto& v : x) v = bf16(static_cast<float>(g.uniform(-1.0, 1.0)));
    return x;
}

/// Rows of `width` bf16 values `ld` apart, as 32-bit pair words `ld / 2`... apart: q-pairs for the score kernel.
std::vector<std::uint32_t> pair_words(const std::vector<bf16>& x, index_t rows, index_t ld, index_t width) {
    std::vector<std::uint32_t> w(static_cast<std::size_t>(rows * width / 2));
    for (index_t r = 0; r < rows; ++r)
        for (index_t j = 0; j < width / 2; ++j)
            w[static_cast<std::size_t>(r * width / 2 + j)] = attend::detail::pair_at(x.data() + r * ld + 2 * j);
    return w;
}

TEST(Bf16PairKernels, KeyPanelsHoldEachKeyPairOnceAndZerosPastTheLastKey) {
    attend_test::rng g(31);
    for (index_t nk : edge_sizes(bf16_tile::cols))
        for (index_t head_dim : {index_t(2), index_t(30), index_t(32), index_t(34), index_t(64)})
            for (index_t ld : {head_dim, head_dim + 1, head_dim + 2}) {  // an odd ld takes the element-wise path
                const auto k = random_bf16(g, nk * ld);
                const index_t pairs = head_dim / 2;
                std::vector<std::uint32_t> panels(static_cast<std::size_t>(bf16_tile::key_panel_words(nk, head_dim)),
                                                  7u);
                attend::detail::pack_key_pairs(k.data(), ld, nk, head_dim, panels.data());
                for (index_t c = 0; c < (nk + 31) / 32 * 32; ++c)
                    for (index_t x = 0; x < pairs; ++x) {
                        const std::uint32_t want = c < nk ? attend::detail::pair_at(k.data() + c * ld + 2 * x) : 0u;
                        ASSERT_EQ(panels[static_cast<std::size_t>((c / 32) * 32 * pairs + x * 32 + c % 32)], want)
                            << "key " << c << " pair " << x << " of " << nk << " keys, head_dim " << head_dim << ", ld "
                            << ld;
                    }
            }
}

/// The pair path's two products as the tiled kernel takes them here: the vdpbf16ps kernels, and AMX tiles where
/// this target and machine have them (micro_kernel_amx.hpp; head dims of whole tiles only). Same operands, same
/// bounds.
struct pair_products {
    const char* name;
    bool tiles;
    bool takes(index_t head_dim) const { return !tiles || head_dim % 32 == 0; }
    template <class Epilogue>
    void scores(const std::uint32_t* q, index_t ldq, index_t rows, index_t head_dim, const std::uint32_t* panels,
                index_t nk, float scale, float* out, index_t lds, const Epilogue& epilogue) const {
        if (!tiles)
            attend::detail::scores_from_key_pairs(q, ldq, rows, head_dim, panels, nk, scale, out, lds, epilogue);
        else if constexpr (attend::detail::amx_tiles)
            attend::detail::scores_from_key_tiles(q, ldq, rows, head_dim, panels, nk, scale, out, lds, epilogue);
    }
    void accumulate(const std::uint32_t* p, index_t ldp, index_t rows, index_t nk, index_t dv,
                    const std::uint32_t* blocks, index_t block_stride, float* acc, index_t lda) const {
        if (!tiles) attend::detail::accumulate_from_value_pairs(p, ldp, rows, nk, dv, blocks, block_stride, acc, lda);
        else if constexpr (attend::detail::amx_tiles)
            attend::detail::accumulate_from_value_tiles(p, ldp, rows, nk, dv, blocks, block_stride, acc, lda);
    }
};
std::vector<pair_products> pair_products_here() {
    std::vector<pair_products> here{{"vdpbf16ps", false}};
    if (attend::detail::amx_tiles && attend::detail::amx_tiles_ready()) here.push_back({"AMX tiles", true});
    return here;
}

TEST(Bf16PairKernels, AmxTilesAreTakenWhereTheTargetHasThem) {
    // A target compiled with AMX-BF16 takes the pair path on tiles or not at all (Linux grants them from 5.16).
    if (!attend::detail::amx_target) GTEST_SKIP() << "this target has no AMX-BF16";
    std::printf("AMX tiles %s\n", attend::detail::amx_tiles_ready() ? "granted" : "not granted");
    EXPECT_EQ(attend::detail::bf16_pairs_for(64, 64), attend::detail::amx_tiles_ready());
    EXPECT_FALSE(attend::detail::bf16_pairs_for(48, 64)) << "not whole tiles: the float kernels";
}

#if ATTEND_AMX_TILES
/// tile_config::use in a function of its own, as where the compiler does not inline it into its caller.
__attribute__((noinline)) void configure(attend::detail::amx::tile_config& config, index_t rows) {
    config.use(rows, 0, 16);
}

/// A rows x 32 product on the tiles whose configuration and operands were filled just before the tiles load them:
/// all-a rows times all-b columns over 16 pairs.
__attribute__((noinline)) std::vector<float> product_of_fresh_tiles(float a, float b, index_t rows) {
    const auto pair_of = [](float x) {
        const auto bits = Eigen::numext::bit_cast<std::uint16_t>(Eigen::bfloat16(x));
        return static_cast<std::uint32_t>(bits) * 0x10001u;
    };
    std::uint32_t left[16 * 16], right[16 * 32];  // [16 rows, 16 pairs], [16 pairs, 32 columns]
    std::fill(std::begin(left), std::end(left), pair_of(a));
    std::fill(std::begin(right), std::end(right), pair_of(b));
    std::vector<float> out(static_cast<std::size_t>(rows * 32));
    attend::detail::amx::tile_config config;
    configure(config, rows);
    _tile_zero(0);
    _tile_zero(1);
    attend::detail::amx::step(right, left, nullptr, 16, false);
    _tile_stored(0, out.data(), 32 * 4);
    _tile_stored(1, out.data() + 16, 32 * 4);
    return out;
}

TEST(Bf16PairKernels, TilesLoadTheConfigurationAndOperandsStoredJustBeforeThem) {
    // GCC 12's intrinsics tell the compiler that ldtilecfg reads 8 bytes of the configuration and tileloadd no
    // memory: there the configuration's stores in configure were dropped but for its palette's, and the first tile
    // instruction faulted (SIGILL).
    if (!attend::detail::amx_tiles_ready()) GTEST_SKIP() << "the tiles are not granted";
    for (const index_t rows : {16, 5})
        for (const float a : {1.5f, -2.0f}) {
            const auto out = product_of_fresh_tiles(a, 0.25f, rows);
            ASSERT_EQ(out.size(), static_cast<std::size_t>(rows * 32));
            for (const float x : out) ASSERT_EQ(x, 32 * a * 0.25f) << "a " << a << ", rows " << rows;
        }
}
#endif

TEST(Bf16PairKernels, ScoresAreTheScaledSumsOfExactProductsAndWriteNothingPastTheirColumns) {
    attend_test::rng g(32);
    const float guard = 12345.0f, scale = 0.125f * 1.1f;
    for (const auto& products : pair_products_here())
        for (index_t rows : edge_sizes(bf16_tile::rows))
            for (index_t nk : edge_sizes(bf16_tile::cols))
                for (index_t head_dim : {index_t(2), index_t(34), index_t(64), index_t(128)}) {
                    if (!products.takes(head_dim)) continue;
                    SCOPED_TRACE(products.name);
                    const index_t lds = nk + 3;
                    const auto q = random_bf16(g, rows * head_dim), k = random_bf16(g, nk * head_dim);
                    const auto q_pairs = pair_words(q, rows, head_dim, head_dim);
                    std::vector<std::uint32_t> panels(
                        static_cast<std::size_t>(bf16_tile::key_panel_words(nk, head_dim)));
                    attend::detail::pack_key_pairs(k.data(), head_dim, nk, head_dim, panels.data());
                    std::vector<float> scores(static_cast<std::size_t>(rows * lds), guard);
                    products.scores(q_pairs.data(), head_dim / 2, rows, head_dim, panels.data(), nk, scale,
                                    scores.data(), lds, attend::detail::micro::keep_products{});
                    for (index_t r = 0; r < rows; ++r) {
                        for (index_t c = 0; c < nk; ++c) {
                            double exact = 0, magnitude = 0;
                            for (index_t x = 0; x < head_dim; ++x) {
                                const double p = static_cast<double>(static_cast<float>(
                                                     q[static_cast<std::size_t>(r * head_dim + x)])) *
                                                 static_cast<double>(
                                                     static_cast<float>(k[static_cast<std::size_t>(c * head_dim + x)]));
                                exact += p;
                                magnitude += std::abs(p);
                            }
                            const double bound =
                                (4.0 * static_cast<double>(head_dim) + 2.0) * 0x1p-24 * magnitude * scale;
                            ASSERT_NEAR(scores[static_cast<std::size_t>(r * lds + c)], scale * exact, bound)
                                << "row " << r << " key " << c << " of " << rows << " x " << nk << ", head_dim "
                                << head_dim;
                        }
                        for (index_t c = nk; c < lds; ++c)
                            ASSERT_EQ(scores[static_cast<std::size_t>(r * lds + c)], guard);
                    }
                    // A row gets the same bits whatever rows share its call.
                    for (index_t r = 0; r < rows; ++r) {
                        std::vector<float> alone(static_cast<std::size_t>(lds), guard);
                        products.scores(q_pairs.data() + r * head_dim / 2, head_dim / 2, 1, head_dim, panels.data(), nk,
                                        scale, alone.data(), lds, attend::detail::micro::keep_products{});
                        ASSERT_EQ(std::memcmp(alone.data(), scores.data() + r * lds, static_cast<std::size_t>(nk) * 4),
                                  0);
                    }
                }
}

TEST(Bf16PairKernels, ProbabilitiesRoundToNearestEvenBf16AndOddRowsEndInAZero) {
    attend_test::rng g(33);
    for (index_t nk : edge_sizes(bf16_tile::cols)) {
        const index_t rows = 3, ldp = nk + 5, ldo = (nk + 1) / 2 + 2;
        std::vector<float> p(static_cast<std::size_t>(rows * ldp));
        for (auto& x : p) x = static_cast<float>(g.uniform(0.0, 1.0));
        std::vector<std::uint32_t> out(static_cast<std::size_t>(rows * ldo), 0xdeadbeefu);
        attend::detail::round_to_pairs(p.data(), ldp, rows, nk, out.data(), ldo);
        for (index_t r = 0; r < rows; ++r) {
            for (index_t j = 0; j < (nk + 1) / 2; ++j) {
                const bf16 lo(p[static_cast<std::size_t>(r * ldp + 2 * j)]);
                const bf16 hi = 2 * j + 1 < nk ? bf16(p[static_cast<std::size_t>(r * ldp + 2 * j + 1)]) : bf16(0.0f);
                const std::uint32_t want = std::uint32_t(attend::detail::bits_of(lo)) |
                                           std::uint32_t(attend::detail::bits_of(hi)) << 16;
                ASSERT_EQ(out[static_cast<std::size_t>(r * ldo + j)], want)
                    << "row " << r << " pair " << j << " of " << nk;
            }
            for (index_t j = (nk + 1) / 2; j < ldo; ++j)
                ASSERT_EQ(out[static_cast<std::size_t>(r * ldo + j)], 0xdeadbeefu);
        }
    }
}

TEST(Bf16PairKernels, AccumulatingValuePairsAddsRoundedPTimesVToWhatWasThere) {
    attend_test::rng g(34);
    for (const auto& products : pair_products_here())
        for (index_t rows : edge_sizes(bf16_tile::rows))
            for (index_t nk : {index_t(1), index_t(2), index_t(31), index_t(33), index_t(300), index_t(513)})
                for (index_t dv : {index_t(32), index_t(96)})
                    for (index_t ldv : {dv, dv + 3}) {
                        const auto v = random_bf16(g, nk * ldv);
                        std::vector<float> p(static_cast<std::size_t>(rows * nk));
                        for (auto& x : p) x = static_cast<float>(g.uniform(0.0, 1.0));
                        const index_t ldp = (nk + 1) / 2;
                        std::vector<std::uint32_t> p_pairs(static_cast<std::size_t>(rows * ldp));
                        attend::detail::round_to_pairs(p.data(), nk, rows, nk, p_pairs.data(), ldp);
                        const index_t block_stride = (nk + 1) / 2 * bf16_tile::cols;
                        std::vector<std::uint32_t> blocks(
                            static_cast<std::size_t>(bf16_tile::value_panel_words(nk, dv)));
                        attend::detail::pack_value_pairs(v.data(), ldv, nk, dv, blocks.data());
                        std::vector<float> acc(static_cast<std::size_t>(rows * dv));
                        for (auto& x : acc) x = static_cast<float>(g.uniform(-1.0, 1.0));
                        const auto before = acc;
                        products.accumulate(p_pairs.data(), ldp, rows, nk, dv, blocks.data(), block_stride, acc.data(),
                                            dv);
                        for (index_t r = 0; r < rows; ++r)
                            for (index_t e = 0; e < dv; ++e) {
                                double exact = before[static_cast<std::size_t>(r * dv + e)],
                                       magnitude = std::abs(exact);
                                for (index_t j = 0; j < nk; ++j) {
                                    const double t = static_cast<double>(static_cast<float>(
                                                         bf16(p[static_cast<std::size_t>(r * nk + j)]))) *
                                                     static_cast<double>(
                                                         static_cast<float>(v[static_cast<std::size_t>(j * ldv + e)]));
                                    exact += t;
                                    magnitude += std::abs(t);
                                }
                                ASSERT_NEAR(acc[static_cast<std::size_t>(r * dv + e)], exact,
                                            4.0 * static_cast<double>(nk + 1) * 0x1p-24 * magnitude)
                                    << products.name << ", row " << r << " column " << e << " of " << rows << " x "
                                    << dv << ", " << nk << " keys";
                            }
                    }
}
#endif  // ATTEND_BF16_DOT_PRODUCTS

}  // namespace
