// SPDX-License-Identifier: MIT
#pragma once
/// What the property tests of attend::scaled_dot_product_attention (sdpa.hpp), tests/unit/sdpa_*_test.cpp, share:
/// seeded random configurations (odd sizes, query_len != key_len, head_dim != value_dim, rank 3 and rank 4,
/// grouped-query attention including kv_heads == 1, float and double, every kernel: reference, tiled, automatic),
/// an independent double oracle, dense masks as plain data given to each named constructor, one random mask of
/// many kinds with its hand-built meaning, and the typed fixture SdpaProperty. Each test name states the
/// invariant; a failure prints the seed and the configuration, so it reproduces anywhere (the generator is
/// splitmix64, see random.hpp).
///
/// Tolerances (stated once, used everywhere):
///   vs the independent double oracle:  float 2e-5, double 1e-12. Inputs are in [-1, 1) and head_dim <= 9, so a
///     float score carries about head_dim * eps_f ~ 1e-6 absolute error; exp turns it into the same relative
///     error on a weight, and a sum of key_len <= 300 products w_j v_j (sum |w_j v_j| <= 1) carries at most
///     key_len * eps_f / 2 ~ 1.8e-5 in any summation order.
///   same kernel, same precision, different arrangement (GQA vs repeated K/V, hand-built vs rule masks, strided vs
///     contiguous views): float 1e-6, double 1e-13.
///   a row of allowed weights sums to 1 within (key_len + 4) * eps of T: key_len rounded quotients summed.
/// "Identical" in the tests means equal with ==, element by element, no tolerance at all (compare.hpp).

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include <attend/attend.hpp>

#include "random.hpp"
#include "scalar_names.hpp"

namespace attend_test::sdpa_properties {

using attend::index_t;
template <class T, int Rank>
using tensor = attend::tensor<T, Rank>;

/// 0 where a key is allowed without bias, -inf where it is forbidden, a finite value for an additive bias.
using bias_fn = std::function<double(index_t, index_t, index_t, index_t)>;

inline constexpr double minus_inf = -std::numeric_limits<double>::infinity();

inline std::size_t at(index_t i) { return static_cast<std::size_t>(i); }

template <class T>
double eps() {
    return static_cast<double>(std::numeric_limits<T>::epsilon());
}
template <class T>
double tol_oracle() {
    return std::is_same_v<T, float> ? 2e-5 : 1e-12;
}
template <class T>
double tol_same() {
    return std::is_same_v<T, float> ? 1e-6 : 1e-13;
}
template <class T>
double tol_row_sum(index_t key_len) {
    return static_cast<double>(key_len + 4) * eps<T>();
}

// ---------------------------------------------------------------------------------------------------------------
// Random configurations
// ---------------------------------------------------------------------------------------------------------------

struct config {
    index_t batch = 1, heads = 1, kv_heads = 1, query_len = 1, key_len = 1, head_dim = 1, value_dim = 1;
    bool rank3 = false;
    attend::kernel kernel = attend::kernel::automatic;
    std::uint64_t seed = 0;

    index_t kv_head(index_t h) const { return h / (heads / kv_heads); }
};

inline const char* name_of(attend::kernel k) {
    switch (k) {
        case attend::kernel::reference: return "reference";
        case attend::kernel::tiled: return "tiled";
        default: return "automatic";
    }
}

inline std::string describe(const config& c) {
    std::ostringstream s;
    s << "seed " << c.seed << ": rank " << (c.rank3 ? 3 : 4) << ", batch " << c.batch << ", heads " << c.heads
      << ", kv_heads " << c.kv_heads << ", query_len " << c.query_len << ", key_len " << c.key_len << ", head_dim "
      << c.head_dim << ", value_dim " << c.value_dim << ", kernel " << name_of(c.kernel);
    return s.str();
}

/// Odd sizes not tied to any tile. One configuration in ten is medium (up to 80 queries x 300 keys), so the tiled
/// kernel crosses its key tiles (128 keys in double, 256 in float), query blocks and trimming steps. heads is
/// always a multiple of kv_heads (kv_heads == 1 is MQA). The kernel is drawn among reference, tiled, automatic.
inline config random_config(std::uint64_t seed) {
    rng g(seed * 0x9E3779B97F4A7C15ULL + 0x1234567ULL);
    config c;
    c.seed = seed;
    c.rank3 = g.bernoulli(0.25);
    const bool medium = g.bernoulli(0.1);
    c.batch = g.uniform_int(1, medium ? 2 : 3);
    if (!c.rank3) {
        c.kv_heads = g.uniform_int(1, medium ? 2 : 3);
        c.heads = c.kv_heads * g.uniform_int(1, 3);
    }
    c.query_len = g.uniform_int(1, medium ? 80 : 11);
    c.key_len = medium ? g.uniform_int(100, 300) : g.uniform_int(1, 13);
    c.head_dim = g.uniform_int(1, 9);
    c.value_dim = g.uniform_int(1, 9);
    static const attend::kernel kernels[] = {attend::kernel::reference, attend::kernel::tiled,
                                             attend::kernel::automatic};
    c.kernel = kernels[g.uniform_int(0, 2)];
    return c;
}

template <class T>
struct inputs {
    tensor<T, 4> q, k, v;  // always held as rank 4; rank-3 configurations have heads == kv_heads == 1
};

template <class T>
inputs<T> random_inputs(const config& c, double magnitude = 1.0) {
    inputs<T> x{tensor<T, 4>(c.batch, c.heads, c.query_len, c.head_dim),
                tensor<T, 4>(c.batch, c.kv_heads, c.key_len, c.head_dim),
                tensor<T, 4>(c.batch, c.kv_heads, c.key_len, c.value_dim)};
    attend_test::fill_uniform(x.q, c.seed * 3 + 1, -magnitude, magnitude);
    attend_test::fill_uniform(x.k, c.seed * 3 + 2, -magnitude, magnitude);
    attend_test::fill_uniform(x.v, c.seed * 3 + 3, -1.0, 1.0);
    return x;
}

// Rank-3 [batch, len, dim] is the same data as rank-4 [batch, 1, len, dim].
template <class T>
tensor<T, 3> drop_heads(const tensor<T, 4>& x) {
    tensor<T, 3> y(x.dimension(0), x.dimension(2), x.dimension(3));
    std::copy_n(x.data(), x.size(), y.data());
    return y;
}
template <class T>
tensor<T, 4> add_heads(const tensor<T, 3>& x) {
    tensor<T, 4> y(x.dimension(0), 1, x.dimension(1), x.dimension(2));
    std::copy_n(x.data(), x.size(), y.data());
    return y;
}
template <class T>
tensor<T, 3> add_heads(const tensor<T, 2>& x) {
    tensor<T, 3> y(x.dimension(0), 1, x.dimension(1));
    std::copy_n(x.data(), x.size(), y.data());
    return y;
}

template <class T>
struct outputs {
    tensor<T, 4> out, weights;  // [batch, heads, query_len, value_dim | key_len]
    tensor<T, 3> lse;           // [batch, heads, query_len]
};

/// Runs attention in the configuration's rank and kernel, always asking for weights and lse, and returns the
/// results as rank 4.
template <class T, class Mask>
outputs<T> run(const config& c, const inputs<T>& x, const Mask& mask, attend::sdpa_options o = {}) {
    o.need_weights = true;
    o.need_lse = true;
    o.kernel = c.kernel;
    if (c.rank3) {
        const auto q3 = drop_heads(x.q), k3 = drop_heads(x.k), v3 = drop_heads(x.v);
        const auto r = attend::scaled_dot_product_attention(q3, k3, v3, mask, o);
        return {add_heads(r.out), add_heads(r.weights), add_heads(r.lse)};
    }
    auto r = attend::scaled_dot_product_attention(x.q, x.k, x.v, mask, o);
    return {std::move(r.out), std::move(r.weights), std::move(r.lse)};
}

inline attend::sdpa_options zero_rows() {
    attend::sdpa_options o;
    o.empty_rows = attend::empty_rows::zero;
    return o;
}

// ---------------------------------------------------------------------------------------------------------------
// The independent oracle: plain double loops, no Eigen products, no shared code with the library
// ---------------------------------------------------------------------------------------------------------------

struct oracle_result {
    index_t batch = 0, heads = 0, query_len = 0, key_len = 0, value_dim = 0;
    std::vector<double> out, weights, lse;

    double o(index_t b, index_t h, index_t i, index_t d) const {
        return out[at(((b * heads + h) * query_len + i) * value_dim + d)];
    }
    double w(index_t b, index_t h, index_t i, index_t j) const {
        return weights[at(((b * heads + h) * query_len + i) * key_len + j)];
    }
    double l(index_t b, index_t h, index_t i) const { return lse[at((b * heads + h) * query_len + i)]; }
};

/// softmax(scale * q.k + bias) along the key axis, in double; rows without an allowed key (or padded rows) give
/// zero output, zero weights and lse = -inf.
template <class T>
oracle_result oracle(const config& c, const inputs<T>& x, double scale, const bias_fn& bias,
                     const std::function<bool(index_t, index_t)>& padded = nullptr) {
    oracle_result r;
    r.batch = c.batch;
    r.heads = c.heads;
    r.query_len = c.query_len;
    r.key_len = c.key_len;
    r.value_dim = c.value_dim;
    r.out.assign(at(c.batch * c.heads * c.query_len * c.value_dim), 0.0);
    r.weights.assign(at(c.batch * c.heads * c.query_len * c.key_len), 0.0);
    r.lse.assign(at(c.batch * c.heads * c.query_len), minus_inf);
    std::vector<double> s(at(c.key_len));
    for (index_t b = 0; b < c.batch; ++b)
        for (index_t h = 0; h < c.heads; ++h)
            for (index_t i = 0; i < c.query_len; ++i) {
                if (padded && padded(b, i)) continue;
                const index_t g = c.kv_head(h);
                double max = minus_inf;
                for (index_t j = 0; j < c.key_len; ++j) {
                    double dot = 0;
                    for (index_t d = 0; d < c.head_dim; ++d)
                        dot += static_cast<double>(x.q(b, h, i, d)) * static_cast<double>(x.k(b, g, j, d));
                    const double bj = bias(b, h, i, j);
                    s[at(j)] = bj == minus_inf ? minus_inf : scale * dot + bj;
                    max = std::max(max, s[at(j)]);
                }
                if (max == minus_inf) continue;
                double sum = 0;
                for (index_t j = 0; j < c.key_len; ++j) sum += std::exp(s[at(j)] - max);
                r.lse[at((b * c.heads + h) * c.query_len + i)] = max + std::log(sum);
                for (index_t j = 0; j < c.key_len; ++j) {
                    const double w = std::exp(s[at(j)] - max) / sum;
                    r.weights[at(((b * c.heads + h) * c.query_len + i) * c.key_len + j)] = w;
                    for (index_t d = 0; d < c.value_dim; ++d)
                        r.out[at(((b * c.heads + h) * c.query_len + i) * c.value_dim + d)] +=
                            w * static_cast<double>(x.v(b, g, j, d));
                }
            }
    return r;
}

inline double default_scale(const config& c) { return 1.0 / std::sqrt(static_cast<double>(c.head_dim)); }

/// Compares library results with the oracle; forbidden weights must be exactly 0 and nothing may be NaN.
template <class T>
::testing::AssertionResult matches_oracle(const outputs<T>& r, const oracle_result& e, const bias_fn& bias,
                                          double tol) {
    for (index_t b = 0; b < e.batch; ++b)
        for (index_t h = 0; h < e.heads; ++h)
            for (index_t i = 0; i < e.query_len; ++i) {
                const double lse = static_cast<double>(r.lse(b, h, i));
                if (std::isnan(lse) ||
                    (e.l(b, h, i) == minus_inf ? lse != minus_inf : !(std::abs(lse - e.l(b, h, i)) <= tol)))
                    return ::testing::AssertionFailure()
                           << "lse(" << b << ',' << h << ',' << i << ") = " << lse << ", oracle " << e.l(b, h, i);
                for (index_t j = 0; j < e.key_len; ++j) {
                    const double w = static_cast<double>(r.weights(b, h, i, j));
                    if (bias(b, h, i, j) == minus_inf ? w != 0.0 : !(std::abs(w - e.w(b, h, i, j)) <= tol))
                        return ::testing::AssertionFailure()
                               << "weight(" << b << ',' << h << ',' << i << ',' << j << ") = " << w << ", oracle "
                               << e.w(b, h, i, j) << (bias(b, h, i, j) == minus_inf ? " (forbidden: must be 0)" : "");
                }
                for (index_t d = 0; d < e.value_dim; ++d) {
                    const double o = static_cast<double>(r.out(b, h, i, d));
                    if (!(std::abs(o - e.o(b, h, i, d)) <= tol))
                        return ::testing::AssertionFailure() << "out(" << b << ',' << h << ',' << i << ',' << d
                                                             << ") = " << o << ", oracle " << e.o(b, h, i, d);
                }
            }
    return ::testing::AssertionSuccess();
}

// ---------------------------------------------------------------------------------------------------------------
// Dense masks as plain data, and the same data through each named constructor
// ---------------------------------------------------------------------------------------------------------------

/// A dense grid with the dims a user would pass (rank 2, 3 or 4), right-aligned against the scores of the call
/// ([batch, heads, query_len, key_len] for rank 4, [batch, query_len, key_len] for rank 3). Values: for Boolean
/// grids 1 = allowed, 0 = forbidden; for additive grids the bias (-inf forbids).
struct dense_grid {
    std::vector<index_t> dims;
    std::vector<double> values;
    bool rank3_call = false;

    std::size_t flat(index_t b, index_t h, index_t i, index_t j) const {
        const std::array<index_t, 4> four{b, h, i, j};
        const std::array<index_t, 3> three{b, i, j};
        const index_t* coords = rank3_call ? three.data() : four.data();
        const std::size_t n = rank3_call ? 3 : 4;
        std::size_t f = 0;
        for (std::size_t a = 0; a < dims.size(); ++a) {
            const index_t c = coords[n - dims.size() + a];
            f = f * at(dims[a]) + (dims[a] == 1 ? 0 : at(c));
        }
        return f;
    }
    double value(index_t b, index_t h, index_t i, index_t j) const { return values[flat(b, h, i, j)]; }
};

template <class V, int R>
tensor<V, R> grid_tensor(const dense_grid& m, const std::function<V(double)>& convert) {
    std::array<index_t, R> d{};
    for (std::size_t a = 0; a < at(R); ++a) d[a] = m.dims[a];
    tensor<V, R> t(d);
    for (index_t n = 0; n < t.size(); ++n) t.data()[n] = convert(m.values[at(n)]);
    return t;
}

/// PyTorch SDPA's convention: true = may attend.
inline attend::allowed_mask as_allowed(const dense_grid& m) {
    const std::function<bool(double)> f = [](double x) { return x != 0.0; };
    switch (m.dims.size()) {
        case 2: return attend::allowed_mask::query_key_grid(grid_tensor<bool, 2>(m, f));
        case 3: return attend::allowed_mask::from_torch_sdpa(grid_tensor<bool, 3>(m, f));
        default: return attend::allowed_mask::from_torch_sdpa(grid_tensor<bool, 4>(m, f));
    }
}

/// nn.MultiheadAttention's convention: true = blocked.
inline attend::forbidden_mask as_forbidden(const dense_grid& m) {
    const std::function<bool(double)> f = [](double x) { return x == 0.0; };
    switch (m.dims.size()) {
        case 2: return attend::forbidden_mask::query_key_grid(grid_tensor<bool, 2>(m, f));
        case 3: return attend::forbidden_mask::from_torch_mha(grid_tensor<bool, 3>(m, f));
        default: return attend::forbidden_mask::from_torch_mha(grid_tensor<bool, 4>(m, f));
    }
}

template <class T>
attend::additive_mask<T> as_additive(const dense_grid& m) {
    const std::function<T(double)> f = [](double x) { return static_cast<T>(x); };
    switch (m.dims.size()) {
        case 2: return attend::additive_mask<T>::query_key_grid(grid_tensor<T, 2>(m, f));
        case 3: return attend::additive_mask<T>::from_values(grid_tensor<T, 3>(m, f));
        default: return attend::additive_mask<T>::from_values(grid_tensor<T, 4>(m, f));
    }
}

/// Shapes that broadcast to the scores: full, per head, per batch, key padding style [B,1,1,S], plain [L,S].
inline std::vector<index_t> random_grid_dims(rng& g, const config& c) {
    const index_t B = c.batch, H = c.heads, L = c.query_len, S = c.key_len;
    if (c.rank3) {
        switch (g.uniform_int(0, 3)) {
            case 0: return {L, S};
            case 1: return {B, L, S};
            case 2: return {1, L, S};
            default: return {B, 1, S};
        }
    }
    switch (g.uniform_int(0, 5)) {
        case 0: return {L, S};
        case 1: return {B, H, L, S};
        case 2: return {1, H, L, S};
        case 3: return {B, 1, 1, S};
        case 4: return {H, L, S};
        default: return {B, 1, L, S};
    }
}

/// Boolean grid; each mask row gets at least one allowed key when ensure_rows.
inline dense_grid random_bool_grid(rng& g, const config& c, double p_allowed, bool ensure_rows) {
    dense_grid m;
    m.rank3_call = c.rank3;
    m.dims = random_grid_dims(g, c);
    std::size_t n = 1;
    for (index_t d : m.dims) n *= at(d);
    m.values.resize(n);
    for (double& x : m.values) x = g.bernoulli(p_allowed) ? 1.0 : 0.0;
    if (ensure_rows) {
        const std::size_t S = at(m.dims.back());
        for (std::size_t row = 0; row < n / S; ++row) m.values[row * S + at(g.uniform_int(0, m.dims.back() - 1))] = 1;
    }
    return m;
}

/// Additive grid: biases exactly representable in float, -inf where forbidden.
inline dense_grid random_additive_grid(rng& g, const config& c, double p_allowed, bool ensure_rows) {
    static const double biases[] = {0.0, -2.5, 0.75, 1.25, -0.5, 3.0};
    dense_grid m = random_bool_grid(g, c, p_allowed, ensure_rows);
    for (double& x : m.values) x = x != 0.0 ? biases[g.uniform_int(0, 5)] : minus_inf;
    return m;
}

inline bias_fn grid_bias(const dense_grid& m) {
    return [m](index_t b, index_t h, index_t i, index_t j) { return m.values[m.flat(b, h, i, j)]; };
}
inline bias_fn boolean_grid_bias(const dense_grid& m) {
    return [m](index_t b, index_t h, index_t i, index_t j) {
        return m.values[m.flat(b, h, i, j)] != 0.0 ? 0.0 : minus_inf;
    };
}
inline bias_fn allowed_if(std::function<bool(index_t, index_t, index_t, index_t)> allowed) {
    return [allowed](index_t b, index_t h, index_t i, index_t j) { return allowed(b, h, i, j) ? 0.0 : minus_inf; };
}

inline const char* name_of(attend::alignment a) {
    return a == attend::alignment::top_left ? "top_left" : "bottom_right";
}

/// The shift of the causal diagonal, written out from the definitions in alignment.hpp.
inline index_t diagonal_shift(attend::alignment a, const config& c) {
    return a == attend::alignment::bottom_right ? c.key_len - c.query_len : 0;
}

/// Calls f(mask, name, bias) with one random mask of many kinds; bias is the hand-built meaning of the mask
/// (0 allowed, -inf forbidden, finite = additive bias), written independently of the library. Rows may be empty;
/// callers pass empty_rows::zero.
template <class T, class F>
void with_random_mask(rng& g, const config& c, F&& f) {
    const index_t S = c.key_len;
    const auto align = g.bernoulli(0.5) ? attend::alignment::top_left : attend::alignment::bottom_right;
    const index_t shift = diagonal_shift(align, c);
    switch (g.uniform_int(0, 11)) {
        case 0: {
            const auto m = random_bool_grid(g, c, g.uniform(0.2, 0.9), g.bernoulli(0.7));
            f(as_allowed(m), std::string("dense allowed_mask"), boolean_grid_bias(m));
            return;
        }
        case 1: {
            const auto m = random_bool_grid(g, c, g.uniform(0.2, 0.9), g.bernoulli(0.7));
            f(attend::to_allowed(as_forbidden(m)), std::string("forbidden_mask through to_allowed"),
              boolean_grid_bias(m));
            return;
        }
        case 2:
            f(attend::causal(align), std::string("causal ") + name_of(align),
              allowed_if([shift](index_t, index_t, index_t i, index_t j) { return j <= i + shift; }));
            return;
        case 3: {
            std::vector<index_t> lengths;
            for (index_t b = 0; b < c.batch; ++b) lengths.push_back(g.uniform_int(0, S));
            f(attend::key_padding(lengths), std::string("key_padding"),
              allowed_if([lengths](index_t b, index_t, index_t, index_t j) { return j < lengths[at(b)]; }));
            return;
        }
        case 4: {
            const index_t left = g.uniform_int(0, S), right = g.uniform_int(0, S);
            f(attend::sliding_window(left, right, align), std::string("sliding_window ") + name_of(align),
              allowed_if([=](index_t, index_t, index_t i, index_t j) {
                  return i + shift - left <= j && j <= i + shift + right;
              }));
            return;
        }
        case 5: {
            const index_t prefix = g.uniform_int(0, S);
            f(attend::prefix_lm(prefix, align), std::string("prefix_lm ") + name_of(align),
              allowed_if([=](index_t, index_t, index_t i, index_t j) { return j < prefix || j <= i + shift; }));
            return;
        }
        case 6: {
            std::vector<index_t> lengths;
            for (index_t b = 0; b < c.batch; ++b) lengths.push_back(g.uniform_int(0, S));
            f(attend::causal(align) && attend::key_padding(lengths), std::string("causal && key_padding"),
              allowed_if(
                  [=](index_t b, index_t, index_t i, index_t j) { return j <= i + shift && j < lengths[at(b)]; }));
            return;
        }
        case 7: {
            const auto m = random_bool_grid(g, c, 0.3, false);
            f(as_allowed(m) || attend::causal(align), std::string("dense || causal"),
              allowed_if([=](index_t b, index_t h, index_t i, index_t j) {
                  return m.value(b, h, i, j) != 0.0 || j <= i + shift;
              }));
            return;
        }
        case 8: {
            const auto m = random_bool_grid(g, c, 0.6, false);
            f(!as_allowed(m), std::string("!dense"),
              allowed_if([=](index_t b, index_t h, index_t i, index_t j) { return m.value(b, h, i, j) == 0.0; }));
            return;
        }
        case 9: {
            const auto m = random_additive_grid(g, c, g.uniform(0.3, 0.9), g.bernoulli(0.7));
            f(as_additive<T>(m), std::string("additive_mask"), grid_bias(m));
            return;
        }
        case 10: {
            const auto m = random_additive_grid(g, c, 0.8, false);
            f(as_additive<T>(m) + attend::causal(align), std::string("additive + causal"),
              [=](index_t b, index_t h, index_t i, index_t j) {
                  return j <= i + shift ? m.value(b, h, i, j) : minus_inf;
              });
            return;
        }
        default:
            f(attend::no_mask{}, std::string("no mask"), [](index_t, index_t, index_t, index_t) { return 0.0; });
            return;
    }
}

// The fixture of every SdpaProperty test, typed over the two supported scalar types. It lives here, not in
// the test files, so that the files built together in one executable share one fixture class, as gtest
// requires of a test suite.
template <class T>
class SdpaProperty : public ::testing::Test {};
TYPED_TEST_SUITE(SdpaProperty, attend_test::scalar_types, attend_test::scalar_names);

}  // namespace attend_test::sdpa_properties
