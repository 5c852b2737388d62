// SPDX-License-Identifier: MIT
// Properties of attend::scaled_dot_product_attention (sdpa.hpp) over many seeded random configurations: odd
// sizes, query_len != key_len, head_dim != value_dim, rank 3 and rank 4, grouped-query attention (including
// kv_heads == 1), float and double, every kernel (reference, tiled, automatic). Each test name states the
// invariant; a failure prints the seed and the configuration, so it reproduces anywhere (the generator is
// splitmix64, see support/random.hpp).
//
// Tolerances (stated once, used everywhere):
//   vs the independent double oracle:  float 2e-5, double 1e-12. Inputs are in [-1, 1) and head_dim <= 9, so a
//     float score carries about head_dim * eps_f ~ 1e-6 absolute error; exp turns it into the same relative
//     error on a weight, and a sum of key_len <= 300 products w_j v_j (sum |w_j v_j| <= 1) carries at most
//     key_len * eps_f / 2 ~ 1.8e-5 in any summation order.
//   same kernel, same precision, different arrangement (GQA vs repeated K/V, hand-built vs rule masks, strided vs
//     contiguous views): float 1e-6, double 1e-13.
//   a row of allowed weights sums to 1 within (key_len + 4) * eps of T: key_len rounded quotients summed.
// "Identical" below means equal with ==, element by element (no tolerance at all).

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include <attend/attend.hpp>

#include "support/random.hpp"
#include "support/scalar_names.hpp"

namespace {

using attend::index;
using attend_test::rng;
template <class T, int Rank>
using tensor = attend::tensor<T, Rank>;

/// 0 where a key is allowed without bias, -inf where it is forbidden, a finite value for an additive bias.
using bias_fn = std::function<double(index, index, index, index)>;

constexpr double minus_inf = -std::numeric_limits<double>::infinity();

std::size_t at(index i) { return static_cast<std::size_t>(i); }

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
double tol_row_sum(index key_len) {
    return static_cast<double>(key_len + 4) * eps<T>();
}

// ---------------------------------------------------------------------------------------------------------------
// Random configurations
// ---------------------------------------------------------------------------------------------------------------

struct config {
    index batch = 1, heads = 1, kv_heads = 1, query_len = 1, key_len = 1, head_dim = 1, value_dim = 1;
    bool rank3 = false;
    attend::kernel kernel = attend::kernel::automatic;
    std::uint64_t seed = 0;

    index kv_head(index h) const { return h / (heads / kv_heads); }
};

const char* name_of(attend::kernel k) {
    switch (k) {
        case attend::kernel::reference: return "reference";
        case attend::kernel::tiled: return "tiled";
        default: return "automatic";
    }
}

std::string describe(const config& c) {
    std::ostringstream s;
    s << "seed " << c.seed << ": rank " << (c.rank3 ? 3 : 4) << ", batch " << c.batch << ", heads " << c.heads
      << ", kv_heads " << c.kv_heads << ", query_len " << c.query_len << ", key_len " << c.key_len << ", head_dim "
      << c.head_dim << ", value_dim " << c.value_dim << ", kernel " << name_of(c.kernel);
    return s.str();
}

/// Odd sizes not tied to any tile. One configuration in ten is medium (up to 80 queries x 300 keys), so the tiled
/// kernel crosses its key tiles (128 keys in double, 256 in float), query blocks and trimming steps. heads is
/// always a multiple of kv_heads (kv_heads == 1 is MQA). The kernel is drawn among reference, tiled, automatic.
config random_config(std::uint64_t seed) {
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

attend::sdpa_options zero_rows() {
    attend::sdpa_options o;
    o.empty_rows = attend::empty_rows::zero;
    return o;
}

// ---------------------------------------------------------------------------------------------------------------
// The independent oracle: plain double loops, no Eigen products, no shared code with the library
// ---------------------------------------------------------------------------------------------------------------

struct oracle_result {
    index batch = 0, heads = 0, query_len = 0, key_len = 0, value_dim = 0;
    std::vector<double> out, weights, lse;

    double o(index b, index h, index i, index d) const {
        return out[at(((b * heads + h) * query_len + i) * value_dim + d)];
    }
    double w(index b, index h, index i, index j) const {
        return weights[at(((b * heads + h) * query_len + i) * key_len + j)];
    }
    double l(index b, index h, index i) const { return lse[at((b * heads + h) * query_len + i)]; }
};

/// softmax(scale * q.k + bias) along the key axis, in double; rows without an allowed key (or padded rows) give
/// zero output, zero weights and lse = -inf.
template <class T>
oracle_result oracle(const config& c, const inputs<T>& x, double scale, const bias_fn& bias,
                     const std::function<bool(index, index)>& padded = nullptr) {
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
    for (index b = 0; b < c.batch; ++b)
        for (index h = 0; h < c.heads; ++h)
            for (index i = 0; i < c.query_len; ++i) {
                if (padded && padded(b, i)) continue;
                const index g = c.kv_head(h);
                double max = minus_inf;
                for (index j = 0; j < c.key_len; ++j) {
                    double dot = 0;
                    for (index d = 0; d < c.head_dim; ++d)
                        dot += static_cast<double>(x.q(b, h, i, d)) * static_cast<double>(x.k(b, g, j, d));
                    const double bj = bias(b, h, i, j);
                    s[at(j)] = bj == minus_inf ? minus_inf : scale * dot + bj;
                    max = std::max(max, s[at(j)]);
                }
                if (max == minus_inf) continue;
                double sum = 0;
                for (index j = 0; j < c.key_len; ++j) sum += std::exp(s[at(j)] - max);
                r.lse[at((b * c.heads + h) * c.query_len + i)] = max + std::log(sum);
                for (index j = 0; j < c.key_len; ++j) {
                    const double w = std::exp(s[at(j)] - max) / sum;
                    r.weights[at(((b * c.heads + h) * c.query_len + i) * c.key_len + j)] = w;
                    for (index d = 0; d < c.value_dim; ++d)
                        r.out[at(((b * c.heads + h) * c.query_len + i) * c.value_dim + d)] +=
                            w * static_cast<double>(x.v(b, g, j, d));
                }
            }
    return r;
}

double default_scale(const config& c) { return 1.0 / std::sqrt(static_cast<double>(c.head_dim)); }

/// Compares library results with the oracle; forbidden weights must be exactly 0 and nothing may be NaN.
template <class T>
::testing::AssertionResult matches_oracle(const outputs<T>& r, const oracle_result& e, const bias_fn& bias,
                                          double tol) {
    for (index b = 0; b < e.batch; ++b)
        for (index h = 0; h < e.heads; ++h)
            for (index i = 0; i < e.query_len; ++i) {
                const double lse = static_cast<double>(r.lse(b, h, i));
                if (std::isnan(lse) || (e.l(b, h, i) == minus_inf ? lse != minus_inf
                                                                  : !(std::abs(lse - e.l(b, h, i)) <= tol)))
                    return ::testing::AssertionFailure() << "lse(" << b << ',' << h << ',' << i << ") = " << lse
                                                         << ", oracle " << e.l(b, h, i);
                for (index j = 0; j < e.key_len; ++j) {
                    const double w = static_cast<double>(r.weights(b, h, i, j));
                    if (bias(b, h, i, j) == minus_inf ? w != 0.0 : !(std::abs(w - e.w(b, h, i, j)) <= tol))
                        return ::testing::AssertionFailure()
                               << "weight(" << b << ',' << h << ',' << i << ',' << j << ") = " << w << ", oracle "
                               << e.w(b, h, i, j) << (bias(b, h, i, j) == minus_inf ? " (forbidden: must be 0)" : "");
                }
                for (index d = 0; d < e.value_dim; ++d) {
                    const double o = static_cast<double>(r.out(b, h, i, d));
                    if (!(std::abs(o - e.o(b, h, i, d)) <= tol))
                        return ::testing::AssertionFailure() << "out(" << b << ',' << h << ',' << i << ',' << d
                                                             << ") = " << o << ", oracle " << e.o(b, h, i, d);
                }
            }
    return ::testing::AssertionSuccess();
}

/// Same dims and every element within tol (equal infinities match); tol = 0 means identical.
template <class T, int Rank>
::testing::AssertionResult near(const tensor<T, Rank>& a, const tensor<T, Rank>& b, double tol) {
    for (std::size_t d = 0; d < static_cast<std::size_t>(Rank); ++d)
        if (a.dimension(d) != b.dimension(d))
            return ::testing::AssertionFailure() << "dimension " << d << " differs: " << a.dimension(d) << " vs "
                                                 << b.dimension(d);
    for (index n = 0; n < a.size(); ++n) {
        const double x = static_cast<double>(a.data()[n]), y = static_cast<double>(b.data()[n]);
        const bool ok = tol == 0 ? x == y : (x == y || std::abs(x - y) <= tol);
        if (!ok)
            return ::testing::AssertionFailure() << "flat index " << n << ": " << x << " vs " << y << " (|diff| "
                                                 << std::abs(x - y) << ", tolerance " << tol << ')';
    }
    return ::testing::AssertionSuccess();
}

template <class T, int Rank>
::testing::AssertionResult identical(const tensor<T, Rank>& a, const tensor<T, Rank>& b) {
    return near(a, b, 0.0);
}

template <class T, int Rank>
bool has_nan(const tensor<T, Rank>& t) {
    for (index n = 0; n < t.size(); ++n)
        if (std::isnan(t.data()[n])) return true;
    return false;
}

// ---------------------------------------------------------------------------------------------------------------
// Dense masks as plain data, and the same data through each named constructor
// ---------------------------------------------------------------------------------------------------------------

/// A dense grid with the dims a user would pass (rank 2, 3 or 4), right-aligned against the scores of the call
/// ([batch, heads, query_len, key_len] for rank 4, [batch, query_len, key_len] for rank 3). Values: for Boolean
/// grids 1 = allowed, 0 = forbidden; for additive grids the bias (-inf forbids).
struct dense_grid {
    std::vector<index> dims;
    std::vector<double> values;
    bool rank3_call = false;

    std::size_t flat(index b, index h, index i, index j) const {
        const std::array<index, 4> four{b, h, i, j};
        const std::array<index, 3> three{b, i, j};
        const index* coords = rank3_call ? three.data() : four.data();
        const std::size_t n = rank3_call ? 3 : 4;
        std::size_t f = 0;
        for (std::size_t a = 0; a < dims.size(); ++a) {
            const index c = coords[n - dims.size() + a];
            f = f * at(dims[a]) + (dims[a] == 1 ? 0 : at(c));
        }
        return f;
    }
    double value(index b, index h, index i, index j) const { return values[flat(b, h, i, j)]; }
};

template <class V, int R>
tensor<V, R> grid_tensor(const dense_grid& m, const std::function<V(double)>& convert) {
    std::array<index, R> d{};
    for (std::size_t a = 0; a < at(R); ++a) d[a] = m.dims[a];
    tensor<V, R> t(d);
    for (index n = 0; n < t.size(); ++n) t.data()[n] = convert(m.values[at(n)]);
    return t;
}

/// PyTorch SDPA's convention: true = may attend.
attend::allowed_mask as_allowed(const dense_grid& m) {
    const std::function<bool(double)> f = [](double x) { return x != 0.0; };
    switch (m.dims.size()) {
        case 2: return attend::allowed_mask::from_torch_sdpa(grid_tensor<bool, 2>(m, f));
        case 3: return attend::allowed_mask::from_torch_sdpa(grid_tensor<bool, 3>(m, f));
        default: return attend::allowed_mask::from_torch_sdpa(grid_tensor<bool, 4>(m, f));
    }
}

/// nn.MultiheadAttention's convention: true = blocked.
attend::forbidden_mask as_forbidden(const dense_grid& m) {
    const std::function<bool(double)> f = [](double x) { return x == 0.0; };
    switch (m.dims.size()) {
        case 2: return attend::forbidden_mask::from_torch_mha(grid_tensor<bool, 2>(m, f));
        case 3: return attend::forbidden_mask::from_torch_mha(grid_tensor<bool, 3>(m, f));
        default: return attend::forbidden_mask::from_torch_mha(grid_tensor<bool, 4>(m, f));
    }
}

template <class T>
attend::additive_mask<T> as_additive(const dense_grid& m) {
    const std::function<T(double)> f = [](double x) { return static_cast<T>(x); };
    switch (m.dims.size()) {
        case 2: return attend::additive_mask<T>::from_values(grid_tensor<T, 2>(m, f));
        case 3: return attend::additive_mask<T>::from_values(grid_tensor<T, 3>(m, f));
        default: return attend::additive_mask<T>::from_values(grid_tensor<T, 4>(m, f));
    }
}

/// Shapes that broadcast to the scores: full, per head, per batch, key padding style [B,1,1,S], plain [L,S].
std::vector<index> random_grid_dims(rng& g, const config& c) {
    const index B = c.batch, H = c.heads, L = c.query_len, S = c.key_len;
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
dense_grid random_bool_grid(rng& g, const config& c, double p_allowed, bool ensure_rows) {
    dense_grid m;
    m.rank3_call = c.rank3;
    m.dims = random_grid_dims(g, c);
    std::size_t n = 1;
    for (index d : m.dims) n *= at(d);
    m.values.resize(n);
    for (double& x : m.values) x = g.bernoulli(p_allowed) ? 1.0 : 0.0;
    if (ensure_rows) {
        const std::size_t S = at(m.dims.back());
        for (std::size_t row = 0; row < n / S; ++row) m.values[row * S + at(g.uniform_int(0, m.dims.back() - 1))] = 1;
    }
    return m;
}

/// Additive grid: biases exactly representable in float, -inf where forbidden.
dense_grid random_additive_grid(rng& g, const config& c, double p_allowed, bool ensure_rows) {
    static const double biases[] = {0.0, -2.5, 0.75, 1.25, -0.5, 3.0};
    dense_grid m = random_bool_grid(g, c, p_allowed, ensure_rows);
    for (double& x : m.values) x = x != 0.0 ? biases[g.uniform_int(0, 5)] : minus_inf;
    return m;
}

bias_fn grid_bias(const dense_grid& m) {
    return [m](index b, index h, index i, index j) { return m.values[m.flat(b, h, i, j)]; };
}
bias_fn boolean_grid_bias(const dense_grid& m) {
    return [m](index b, index h, index i, index j) { return m.values[m.flat(b, h, i, j)] != 0.0 ? 0.0 : minus_inf; };
}
bias_fn allowed_if(std::function<bool(index, index, index, index)> allowed) {
    return [allowed](index b, index h, index i, index j) { return allowed(b, h, i, j) ? 0.0 : minus_inf; };
}

const char* name_of(attend::alignment a) { return a == attend::alignment::top_left ? "top_left" : "bottom_right"; }

/// The shift of the causal diagonal, written out from the definitions in alignment.hpp.
index diagonal_shift(attend::alignment a, const config& c) {
    return a == attend::alignment::bottom_right ? c.key_len - c.query_len : 0;
}

/// Calls f(mask, name, bias) with one random mask of many kinds; bias is the hand-built meaning of the mask
/// (0 allowed, -inf forbidden, finite = additive bias), written independently of the library. Rows may be empty;
/// callers pass empty_rows::zero.
template <class T, class F>
void with_random_mask(rng& g, const config& c, F&& f) {
    const index S = c.key_len;
    const auto align = g.bernoulli(0.5) ? attend::alignment::top_left : attend::alignment::bottom_right;
    const index shift = diagonal_shift(align, c);
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
              allowed_if([shift](index, index, index i, index j) { return j <= i + shift; }));
            return;
        case 3: {
            std::vector<index> lengths;
            for (index b = 0; b < c.batch; ++b) lengths.push_back(g.uniform_int(0, S));
            f(attend::key_padding(lengths), std::string("key_padding"),
              allowed_if([lengths](index b, index, index, index j) { return j < lengths[at(b)]; }));
            return;
        }
        case 4: {
            const index left = g.uniform_int(0, S), right = g.uniform_int(0, S);
            f(attend::sliding_window(left, right, align), std::string("sliding_window ") + name_of(align),
              allowed_if([=](index, index, index i, index j) { return i + shift - left <= j && j <= i + shift + right; }));
            return;
        }
        case 5: {
            const index prefix = g.uniform_int(0, S);
            f(attend::prefix_lm(prefix, align), std::string("prefix_lm ") + name_of(align),
              allowed_if([=](index, index, index i, index j) { return j < prefix || j <= i + shift; }));
            return;
        }
        case 6: {
            std::vector<index> lengths;
            for (index b = 0; b < c.batch; ++b) lengths.push_back(g.uniform_int(0, S));
            f(attend::causal(align) && attend::key_padding(lengths), std::string("causal && key_padding"),
              allowed_if([=](index b, index, index i, index j) { return j <= i + shift && j < lengths[at(b)]; }));
            return;
        }
        case 7: {
            const auto m = random_bool_grid(g, c, 0.3, false);
            f(as_allowed(m) || attend::causal(align), std::string("dense || causal"),
              allowed_if([=](index b, index h, index i, index j) {
                  return m.value(b, h, i, j) != 0.0 || j <= i + shift;
              }));
            return;
        }
        case 8: {
            const auto m = random_bool_grid(g, c, 0.6, false);
            f(!as_allowed(m), std::string("!dense"),
              allowed_if([=](index b, index h, index i, index j) { return m.value(b, h, i, j) == 0.0; }));
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
              [=](index b, index h, index i, index j) { return j <= i + shift ? m.value(b, h, i, j) : minus_inf; });
            return;
        }
        default:
            f(attend::no_mask{}, std::string("no mask"), [](index, index, index, index) { return 0.0; });
            return;
    }
}

// Typed over the two supported scalar types.
template <class T>
class SdpaProperty : public ::testing::Test {};
TYPED_TEST_SUITE(SdpaProperty, attend_test::scalar_types, attend_test::scalar_names);

// ---------------------------------------------------------------------------------------------------------------
// Softmax along keys, forbidden weights, oracle
// ---------------------------------------------------------------------------------------------------------------

TYPED_TEST(SdpaProperty, AllowedWeightsOfEachRowSumToOneAndForbiddenWeightsAreExactlyZero) {
    using T = TypeParam;
    int checked_rows = 0, empty_rows = 0;
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        const config c = random_config(1000 + static_cast<std::uint64_t>(n));
        rng g(c.seed);
        const auto x = random_inputs<T>(c);
        with_random_mask<T>(g, c, [&](const auto& mask, const std::string& name, const bias_fn& bias) {
            SCOPED_TRACE(describe(c) + ", mask " + name);
            const auto r = run(c, x, mask, zero_rows());
            for (index b = 0; b < c.batch; ++b)
                for (index h = 0; h < c.heads; ++h)
                    for (index i = 0; i < c.query_len; ++i) {
                        double sum = 0;
                        index allowed = 0;
                        for (index j = 0; j < c.key_len; ++j) {
                            const T w = r.weights(b, h, i, j);
                            if (bias(b, h, i, j) == minus_inf) {
                                ASSERT_EQ(w, T(0)) << "forbidden weight (" << b << ',' << h << ',' << i << ',' << j
                                                   << ") is not exactly 0";
                            } else {
                                ASSERT_TRUE(w >= T(0) && w <= T(1)) << "weight " << w;
                                sum += static_cast<double>(w);
                                ++allowed;
                            }
                        }
                        if (allowed == 0) {
                            ++empty_rows;
                            ASSERT_EQ(sum, 0.0);
                            continue;
                        }
                        ++checked_rows;
                        ASSERT_NEAR(sum, 1.0, tol_row_sum<T>(c.key_len))
                            << "row (" << b << ',' << h << ',' << i << ") of " << allowed << " allowed keys";
                    }
        });
    }
    EXPECT_GT(checked_rows, 1000);
    EXPECT_GT(empty_rows, 0) << "the random masks should also produce rows with no allowed key";
}

TYPED_TEST(SdpaProperty, OutWeightsAndLseEqualAnIndependentDoubleOracleForRandomMasks) {
    using T = TypeParam;
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        const config c = random_config(2000 + static_cast<std::uint64_t>(n));
        rng g(c.seed);
        const auto x = random_inputs<T>(c);
        with_random_mask<T>(g, c, [&](const auto& mask, const std::string& name, const bias_fn& bias) {
            SCOPED_TRACE(describe(c) + ", mask " + name);
            const auto r = run(c, x, mask, zero_rows());
            ASSERT_TRUE(matches_oracle(r, oracle(c, x, default_scale(c), bias), bias, tol_oracle<T>()));
        });
    }
}

TYPED_TEST(SdpaProperty, LseEqualsLogSumExpOfScaledMaskedScoresComputedInDouble) {
    using T = TypeParam;
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        const config c = random_config(3000 + static_cast<std::uint64_t>(n));
        rng g(c.seed);
        const auto x = random_inputs<T>(c, 2.0);
        attend::sdpa_options o = zero_rows();
        const double scale = g.bernoulli(0.5) ? default_scale(c) : g.uniform(0.05, 3.0);
        o.scale = scale;
        with_random_mask<T>(g, c, [&](const auto& mask, const std::string& name, const bias_fn& bias) {
            SCOPED_TRACE(describe(c) + ", scale " + std::to_string(scale) + ", mask " + name);
            const auto r = run(c, x, mask, o);
            // log(sum_j exp(s_j)), s_j = scale * q.k + bias, summed directly (no max shift needed: |s_j| < 60).
            for (index b = 0; b < c.batch; ++b)
                for (index h = 0; h < c.heads; ++h)
                    for (index i = 0; i < c.query_len; ++i) {
                        double sum = 0;
                        for (index j = 0; j < c.key_len; ++j) {
                            if (bias(b, h, i, j) == minus_inf) continue;
                            double dot = 0;
                            for (index d = 0; d < c.head_dim; ++d)
                                dot += static_cast<double>(x.q(b, h, i, d)) *
                                       static_cast<double>(x.k(b, c.kv_head(h), j, d));
                            sum += std::exp(scale * dot + bias(b, h, i, j));
                        }
                        const double lse = static_cast<double>(r.lse(b, h, i));
                        if (sum == 0) {
                            ASSERT_EQ(lse, minus_inf) << "empty row (" << b << ',' << h << ',' << i << ')';
                        } else {
                            ASSERT_NEAR(lse, std::log(sum), tol_oracle<T>() * std::max(1.0, std::abs(std::log(sum))))
                                << "row (" << b << ',' << h << ',' << i << ')';
                        }
                    }
        });
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Forbidden keys are invisible; permutations
// ---------------------------------------------------------------------------------------------------------------

TYPED_TEST(SdpaProperty, ChangingKeyOrValueAtAForbiddenPositionLeavesThatQueryOutputIdentical) {
    using T = TypeParam;
    int protected_rows = 0, exposed_rows_changed = 0;
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        const config c = random_config(4000 + static_cast<std::uint64_t>(n));
        rng g(c.seed);
        const auto x = random_inputs<T>(c);
        with_random_mask<T>(g, c, [&](const auto& mask, const std::string& name, const bias_fn& bias) {
            SCOPED_TRACE(describe(c) + ", mask " + name);
            const index b0 = g.uniform_int(0, c.batch - 1), g0 = g.uniform_int(0, c.kv_heads - 1),
                        j0 = g.uniform_int(0, c.key_len - 1);
            auto y = x;
            // Large values: were the key visible, it would dominate the softmax and the output. Half the time the
            // value is huge but finite (1e37 in float, 1e300 in double): a forbidden weight that is merely tiny
            // instead of exactly 0 would then leak into the output.
            const double huge = std::is_same_v<T, float> ? 1e37 : 1e300;
            const bool use_huge = g.bernoulli(0.5);
            for (index d = 0; d < c.head_dim; ++d) y.k(b0, g0, j0, d) = static_cast<T>(g.uniform(-40.0, 40.0));
            for (index d = 0; d < c.value_dim; ++d)
                y.v(b0, g0, j0, d) = static_cast<T>(use_huge ? (g.bernoulli(0.5) ? huge : -huge) : g.uniform(50.0, 100.0));
            const auto r0 = run(c, x, mask, zero_rows());
            const auto r1 = run(c, y, mask, zero_rows());
            for (index b = 0; b < c.batch; ++b)
                for (index h = 0; h < c.heads; ++h)
                    for (index i = 0; i < c.query_len; ++i) {
                        const bool touched = b == b0 && c.kv_head(h) == g0;
                        const bool exposed = touched && bias(b, h, i, j0) != minus_inf;
                        bool changed = false;
                        for (index d = 0; d < c.value_dim; ++d) changed |= r0.out(b, h, i, d) != r1.out(b, h, i, d);
                        for (index j = 0; j < c.key_len; ++j)
                            changed |= r0.weights(b, h, i, j) != r1.weights(b, h, i, j);
                        changed |= r0.lse(b, h, i) != r1.lse(b, h, i);
                        if (exposed) {
                            exposed_rows_changed += changed ? 1 : 0;
                            EXPECT_TRUE(changed) << "row (" << b << ',' << h << ',' << i << ") sees key " << j0
                                                 << " whose K and V changed, yet its result did not move";
                        } else {
                            protected_rows += touched ? 1 : 0;
                            ASSERT_FALSE(changed) << "row (" << b << ',' << h << ',' << i << ") does not see key "
                                                  << j0 << " (or another kv head / batch) but its result changed";
                        }
                    }
        });
    }
    EXPECT_GT(protected_rows, 200);
    EXPECT_GT(exposed_rows_changed, 200);
}

std::vector<index> random_permutation(rng& g, index n) {
    std::vector<index> p(at(n));
    std::iota(p.begin(), p.end(), index(0));
    for (index i = n - 1; i > 0; --i) std::swap(p[at(i)], p[at(g.uniform_int(0, i))]);
    return p;
}

/// The grid with its key axis (last) permuted: new[..., j] = old[..., perm[j]].
dense_grid permute_keys(const dense_grid& m, const std::vector<index>& perm) {
    dense_grid r = m;
    const std::size_t S = at(m.dims.back());
    for (std::size_t row = 0; row < m.values.size() / S; ++row)
        for (std::size_t j = 0; j < S; ++j) r.values[row * S + j] = m.values[row * S + at(perm[j])];
    return r;
}

/// The grid with its query axis (second to last) permuted; a broadcast query axis (size 1) stays.
dense_grid permute_queries(const dense_grid& m, const std::vector<index>& perm) {
    dense_grid r = m;
    const std::size_t L = at(m.dims[m.dims.size() - 2]), S = at(m.dims.back());
    if (L == 1) return r;
    for (std::size_t outer = 0; outer < m.values.size() / (L * S); ++outer)
        for (std::size_t i = 0; i < L; ++i)
            for (std::size_t j = 0; j < S; ++j)
                r.values[(outer * L + i) * S + j] = m.values[(outer * L + at(perm[i])) * S + j];
    return r;
}

TYPED_TEST(SdpaProperty, PermutingKeysTogetherWithValuesLeavesOutputsUnchanged) {
    using T = TypeParam;
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        const config c = random_config(5000 + static_cast<std::uint64_t>(n));
        SCOPED_TRACE(describe(c));
        rng g(c.seed);
        const auto x = random_inputs<T>(c);
        const auto perm = random_permutation(g, c.key_len);
        auto y = x;
        for (index b = 0; b < c.batch; ++b)
            for (index h = 0; h < c.kv_heads; ++h)
                for (index j = 0; j < c.key_len; ++j) {
                    for (index d = 0; d < c.head_dim; ++d) y.k(b, h, j, d) = x.k(b, h, perm[at(j)], d);
                    for (index d = 0; d < c.value_dim; ++d) y.v(b, h, j, d) = x.v(b, h, perm[at(j)], d);
                }
        const auto check = [&](const outputs<T>& r0, const outputs<T>& r1, const dense_grid* mask) {
            ASSERT_TRUE(near(r0.out, r1.out, tol_oracle<T>()));
            ASSERT_TRUE(near(r0.lse, r1.lse, tol_oracle<T>()));
            for (index b = 0; b < c.batch; ++b)
                for (index h = 0; h < c.heads; ++h)
                    for (index i = 0; i < c.query_len; ++i)
                        for (index j = 0; j < c.key_len; ++j) {
                            const double w0 = static_cast<double>(r0.weights(b, h, i, perm[at(j)]));
                            const double w1 = static_cast<double>(r1.weights(b, h, i, j));
                            if (mask && mask->value(b, h, i, perm[at(j)]) == 0.0) {
                                ASSERT_EQ(w1, 0.0);
                            }
                            ASSERT_NEAR(w0, w1, tol_oracle<T>());
                        }
        };
        {
            SCOPED_TRACE("no mask");
            check(run(c, x, attend::no_mask{}), run(c, y, attend::no_mask{}), nullptr);
        }
        {
            SCOPED_TRACE("dense allowed_mask permuted along its key axis");
            const auto m = random_bool_grid(g, c, 0.6, true);
            check(run(c, x, as_allowed(m)), run(c, y, as_allowed(permute_keys(m, perm))), &m);
        }
    }
}

TYPED_TEST(SdpaProperty, PermutingQueriesPermutesOutputs) {
    using T = TypeParam;
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        const config c = random_config(6000 + static_cast<std::uint64_t>(n));
        SCOPED_TRACE(describe(c));
        rng g(c.seed);
        const auto x = random_inputs<T>(c);
        const auto perm = random_permutation(g, c.query_len);
        auto y = x;
        for (index b = 0; b < c.batch; ++b)
            for (index h = 0; h < c.heads; ++h)
                for (index i = 0; i < c.query_len; ++i)
                    for (index d = 0; d < c.head_dim; ++d) y.q(b, h, i, d) = x.q(b, h, perm[at(i)], d);
        const auto check = [&](const outputs<T>& r0, const outputs<T>& r1) {
            for (index b = 0; b < c.batch; ++b)
                for (index h = 0; h < c.heads; ++h)
                    for (index i = 0; i < c.query_len; ++i) {
                        const index p = perm[at(i)];
                        ASSERT_NEAR(static_cast<double>(r1.lse(b, h, i)), static_cast<double>(r0.lse(b, h, p)),
                                    tol_same<T>() * 10);
                        for (index d = 0; d < c.value_dim; ++d)
                            ASSERT_NEAR(static_cast<double>(r1.out(b, h, i, d)),
                                        static_cast<double>(r0.out(b, h, p, d)), tol_same<T>());
                        for (index j = 0; j < c.key_len; ++j)
                            ASSERT_NEAR(static_cast<double>(r1.weights(b, h, i, j)),
                                        static_cast<double>(r0.weights(b, h, p, j)), tol_same<T>());
                    }
        };
        {
            SCOPED_TRACE("no mask");
            check(run(c, x, attend::no_mask{}), run(c, y, attend::no_mask{}));
        }
        {
            SCOPED_TRACE("dense allowed_mask permuted along its query axis");
            const auto m = random_bool_grid(g, c, 0.6, true);
            check(run(c, x, as_allowed(m)), run(c, y, as_allowed(permute_queries(m, perm))));
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Grouped-query attention, causal alignment, intersections
// ---------------------------------------------------------------------------------------------------------------

// GQA against repeated K/V is compared within tol_same, not for identity: the same kernel runs on different
// addresses, and Eigen's vectorized reductions may peel a different number of leading elements depending on
// alignment, which changes the rounding order (in practice the reference kernel is identical here).
TYPED_TEST(SdpaProperty, GroupedQueryAttentionEqualsExplicitlyRepeatedKeysAndValues) {
    using T = TypeParam;
    int grouped = 0, multi_query = 0;
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        config c = random_config(7000 + static_cast<std::uint64_t>(n));
        rng g(c.seed);
        // Force real grouping: rank 4, heads a proper multiple of kv_heads (kv_heads == 1 a third of the time).
        c.rank3 = false;
        c.kv_heads = g.bernoulli(1.0 / 3) ? 1 : g.uniform_int(1, 3);
        c.heads = c.kv_heads * g.uniform_int(2, 4);
        grouped += 1;
        multi_query += c.kv_heads == 1 ? 1 : 0;
        const auto x = random_inputs<T>(c);
        config cr = c;
        cr.kv_heads = c.heads;
        inputs<T> xr{x.q, tensor<T, 4>(c.batch, c.heads, c.key_len, c.head_dim),
                     tensor<T, 4>(c.batch, c.heads, c.key_len, c.value_dim)};
        for (index b = 0; b < c.batch; ++b)
            for (index h = 0; h < c.heads; ++h)
                for (index j = 0; j < c.key_len; ++j) {
                    for (index d = 0; d < c.head_dim; ++d) xr.k(b, h, j, d) = x.k(b, h / (c.heads / c.kv_heads), j, d);
                    for (index d = 0; d < c.value_dim; ++d) xr.v(b, h, j, d) = x.v(b, h / (c.heads / c.kv_heads), j, d);
                }
        with_random_mask<T>(g, c, [&](const auto& mask, const std::string& name, const bias_fn&) {
            SCOPED_TRACE(describe(c) + ", mask " + name);
            const auto r = run(c, x, mask, zero_rows());
            const auto e = run(cr, xr, mask, zero_rows());
            ASSERT_TRUE(near(r.out, e.out, tol_same<T>()));
            ASSERT_TRUE(near(r.weights, e.weights, tol_same<T>()));
            ASSERT_TRUE(near(r.lse, e.lse, tol_same<T>() * 10));
        });
    }
    EXPECT_GT(multi_query, 0);
    EXPECT_GT(grouped, multi_query);
}

/// A [query_len, key_len] allowed grid, or [batch, query_len, key_len] ... built by hand from a predicate.
dense_grid hand_grid(const config& c, std::vector<index> dims, const std::function<bool(index, index, index)>& allowed) {
    dense_grid m;
    m.rank3_call = c.rank3;
    m.dims = std::move(dims);
    const bool per_batch = m.dims.size() >= 3;
    const index B = per_batch ? m.dims[0] : 1, L = m.dims[m.dims.size() - 2], S = m.dims.back();
    for (index b = 0; b < B; ++b)
        for (index i = 0; i < L; ++i)
            for (index j = 0; j < S; ++j) m.values.push_back(allowed(b, i, j) ? 1.0 : 0.0);
    return m;
}

TYPED_TEST(SdpaProperty, CausalTopLeftAndBottomRightEqualHandBuiltTriangles) {
    using T = TypeParam;
    int shapes[3] = {0, 0, 0};  // L < S, L == S, L > S
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        config c = random_config(8000 + static_cast<std::uint64_t>(n));
        rng g(c.seed);
        const int relation = n % 3;  // cycle through L < S, L == S, L > S
        if (relation == 0) c.key_len = c.query_len + g.uniform_int(1, 7);
        if (relation == 1) c.key_len = c.query_len;
        if (relation == 2) {
            c.query_len = std::max<index>(c.query_len, 2);
            c.key_len = g.uniform_int(1, c.query_len - 1);
        }
        ++shapes[relation];
        const auto x = random_inputs<T>(c);
        const index L = c.query_len, S = c.key_len;
        for (const auto align : {attend::alignment::top_left, attend::alignment::bottom_right}) {
            SCOPED_TRACE(describe(c) + ", causal " + name_of(align));
            // Written from the seeds' tril picture: top_left is tril(diagonal 0), bottom_right tril(diagonal S - L).
            const index diagonal = align == attend::alignment::top_left ? 0 : S - L;
            const auto triangle = hand_grid(c, {L, S}, [&](index, index i, index j) { return j - i <= diagonal; });
            const auto rule = run(c, x, attend::causal(align), zero_rows());
            const auto hand = run(c, x, as_allowed(triangle), zero_rows());
            ASSERT_TRUE(near(rule.out, hand.out, tol_same<T>()));
            ASSERT_TRUE(near(rule.weights, hand.weights, tol_same<T>()));
            ASSERT_TRUE(near(rule.lse, hand.lse, tol_same<T>() * 10));
            for (index b = 0; b < c.batch; ++b)
                for (index h = 0; h < c.heads; ++h)
                    for (index i = 0; i < L; ++i) {
                        const bool empty = i + diagonal < 0;  // only bottom_right with L > S
                        if (empty) {
                            ASSERT_EQ(rule.lse(b, h, i), -std::numeric_limits<T>::infinity());
                        }
                        for (index j = 0; j < S; ++j)
                            if (j - i > diagonal) {
                                ASSERT_EQ(rule.weights(b, h, i, j), T(0));
                            }
                    }
            if (align == attend::alignment::bottom_right && L > S) {
                // Under the default policy the first L - S queries are empty rows: loud, and naming query 0.
                try {
                    (void)run(c, x, attend::causal(align));
                    ADD_FAILURE() << "bottom_right causal with query_len > key_len must throw under empty_rows::error";
                } catch (const attend::mask_error& e) {
                    EXPECT_EQ(e.id(), "attend.mask.empty_row");
                    EXPECT_NE(std::string(e.what()).find("query 0"), std::string::npos) << e.what();
                }
            }
        }
        if (L != S) {
            // The alignments differ exactly when L != S: a swapped alignment would be caught above.
            const auto tl = run(c, x, attend::causal(attend::alignment::top_left), zero_rows());
            const auto br = run(c, x, attend::causal(attend::alignment::bottom_right), zero_rows());
            EXPECT_FALSE(near(tl.weights, br.weights, 1e-3)) << describe(c);
        }
    }
    EXPECT_GT(shapes[0], 0);
    EXPECT_GT(shapes[1], 0);
    EXPECT_GT(shapes[2], 0);
}

TYPED_TEST(SdpaProperty, CausalAndKeyPaddingEqualsHandBuiltIntersection) {
    using T = TypeParam;
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        const config c = random_config(9000 + static_cast<std::uint64_t>(n));
        rng g(c.seed);
        const auto x = random_inputs<T>(c);
        std::vector<index> lengths;
        for (index b = 0; b < c.batch; ++b) lengths.push_back(g.uniform_int(0, c.key_len));
        for (const auto align : {attend::alignment::top_left, attend::alignment::bottom_right}) {
            SCOPED_TRACE(describe(c) + ", causal " + name_of(align));
            const index shift = diagonal_shift(align, c);
            // [batch, 1, query_len, key_len] (rank 4) or [batch, query_len, key_len] (rank 3).
            std::vector<index> dims = c.rank3 ? std::vector<index>{c.batch, c.query_len, c.key_len}
                                              : std::vector<index>{c.batch, 1, c.query_len, c.key_len};
            const auto both = hand_grid(c, dims, [&](index b, index i, index j) {
                return j <= i + shift && j < lengths[at(b)];
            });
            const auto rule = run(c, x, attend::causal(align) && attend::key_padding(lengths), zero_rows());
            const auto hand = run(c, x, as_allowed(both), zero_rows());
            ASSERT_TRUE(near(rule.out, hand.out, tol_same<T>()));
            ASSERT_TRUE(near(rule.weights, hand.weights, tol_same<T>()));
            ASSERT_TRUE(near(rule.lse, hand.lse, tol_same<T>() * 10));
            for (index b = 0; b < c.batch; ++b)
                for (index h = 0; h < c.heads; ++h)
                    for (index i = 0; i < c.query_len; ++i)
                        for (index j = 0; j < c.key_len; ++j)
                            if (both.value(b, h, i, j) == 0.0) {
                                ASSERT_EQ(rule.weights(b, h, i, j), T(0));
                            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// The seed's 3x3 example and the inverted-convention trap
// ---------------------------------------------------------------------------------------------------------------

TYPED_TEST(SdpaProperty, SeedThreeByThreeCausalExampleGivesTwoThreeFourteenThirds) {
    using T = TypeParam;
    tensor<T, 3> q(1, 3, 2), k(1, 3, 2), v(1, 3, 1);
    q.setZero();
    k.setZero();
    v.setValues({{{T(2)}, {T(4)}, {T(8)}}});
    attend::sdpa_options o;
    o.need_weights = true;
    o.need_lse = true;

    const auto r = attend::scaled_dot_product_attention(q, k, v, attend::causal(attend::alignment::top_left), o);
    EXPECT_EQ(r.out(0, 0, 0), T(2));
    EXPECT_EQ(r.out(0, 1, 0), T(3));
    if constexpr (std::is_same_v<T, float>) EXPECT_FLOAT_EQ(r.out(0, 2, 0), 14.0f / 3.0f);
    else EXPECT_DOUBLE_EQ(r.out(0, 2, 0), 14.0 / 3.0);
    const T third = T(1) / T(3);
    const T expected[3][3] = {{T(1), T(0), T(0)}, {T(0.5), T(0.5), T(0)}, {third, third, third}};
    for (int i = 0; i < 3; ++i)
        for (int j = 0; j < 3; ++j) {
            if (j > i) {
                EXPECT_EQ(r.weights(0, i, j), T(0)) << "future key " << j << " of query " << i;
            }
            if constexpr (std::is_same_v<T, float>) EXPECT_FLOAT_EQ(r.weights(0, i, j), expected[i][j]);
            else EXPECT_DOUBLE_EQ(r.weights(0, i, j), expected[i][j]);
        }

    // nn.MultiheadAttention's convention: true = blocked, the strict upper triangle; to_allowed says so.
    tensor<bool, 2> upper(3, 3), lower(3, 3);
    for (int i = 0; i < 3; ++i)
        for (int j = 0; j < 3; ++j) {
            upper(i, j) = j > i;
            lower(i, j) = j <= i;
        }
    const auto from_mha = attend::scaled_dot_product_attention(
        q, k, v, attend::to_allowed(attend::forbidden_mask::from_torch_mha(upper)), o);
    const auto from_sdpa =
        attend::scaled_dot_product_attention(q, k, v, attend::allowed_mask::from_torch_sdpa(lower), o);
    EXPECT_TRUE(identical(from_mha.out, from_sdpa.out));
    EXPECT_TRUE(identical(from_mha.weights, from_sdpa.weights));
    EXPECT_TRUE(near(from_mha.out, r.out, 4 * eps<T>() * 5));
    EXPECT_TRUE(near(from_mha.weights, r.weights, 4 * eps<T>()));

    // The trap: the same upper triangle read in the SDPA convention (true = may attend) means the opposite.
    // Query 2 then has no key at all: loud under the default policy ...
    try {
        (void)attend::scaled_dot_product_attention(q, k, v, attend::allowed_mask::from_torch_sdpa(upper), o);
        ADD_FAILURE() << "the inverted mask leaves query 2 without keys and must throw";
    } catch (const attend::mask_error& e) {
        EXPECT_EQ(e.id(), "attend.mask.empty_row");
        EXPECT_NE(std::string(e.what()).find("query 2"), std::string::npos) << e.what();
    }
    // ... and visibly different numbers under empty_rows::zero: 6, 8, 0 instead of 2, 3, 14/3.
    o.empty_rows = attend::empty_rows::zero;
    const auto inverted =
        attend::scaled_dot_product_attention(q, k, v, attend::allowed_mask::from_torch_sdpa(upper), o);
    EXPECT_EQ(inverted.out(0, 0, 0), T(6));
    EXPECT_EQ(inverted.out(0, 1, 0), T(8));
    EXPECT_EQ(inverted.out(0, 2, 0), T(0));
    EXPECT_FALSE(near(inverted.out, r.out, 0.5));
}

// ---------------------------------------------------------------------------------------------------------------
// Masks act before softmax; fill values
// ---------------------------------------------------------------------------------------------------------------

TYPED_TEST(SdpaProperty, AdditiveMaskIsAddedBeforeSoftmaxAndMinusInfinityGivesExactZeros) {
    using T = TypeParam;
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        const config c = random_config(10000 + static_cast<std::uint64_t>(n));
        SCOPED_TRACE(describe(c));
        rng g(c.seed);
        const auto x = random_inputs<T>(c);
        const auto m = random_additive_grid(g, c, g.uniform(0.4, 1.0), true);
        const auto r = run(c, x, as_additive<T>(m));
        // weights == softmax(scale * q.k + bias) by the oracle; -inf entries exactly 0 (checked in matches_oracle).
        ASSERT_TRUE(matches_oracle(r, oracle(c, x, default_scale(c), grid_bias(m)), grid_bias(m), tol_oracle<T>()));
        // Multiplying weights by the mask after softmax would leave rows summing to less than 1; here they sum to 1.
        for (index b = 0; b < c.batch; ++b)
            for (index h = 0; h < c.heads; ++h)
                for (index i = 0; i < c.query_len; ++i) {
                    double sum = 0;
                    for (index j = 0; j < c.key_len; ++j) sum += static_cast<double>(r.weights(b, h, i, j));
                    ASSERT_NEAR(sum, 1.0, tol_row_sum<T>(c.key_len));
                }
    }
}

TYPED_TEST(SdpaProperty, FiniteLargeNegativeFillIsNotExactZeroButMinusInfinityIs) {
    using T = TypeParam;
    attend::sdpa_options o;
    o.need_weights = true;
    o.scale = 1.0;
    // head_dim 1, q = 1: key 0 scores 0 and is allowed; key 1 is masked by the fill, but its raw score equals the
    // fill's magnitude (1e4 and 1e9 are exact in float and double), so its masked score is exactly 0.
    for (const double fill : {-1e4, -1e9}) {
        SCOPED_TRACE("fill " + std::to_string(fill));
        tensor<T, 3> q(1, 1, 1), k(1, 2, 1), v(1, 2, 1);
        q.setValues({{{T(1)}}});
        k.setValues({{{T(0)}, {static_cast<T>(-fill)}}});
        v.setValues({{{T(1)}, {T(-1)}}});
        tensor<T, 2> finite(1, 2), infinite(1, 2);
        finite.setValues({{T(0), static_cast<T>(fill)}});
        infinite.setValues({{T(0), -std::numeric_limits<T>::infinity()}});
        const auto with_fill = attend::scaled_dot_product_attention(
            q, k, v, attend::additive_mask<T>::from_values(finite), o);
        const auto with_inf = attend::scaled_dot_product_attention(
            q, k, v, attend::additive_mask<T>::from_values(infinite), o);
        EXPECT_GT(with_fill.weights(0, 0, 1), T(0.1)) << "a finite fill only shifts the score; it does not forbid";
        EXPECT_EQ(with_inf.weights(0, 0, 1), T(0));
        EXPECT_EQ(with_inf.weights(0, 0, 0), T(1));
        EXPECT_EQ(with_inf.out(0, 0, 0), T(1));
    }
    // A row whose keys are all "masked" with a finite fill is not empty: it attends uniformly to the padding (the
    // classic padded-row bug), whereas -inf makes it an empty row that attend reports.
    tensor<T, 3> q(1, 1, 2), k(1, 3, 2), v(1, 3, 1);
    attend_test::fill_uniform(q, 1);
    k.setZero();  // every key scores 0, so each masked score is exactly the fill
    v.setValues({{{T(1)}, {T(2)}, {T(6)}}});
    tensor<T, 2> finite(1, 3), infinite(1, 3);
    finite.setConstant(T(-1e4));
    infinite.setConstant(-std::numeric_limits<T>::infinity());
    const auto padded_row = attend::scaled_dot_product_attention(
        q, k, v, attend::additive_mask<T>::from_values(finite), o);
    // (Loose on purpose: the point is "about 1/3, not 0"; accuracy is WeightsStayAccurateUnderALargeCommonOffset.)
    for (int j = 0; j < 3; ++j) EXPECT_NEAR(static_cast<double>(padded_row.weights(0, 0, j)), 1.0 / 3, 1e-3);
    EXPECT_NEAR(static_cast<double>(padded_row.out(0, 0, 0)), 3.0, 1e-3);
    EXPECT_THROW((void)attend::scaled_dot_product_attention(q, k, v, attend::additive_mask<T>::from_values(infinite), o),
                 attend::mask_error);
}

// softmax(s + c) == softmax(s). With integer scores and an integer offset c every score is exact in float and
// double, so each kernel must return the softmax of the small integer scores to a few ulps: the offset may not
// cost accuracy. (Computing weights as exp(s - lse) with lse rounded near |c| would lose |c| * eps relative.)
TYPED_TEST(SdpaProperty, WeightsStayAccurateUnderALargeCommonOffset) {
    using T = TypeParam;
    for (int n = 0; n < attend_test::repeat(50); ++n) {
        config c = random_config(20000 + static_cast<std::uint64_t>(n));
        rng g(c.seed);
        c.head_dim = g.uniform_int(1, 4);
        inputs<T> x = random_inputs<T>(c);
        for (auto* t : {&x.q, &x.k})
            for (index e = 0; e < t->size(); ++e) t->data()[e] = static_cast<T>(g.uniform_int(-2, 2));
        const double offset = g.bernoulli(0.5) ? -10000.0 : -4096.0;
        dense_grid m = random_additive_grid(g, c, 1.0, true);
        for (double& v : m.values) v = offset;
        for (const auto k : {attend::kernel::reference, attend::kernel::tiled}) {
            c.kernel = k;
            SCOPED_TRACE(describe(c) + ", offset " + std::to_string(offset));
            attend::sdpa_options o;
            o.scale = 1.0;
            const auto r = run(c, x, as_additive<T>(m), o);
            const auto e = oracle(c, x, 1.0, grid_bias(m));
            for (index b = 0; b < c.batch; ++b)
                for (index h = 0; h < c.heads; ++h)
                    for (index i = 0; i < c.query_len; ++i) {
                        double sum = 0;
                        for (index j = 0; j < c.key_len; ++j) {
                            const double w = static_cast<double>(r.weights(b, h, i, j));
                            sum += w;
                            // exp and the division cost a few ulps; the row sum up to key_len / 2 more.
                            ASSERT_NEAR(w, e.w(b, h, i, j), static_cast<double>(c.key_len + 8) * eps<T>() * e.w(b, h, i, j))
                                << "weight (" << b << ',' << h << ',' << i << ',' << j << ')';
                        }
                        ASSERT_NEAR(sum, 1.0, tol_row_sum<T>(c.key_len));
                    }
        }
    }
}

// A finite additive bias may round to -inf in the score type: a double mask holding -1e300 applied to float
// inputs, or two float masks each holding lowest() (Hugging Face's finfo.min fill) added together. The row then
// is NOT empty by the mask's meaning (every entry is finite), so under empty_rows::error attend must either give
// the exact softmax (equal finite shifts cancel) or report the row; a silent zero row with lse -inf is neither.
TEST(SdpaFillValues, FiniteAdditiveFillThatOverflowsTheScoreTypeNeverGivesASilentZeroRow) {
    tensor<float, 3> q(1, 2, 1), k(1, 3, 1), v(1, 3, 1);
    q.setValues({{{0.5f}, {1.0f}}});
    k.setValues({{{1.0f}, {2.0f}, {-1.0f}}});
    v.setValues({{{1.0f}, {2.0f}, {3.0f}}});
    attend::sdpa_options o;
    o.need_weights = true;
    o.need_lse = true;
    const auto check = [&](const auto& mask, const char* what) {
        SCOPED_TRACE(what);
        try {
            const auto r = attend::scaled_dot_product_attention(q, k, v, mask, o);
            double sum = 0;
            for (int j = 0; j < 3; ++j) sum += static_cast<double>(r.weights(0, 0, j));
            EXPECT_NEAR(sum, 1.0, 1e-5) << "query 0: every bias is finite, so its weights must sum to 1 (got out "
                                        << r.out(0, 0, 0) << ", lse " << r.lse(0, 0) << ')';
            EXPECT_NE(r.lse(0, 0), -std::numeric_limits<float>::infinity());
        } catch (const attend::mask_error& e) {
            EXPECT_EQ(e.id(), "attend.mask.empty_row");  // reporting the row is the other acceptable answer
        }
    };
    tensor<double, 2> huge(2, 3);
    huge.setValues({{-1e300, -1e300, -1e300}, {0, 0, 0}});
    check(attend::additive_mask<double>::from_values(huge), "additive_mask<double> -1e300 on float inputs");
    tensor<float, 2> lowest(2, 3);
    lowest.setValues({{std::numeric_limits<float>::lowest(), std::numeric_limits<float>::lowest(),
                       std::numeric_limits<float>::lowest()},
                      {0, 0, 0}});
    const auto m = attend::additive_mask<float>::from_values(lowest);
    check(m + m, "two additive_mask<float> of lowest() added");
}

// ---------------------------------------------------------------------------------------------------------------
// Scale
// ---------------------------------------------------------------------------------------------------------------

TYPED_TEST(SdpaProperty, ScaleOptionEqualsPremultiplyingQueryByTheScale) {
    using T = TypeParam;
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        config c = random_config(11000 + static_cast<std::uint64_t>(n));
        rng g(c.seed);
        static const index square_dims[] = {1, 4, 16, 64};  // 1/sqrt(head_dim) is a power of two
        if (n % 2 == 0) c.head_dim = square_dims[g.uniform_int(0, 3)];
        SCOPED_TRACE(describe(c));
        const auto x = random_inputs<T>(c);
        const auto mask = random_bool_grid(g, c, 0.7, true);
        const auto run_scaled = [&](double factor, std::optional<double> scale) {
            auto y = x;
            for (index e = 0; e < y.q.size(); ++e) y.q.data()[e] = static_cast<T>(y.q.data()[e] * static_cast<T>(factor));
            attend::sdpa_options o;
            o.scale = scale;
            return run(c, y, as_allowed(mask), o);
        };
        // A power-of-two factor scales exactly, so (s q).k == s (q.k) bit for bit: identical results.
        const double s = std::ldexp(1.0, static_cast<int>(g.uniform_int(-4, 3)));
        {
            SCOPED_TRACE("scale " + std::to_string(s));
            const auto a = run_scaled(1.0, s), b = run_scaled(s, 1.0);
            ASSERT_TRUE(identical(a.out, b.out));
            ASSERT_TRUE(identical(a.weights, b.weights));
            ASSERT_TRUE(identical(a.lse, b.lse));
        }
        // The default is 1/sqrt(head_dim); for square head_dim that is a power of two: identical again.
        const double d = default_scale(c);
        if (std::ldexp(1.0, std::ilogb(d)) == d) {
            SCOPED_TRACE("default scale, head_dim " + std::to_string(c.head_dim));
            const auto a = run_scaled(1.0, std::nullopt), b = run_scaled(d, 1.0);
            ASSERT_TRUE(identical(a.out, b.out));
            ASSERT_TRUE(identical(a.lse, b.lse));
        } else {
            const auto a = run_scaled(1.0, std::nullopt), b = run_scaled(1.0, d);
            ASSERT_TRUE(identical(a.out, b.out)) << "default scale must be 1/sqrt(head_dim)";
        }
        // Any other scale: equal within rounding, and equal to the oracle.
        const double any = g.uniform(0.1, 2.5);
        const auto a = run_scaled(1.0, any);
        ASSERT_TRUE(near(a.out, run_scaled(any, 1.0).out, tol_oracle<T>()));
        ASSERT_TRUE(matches_oracle(a, oracle(c, x, any, boolean_grid_bias(mask)), boolean_grid_bias(mask),
                                   tol_oracle<T>()));
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Empty rows and query padding
// ---------------------------------------------------------------------------------------------------------------

template <class T, int Rank>
tensor<T, Rank> sentinel_like(const std::array<index, Rank>& dims, T value) {
    tensor<T, Rank> t(dims);
    t.setConstant(value);
    return t;
}

template <class T, int Rank>
bool all_equal(const tensor<T, Rank>& t, T value) {
    for (index n = 0; n < t.size(); ++n)
        if (!(t.data()[n] == value)) return false;
    return true;
}

TYPED_TEST(SdpaProperty, EmptyRowUnderDefaultPolicyThrowsNamingFirstRowAndWritesNothing) {
    using T = TypeParam;
    const T sentinel = T(-12345.5);
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        config c = random_config(12000 + static_cast<std::uint64_t>(n));
        c.rank3 = false;
        SCOPED_TRACE(describe(c));
        rng g(c.seed);
        const auto x = random_inputs<T>(c);
        // A full [B, H, L, S] grid with every row allowed somewhere, then one or two rows emptied.
        dense_grid m;
        m.dims = {c.batch, c.heads, c.query_len, c.key_len};
        for (index e = 0; e < c.batch * c.heads * c.query_len * c.key_len; ++e) m.values.push_back(1.0);
        const index b0 = g.uniform_int(0, c.batch - 1), h0 = g.uniform_int(0, c.heads - 1),
                    i0 = g.uniform_int(0, c.query_len - 1);
        for (index j = 0; j < c.key_len; ++j) m.values[m.flat(b0, h0, i0, j)] = 0.0;
        // A later row emptied too: the message must still name the first one in (batch, head, query) order.
        const index b1 = g.uniform_int(b0, c.batch - 1);
        const index h1 = b1 > b0 ? g.uniform_int(0, c.heads - 1) : g.uniform_int(h0, c.heads - 1);
        const index i1 = b1 > b0 || h1 > h0 ? g.uniform_int(0, c.query_len - 1) : g.uniform_int(i0, c.query_len - 1);
        for (index j = 0; j < c.key_len; ++j) m.values[m.flat(b1, h1, i1, j)] = 0.0;

        auto out = sentinel_like<T, 4>({c.batch, c.heads, c.query_len, c.value_dim}, sentinel);
        auto weights = sentinel_like<T, 4>({c.batch, c.heads, c.query_len, c.key_len}, sentinel);
        auto lse = sentinel_like<T, 3>({c.batch, c.heads, c.query_len}, sentinel);
        try {
            attend::scaled_dot_product_attention_into(x.q, x.k, x.v, as_allowed(m), out, attend::sdpa_options{},
                                                      weights, lse);
            FAIL() << "row (" << b0 << ',' << h0 << ',' << i0 << ") has no allowed key: expected mask_error";
        } catch (const attend::mask_error& e) {
            const std::string what = e.what();
            EXPECT_EQ(e.id(), "attend.mask.empty_row");
            EXPECT_EQ(what.rfind("[attend.mask.empty_row]", 0), 0u) << what;
            for (const std::string& part : {"batch " + std::to_string(b0), "head " + std::to_string(h0),
                                            "query " + std::to_string(i0)})
                EXPECT_NE(what.find(part), std::string::npos) << "message should name " << part << ": " << what;
        }
        EXPECT_TRUE(all_equal(out, sentinel)) << "out was written before the error";
        EXPECT_TRUE(all_equal(weights, sentinel)) << "weights were written before the error";
        EXPECT_TRUE(all_equal(lse, sentinel)) << "lse was written before the error";
        // The allocating form throws the same.
        EXPECT_THROW((void)run(c, x, as_allowed(m)), attend::mask_error);
    }
}

TYPED_TEST(SdpaProperty, EmptyRowsUnderZeroPolicyGiveZeroOutputZeroWeightsMinusInfLseAndNoNaN) {
    using T = TypeParam;
    int empty = 0;
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        const config c = random_config(13000 + static_cast<std::uint64_t>(n));
        rng g(c.seed);
        const auto x = random_inputs<T>(c);
        // Sparse masks without the per-row guarantee, or key padding with zero lengths: many empty rows.
        const auto m = random_bool_grid(g, c, 0.15, false);
        std::vector<index> lengths;
        for (index b = 0; b < c.batch; ++b) lengths.push_back(g.bernoulli(0.5) ? 0 : g.uniform_int(0, c.key_len));
        const auto check = [&](const outputs<T>& r, const bias_fn& bias) {
            ASSERT_FALSE(has_nan(r.out));
            ASSERT_FALSE(has_nan(r.weights));
            ASSERT_FALSE(has_nan(r.lse));
            for (index b = 0; b < c.batch; ++b)
                for (index h = 0; h < c.heads; ++h)
                    for (index i = 0; i < c.query_len; ++i) {
                        bool any = false;
                        for (index j = 0; j < c.key_len; ++j) any |= bias(b, h, i, j) != minus_inf;
                        if (any) continue;
                        ++empty;
                        ASSERT_EQ(r.lse(b, h, i), -std::numeric_limits<T>::infinity());
                        for (index d = 0; d < c.value_dim; ++d) ASSERT_EQ(r.out(b, h, i, d), T(0));
                        for (index j = 0; j < c.key_len; ++j) ASSERT_EQ(r.weights(b, h, i, j), T(0));
                    }
            // The other rows are ordinary.
            ASSERT_TRUE(matches_oracle(r, oracle(c, x, default_scale(c), bias), bias, tol_oracle<T>()));
        };
        {
            SCOPED_TRACE(describe(c) + ", sparse dense mask");
            check(run(c, x, as_allowed(m), zero_rows()), boolean_grid_bias(m));
        }
        {
            SCOPED_TRACE(describe(c) + ", key_padding with zero lengths");
            check(run(c, x, attend::key_padding(lengths), zero_rows()),
                  allowed_if([&](index b, index, index, index j) { return j < lengths[at(b)]; }));
        }
    }
    EXPECT_GT(empty, 200);
}

TYPED_TEST(SdpaProperty, QueryPaddingRowsAreZeroUnderAnyPolicyAndRealRowsIgnorePaddedQueryContent) {
    using T = TypeParam;
    int padded_rows = 0;
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        const config c = random_config(14000 + static_cast<std::uint64_t>(n));
        rng g(c.seed);
        const auto x = random_inputs<T>(c);
        std::vector<index> q_lengths, k_lengths;
        for (index b = 0; b < c.batch; ++b) {
            q_lengths.push_back(g.uniform_int(0, c.query_len));
            // Batches without real queries may have no keys either: their rows are all padding, still no throw.
            k_lengths.push_back(q_lengths.back() == 0 ? 0 : g.uniform_int(1, c.key_len));
        }
        const auto padded = [&](index b, index i) { return i >= q_lengths[at(b)]; };
        const auto mask = attend::query_padding(q_lengths) && attend::key_padding(k_lengths);
        const bias_fn bias = allowed_if([&](index b, index, index i, index j) {
            return i < q_lengths[at(b)] && j < k_lengths[at(b)];
        });
        for (const auto policy : {attend::empty_rows::error, attend::empty_rows::zero}) {
            SCOPED_TRACE(describe(c) + (policy == attend::empty_rows::error ? ", empty_rows::error" : ", zero"));
            attend::sdpa_options o;
            o.empty_rows = policy;
            outputs<T> r;
            ASSERT_NO_THROW(r = run(c, x, mask, o));
            ASSERT_FALSE(has_nan(r.out));
            for (index b = 0; b < c.batch; ++b)
                for (index h = 0; h < c.heads; ++h)
                    for (index i = 0; i < c.query_len; ++i) {
                        if (!padded(b, i)) continue;
                        ++padded_rows;
                        ASSERT_EQ(r.lse(b, h, i), -std::numeric_limits<T>::infinity());
                        for (index d = 0; d < c.value_dim; ++d) ASSERT_EQ(r.out(b, h, i, d), T(0));
                        for (index j = 0; j < c.key_len; ++j) ASSERT_EQ(r.weights(b, h, i, j), T(0));
                    }
            ASSERT_TRUE(matches_oracle(r, oracle(c, x, default_scale(c), bias, padded), bias, tol_oracle<T>()));
            // Rewrite the padded queries with large values: real rows must not move at all.
            auto y = x;
            for (index b = 0; b < c.batch; ++b)
                for (index h = 0; h < c.heads; ++h)
                    for (index i = q_lengths[at(b)]; i < c.query_len; ++i)
                        for (index d = 0; d < c.head_dim; ++d) y.q(b, h, i, d) = static_cast<T>(g.uniform(-50, 50));
            const auto r2 = run(c, y, mask, o);
            ASSERT_TRUE(identical(r.out, r2.out));
            ASSERT_TRUE(identical(r.weights, r2.weights));
            ASSERT_TRUE(identical(r.lse, r2.lse));
        }
    }
    EXPECT_GT(padded_rows, 200);
}

// ---------------------------------------------------------------------------------------------------------------
// Dropout
// ---------------------------------------------------------------------------------------------------------------

TYPED_TEST(SdpaProperty, DropoutIsOffOutsideTrainingEvenWithProbabilitySet) {
    using T = TypeParam;
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        const config c = random_config(15000 + static_cast<std::uint64_t>(n));
        rng g(c.seed);
        const auto x = random_inputs<T>(c);
        with_random_mask<T>(g, c, [&](const auto& mask, const std::string& name, const bias_fn&) {
            SCOPED_TRACE(describe(c) + ", mask " + name);
            attend::sdpa_options eval = zero_rows(), none = zero_rows();
            eval.dropout.probability = 0.5;
            eval.dropout.seed = c.seed;
            eval.dropout.training = false;
            eval.weights_after_dropout = true;
            const auto a = run(c, x, mask, eval), b = run(c, x, mask, none);
            ASSERT_TRUE(identical(a.out, b.out));
            ASSERT_TRUE(identical(a.weights, b.weights));
            ASSERT_TRUE(identical(a.lse, b.lse));
        });
    }
}

TYPED_TEST(SdpaProperty, TrainingDropoutKeepsScaledProbabilitiesDropsToZeroAndNeverRevivesForbiddenKeys) {
    using T = TypeParam;
    std::int64_t kept = 0, dropped = 0;
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        const config c = random_config(16000 + static_cast<std::uint64_t>(n));
        rng g(c.seed);
        const auto x = random_inputs<T>(c);
        const double p = g.uniform(0.05, 0.9);
        with_random_mask<T>(g, c, [&](const auto& mask, const std::string& name, const bias_fn& bias) {
            SCOPED_TRACE(describe(c) + ", p " + std::to_string(p) + ", mask " + name);
            attend::sdpa_options o = zero_rows();
            o.dropout = {p, c.seed * 7 + 1, true};
            const auto before = run(c, x, mask, o);  // weights: probabilities before dropout
            o.weights_after_dropout = true;
            const auto after = run(c, x, mask, o);
            ASSERT_TRUE(identical(before.out, after.out));
            ASSERT_TRUE(identical(before.lse, after.lse));
            // Probabilities are those of the no-dropout call.
            ASSERT_TRUE(identical(before.weights, run(c, x, mask, zero_rows()).weights));
            const double keep_scale = 1.0 / (1.0 - p);
            for (index b = 0; b < c.batch; ++b)
                for (index h = 0; h < c.heads; ++h)
                    for (index i = 0; i < c.query_len; ++i) {
                        std::vector<double> used(at(c.key_len));
                        for (index j = 0; j < c.key_len; ++j) {
                            const double w = static_cast<double>(before.weights(b, h, i, j));
                            const double u = static_cast<double>(after.weights(b, h, i, j));
                            used[at(j)] = u;
                            if (bias(b, h, i, j) == minus_inf) {
                                ASSERT_EQ(u, 0.0) << "forbidden weight revived by dropout at j " << j;
                                continue;
                            }
                            if (u == 0.0) {
                                ++dropped;
                            } else {
                                ++kept;
                                ASSERT_NEAR(u, w * keep_scale, 4 * eps<T>() * w * keep_scale)
                                    << "kept weight must be probability / (1 - p) at j " << j;
                            }
                        }
                        // The output uses exactly the dropped and rescaled weights.
                        for (index d = 0; d < c.value_dim; ++d) {
                            double o_expected = 0;
                            for (index j = 0; j < c.key_len; ++j)
                                o_expected += used[at(j)] * static_cast<double>(x.v(b, c.kv_head(h), j, d));
                            ASSERT_NEAR(static_cast<double>(after.out(b, h, i, d)), o_expected,
                                        tol_oracle<T>() * keep_scale);
                        }
                    }
        });
    }
    // Both outcomes must be common (the dropped fraction itself is tested in SdpaDropoutStatistics).
    EXPECT_GT(kept, 1000);
    EXPECT_GT(dropped, 1000);
}

TYPED_TEST(SdpaProperty, DropoutIsAPureFunctionOfSeedAndPosition) {
    using T = TypeParam;
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        const config c = random_config(17000 + static_cast<std::uint64_t>(n));
        SCOPED_TRACE(describe(c));
        const auto x = random_inputs<T>(c);
        attend::sdpa_options o;
        o.dropout = {0.5, 1000 + c.seed, true};
        o.weights_after_dropout = true;
        const auto a = run(c, x, attend::no_mask{}, o);
        // Same seed: identical, whatever the thread count or kernel.
        for (const int threads : {1, 2}) {
            attend::sdpa_options t = o;
            t.threads = threads;
            const auto b = run(c, x, attend::no_mask{}, t);
            ASSERT_TRUE(identical(a.out, b.out)) << threads << " threads";
            ASSERT_TRUE(identical(a.weights, b.weights)) << threads << " threads";
        }
        config other_kernel = c;
        other_kernel.kernel =
            c.kernel == attend::kernel::reference ? attend::kernel::automatic : attend::kernel::reference;
        const auto k2 = run(other_kernel, x, attend::no_mask{}, o);
        for (index e = 0; e < a.weights.size(); ++e)
            ASSERT_EQ(a.weights.data()[e] == T(0), k2.weights.data()[e] == T(0)) << "kernels drop different weights";
        // The drop pattern depends on neither the query values nor how many queries the call has: a call with the
        // first half of the query positions, holding other values, drops the same (b, h, i, j).
        config c2 = c;
        c2.query_len = std::max<index>(1, c.query_len / 2);
        inputs<T> z{tensor<T, 4>(c.batch, c.heads, c2.query_len, c.head_dim), x.k, x.v};
        attend_test::fill_uniform(z.q, c.seed + 99);
        const auto b = run(c2, z, attend::no_mask{}, o);
        for (index bb = 0; bb < c.batch; ++bb)
            for (index h = 0; h < c.heads; ++h)
                for (index i = 0; i < c2.query_len; ++i)
                    for (index j = 0; j < c.key_len; ++j)
                        ASSERT_EQ(a.weights(bb, h, i, j) == T(0), b.weights(bb, h, i, j) == T(0))
                            << "position (" << bb << ',' << h << ',' << i << ',' << j << ')';
    }
    // Another seed, another pattern: with >= 8 positions at p = 0.5, two seeds agree everywhere with odds <= 2^-8
    // per configuration, so at least 90% of the configurations must differ.
    int differ = 0, total = 0;
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        const config c = random_config(17500 + static_cast<std::uint64_t>(n));
        if (c.batch * c.heads * c.query_len * c.key_len < 8) continue;
        const auto x = random_inputs<T>(c);
        attend::sdpa_options o;
        o.dropout = {0.5, 1, true};
        const auto a = run(c, x, attend::no_mask{}, o);
        o.dropout.seed = 2;
        const auto b = run(c, x, attend::no_mask{}, o);
        ++total;
        differ += identical(a.out, b.out) ? 0 : 1;
    }
    ASSERT_GT(total, 0);
    EXPECT_GE(differ * 10, total * 9) << differ << " of " << total << " configurations differ between seeds 1 and 2";
}

// The mean of the dropout output over n seeds estimates the no-dropout output. For one output element,
//   out = sum_j w_j v_j m_j / (1 - p),  m_j ~ Bernoulli(1 - p) independent,
// so E[out] = sum_j w_j v_j and Var[out] = p / (1 - p) * sum_j (w_j v_j)^2 (Var[m_j / (1 - p)] = p / (1 - p)).
// The mean of n independent seeds has variance Var[out] / n; we accept |mean - expected| <= 5 sigma + 1e-9,
// sigma = sqrt(Var[out] / n). Over the ~100 checked elements a false alarm has probability ~100 * 5.7e-7.
// The seeds are fixed, so the outcome is deterministic; it fails if dropout is biased (e.g. no 1/(1-p) rescale,
// which shifts the mean by a factor 1 - p, i.e. by tens of sigma here).
TEST(SdpaDropoutStatistics, MeanOutputOverManySeedsEqualsNoDropoutOutputWithinFiveSigma) {
    config c;
    c.batch = 1;
    c.heads = 2;
    c.kv_heads = 1;
    c.query_len = 5;
    c.key_len = 9;
    c.head_dim = 4;
    c.value_dim = 3;
    c.seed = 77;
    const auto x = random_inputs<double>(c);
    const double p = 0.3;
    const int seeds = 4000;  // fixed, not scaled: the bound depends on it
    const auto plain = run(c, x, attend::causal(attend::alignment::bottom_right));
    std::vector<double> mean(at(plain.out.size()), 0.0);
    attend::sdpa_options o;
    o.dropout.probability = p;
    o.dropout.training = true;
    for (int s = 0; s < seeds; ++s) {
        o.dropout.seed = static_cast<std::uint64_t>(s) * 7919 + 3;
        const auto r = run(c, x, attend::causal(attend::alignment::bottom_right), o);
        for (index e = 0; e < r.out.size(); ++e) mean[at(e)] += r.out.data()[e] / seeds;
    }
    double worst_sigmas = 0;
    for (index h = 0; h < c.heads; ++h)
        for (index i = 0; i < c.query_len; ++i)
            for (index d = 0; d < c.value_dim; ++d) {
                double var = 0;
                for (index j = 0; j < c.key_len; ++j) {
                    const double wv = plain.weights(0, h, i, j) * x.v(0, 0, j, d);
                    var += p / (1 - p) * wv * wv;
                }
                const double sigma = std::sqrt(var / seeds);
                const double diff = std::abs(mean[at(((h * c.query_len) + i) * c.value_dim + d)] - plain.out(0, h, i, d));
                worst_sigmas = std::max(worst_sigmas, sigma > 0 ? diff / sigma : 0.0);
                EXPECT_LE(diff, 5 * sigma + 1e-9) << "element (" << h << ',' << i << ',' << d << ')';
            }
    RecordProperty("worst_deviation_in_sigmas", std::to_string(worst_sigmas));
    std::cout << "dropout mean over " << seeds << " seeds: worst deviation " << worst_sigmas << " sigma\n";
}

TEST(SdpaDropoutStatistics, DroppedFractionEqualsProbabilityWithinFiveSigma) {
    config c;
    c.batch = 2;
    c.heads = 3;
    c.kv_heads = 3;
    c.query_len = 40;
    c.key_len = 50;
    c.head_dim = 3;
    c.value_dim = 2;
    c.seed = 5;
    const auto x = random_inputs<double>(c);
    for (const double p : {0.1, 0.5, 0.8}) {
        attend::sdpa_options o;
        o.dropout = {p, 42, true};
        o.weights_after_dropout = true;
        const auto r = run(c, x, attend::no_mask{}, o);
        // N = 12000 independent positions; the dropped count is Binomial(N, p): sigma = sqrt(N p (1 - p)).
        const double N = static_cast<double>(r.weights.size());
        double dropped = 0;
        for (index e = 0; e < r.weights.size(); ++e) dropped += r.weights.data()[e] == 0.0 ? 1 : 0;
        EXPECT_NEAR(dropped, N * p, 5 * std::sqrt(N * p * (1 - p))) << "p " << p;
    }
}

// ---------------------------------------------------------------------------------------------------------------
// The _into form, strided views, empty results
// ---------------------------------------------------------------------------------------------------------------

template <class T>
using aligned_vector = std::vector<T, Eigen::aligned_allocator<T>>;

// Identical, not near: the same kernel on the same inputs into outputs of the same (Eigen) alignment. The
// TensorMap buffers use Eigen's aligned allocator so that alignment cannot change a reduction order.
TYPED_TEST(SdpaProperty, IntoFormWritesTheSameValuesAsTheAllocatingFormRank3Rank4AndTensorMap) {
    using T = TypeParam;
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        const config c = random_config(18000 + static_cast<std::uint64_t>(n));
        rng g(c.seed);
        const auto x = random_inputs<T>(c);
        with_random_mask<T>(g, c, [&](const auto& mask, const std::string& name, const bias_fn&) {
            SCOPED_TRACE(describe(c) + ", mask " + name);
            attend::sdpa_options o = zero_rows();
            o.need_weights = true;
            o.need_lse = true;
            o.kernel = c.kernel;
            if (g.bernoulli(0.3)) o.dropout = {0.25, c.seed, true};
            const index B = c.batch, H = c.heads, L = c.query_len, S = c.key_len, Dv = c.value_dim;
            if (c.rank3) {
                const auto q = drop_heads(x.q), k = drop_heads(x.k), v = drop_heads(x.v);
                const auto r = attend::scaled_dot_product_attention(q, k, v, mask, o);
                tensor<T, 3> out(B, L, Dv), weights(B, L, S);
                tensor<T, 2> lse(B, L);
                attend::scaled_dot_product_attention_into(q, k, v, mask, out, o, weights, lse);
                ASSERT_TRUE(identical(out, r.out));
                ASSERT_TRUE(identical(weights, r.weights));
                ASSERT_TRUE(identical(lse, r.lse));
                aligned_vector<T> ob(at(B * L * Dv), T(7)), wb(at(B * L * S), T(7)), lb(at(B * L), T(7));
                attend::tensor_view<T, 3> om(ob.data(), B, L, Dv), wm(wb.data(), B, L, S);
                attend::tensor_view<T, 2> lm(lb.data(), B, L);
                attend::scaled_dot_product_attention_into(q, k, v, mask, om, o, wm, lm);
                ASSERT_TRUE(identical(tensor<T, 3>(om), r.out));
                ASSERT_TRUE(identical(tensor<T, 3>(wm), r.weights));
                ASSERT_TRUE(identical(tensor<T, 2>(lm), r.lse));
                // Out only (no weights, no lse).
                tensor<T, 3> out_only(B, L, Dv);
                attend::scaled_dot_product_attention_into(q, k, v, mask, out_only, o);
                ASSERT_TRUE(identical(out_only, r.out));
            } else {
                const auto r = attend::scaled_dot_product_attention(x.q, x.k, x.v, mask, o);
                tensor<T, 4> out(B, H, L, Dv), weights(B, H, L, S);
                tensor<T, 3> lse(B, H, L);
                attend::scaled_dot_product_attention_into(x.q, x.k, x.v, mask, out, o, weights, lse);
                ASSERT_TRUE(identical(out, r.out));
                ASSERT_TRUE(identical(weights, r.weights));
                ASSERT_TRUE(identical(lse, r.lse));
                aligned_vector<T> ob(at(B * H * L * Dv), T(7)), wb(at(B * H * L * S), T(7)), lb(at(B * H * L), T(7));
                attend::tensor_view<T, 4> om(ob.data(), B, H, L, Dv), wm(wb.data(), B, H, L, S);
                attend::tensor_view<T, 3> lm(lb.data(), B, H, L);
                attend::scaled_dot_product_attention_into(x.q, x.k, x.v, mask, om, o, wm, lm);
                ASSERT_TRUE(identical(tensor<T, 4>(om), r.out));
                ASSERT_TRUE(identical(tensor<T, 4>(wm), r.weights));
                ASSERT_TRUE(identical(tensor<T, 3>(lm), r.lse));
                // TensorMap inputs too (const views of the same data).
                const attend::const_tensor_view<T, 4> qm(x.q.data(), B, H, L, c.head_dim),
                    km(x.k.data(), B, c.kv_heads, S, c.head_dim), vm(x.v.data(), B, c.kv_heads, S, Dv);
                tensor<T, 4> out2(B, H, L, Dv);
                attend::scaled_dot_product_attention_into(qm, km, vm, mask, out2, o);
                ASSERT_TRUE(identical(out2, r.out));
            }
        });
    }
}

// split_heads reads a projected [B, L, H*D] buffer as [B, H, L, D] through strides. Compared with the explicitly
// transposed contiguous tensors within tol_same (strided and contiguous operands may take different product
// paths). A plain reshape of the same buffer into [B, H, L, D] (no transpose) mixes heads and tokens: the test
// shows it gives a different answer, so a missing transpose could not pass unnoticed. (heads >= 2, query_len >= 2
// and key_len >= 2: with a single key every query's output is that key's value whatever the queries are.)
TYPED_TEST(SdpaProperty, SplitHeadsViewsEqualTransposedTensorsAndPlainReshapeDoesNot) {
    using T = TypeParam;
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        config c = random_config(19000 + static_cast<std::uint64_t>(n));
        rng g(c.seed);
        c.rank3 = false;
        c.kv_heads = g.uniform_int(1, 3);
        c.heads = c.kv_heads * g.uniform_int(1, 3);
        if (c.heads == 1) c.heads = c.kv_heads = 2;
        c.query_len = std::max<index>(c.query_len, 2);
        c.key_len = std::max<index>(c.key_len, 2);
        SCOPED_TRACE(describe(c));
        const index B = c.batch, H = c.heads, G = c.kv_heads, L = c.query_len, S = c.key_len, D = c.head_dim,
                    Dv = c.value_dim;
        // Projected buffers [B, len, heads * dim], as multi-head attention produces them.
        const auto xq = attend_test::random_tensor<T>(c.seed * 5 + 1, B, L, H * D);
        const auto xk = attend_test::random_tensor<T>(c.seed * 5 + 2, B, S, G * D);
        const auto xv = attend_test::random_tensor<T>(c.seed * 5 + 3, B, S, G * Dv);
        const auto transpose = [](const tensor<T, 3>& buf, index heads, index dim) {
            tensor<T, 4> t(buf.dimension(0), heads, buf.dimension(1), dim);
            for (index b = 0; b < t.dimension(0); ++b)
                for (index h = 0; h < heads; ++h)
                    for (index i = 0; i < t.dimension(2); ++i)
                        for (index d = 0; d < dim; ++d) t(b, h, i, d) = buf(b, i, h * dim + d);
            return t;
        };
        const auto qt = transpose(xq, H, D), kt = transpose(xk, G, D), vt = transpose(xv, G, Dv);
        const auto mask = attend::causal(attend::alignment::bottom_right) || attend::sliding_window(1, 1);
        attend::sdpa_options o = zero_rows();
        o.kernel = c.kernel;
        o.need_weights = true;
        const auto expected = attend::scaled_dot_product_attention(qt, kt, vt, mask, o);
        const auto strided = attend::scaled_dot_product_attention(
            attend::split_heads(xq.data(), B, L, H, D), attend::split_heads(xk.data(), B, S, G, D),
            attend::split_heads(xv.data(), B, S, G, Dv), mask, o);
        ASSERT_TRUE(near(strided.out, expected.out, tol_same<T>()));
        ASSERT_TRUE(near(strided.weights, expected.weights, tol_same<T>()));
        // The trap: reshape without transpose.
        const attend::const_tensor_view<T, 4> qr(xq.data(), B, H, L, D), kr(xk.data(), B, G, S, D),
            vr(xv.data(), B, G, S, Dv);
        const auto reshaped = attend::scaled_dot_product_attention(qr, kr, vr, mask, o);
        EXPECT_FALSE(near(reshaped.out, expected.out, 1e-3)) << "a reshape without transpose gave the same answer";
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Long rows: the tiled kernel across key tiles, query blocks, trimming and its split-key decode path
// ---------------------------------------------------------------------------------------------------------------

// Decode shapes (query_len <= 16, 600..2200 keys) and prefill shapes (65..140 queries, 130..600 keys). Without
// weights the tiled kernel takes its split-key decode path (key_len > 1024 in float, > 512 in double); with
// weights the block path. Tolerance vs the double oracle: float 2e-4, double 1e-12 (a sum of key_len <= 2200
// products with sum |w_j v_j| <= 1 carries at most key_len * eps_f / 2 ~ 1.3e-4). Thread counts: identical.
TYPED_TEST(SdpaProperty, TiledKernelOnLongRowsEqualsTheOracleWithAndWithoutWeightsForAnyThreadCount) {
    using T = TypeParam;
    const double tol = std::is_same_v<T, float> ? 2e-4 : 1e-12;
    for (int n = 0; n < attend_test::repeat(30); ++n) {
        config c = random_config(21000 + static_cast<std::uint64_t>(n));
        rng g(c.seed);
        const bool decode = n % 2 == 0;
        c.batch = g.uniform_int(1, 2);
        c.kv_heads = c.rank3 ? 1 : g.uniform_int(1, 2);
        c.heads = c.rank3 ? 1 : c.kv_heads * g.uniform_int(1, 4);
        c.query_len = decode ? g.uniform_int(1, 16) : g.uniform_int(65, 140);
        c.key_len = decode ? g.uniform_int(600, 2200) : g.uniform_int(130, 600);
        c.head_dim = g.uniform_int(1, 8);
        c.value_dim = g.uniform_int(1, 8);
        c.kernel = attend::kernel::tiled;
        const auto x = random_inputs<T>(c);
        with_random_mask<T>(g, c, [&](const auto& mask, const std::string& name, const bias_fn& bias) {
            SCOPED_TRACE(describe(c) + ", mask " + name);
            const auto e = oracle(c, x, default_scale(c), bias);
            // With weights (block path), and against the reference kernel too.
            const auto r = run(c, x, mask, zero_rows());
            ASSERT_TRUE(matches_oracle(r, e, bias, tol));
            config cr = c;
            cr.kernel = attend::kernel::reference;
            const auto ref = run(cr, x, mask, zero_rows());
            ASSERT_TRUE(near(r.out, ref.out, tol));
            ASSERT_TRUE(near(r.weights, ref.weights, tol));
            // Without weights (decode path for the long-key shapes), thread counts 1, 2 and 3.
            tensor<T, 4> first_out;
            tensor<T, 3> first_lse;
            for (const int threads : {1, 2, 3}) {
                attend::sdpa_options o = zero_rows();
                o.kernel = attend::kernel::tiled;
                o.threads = threads;
                o.need_lse = true;
                tensor<T, 4> out;
                tensor<T, 3> lse;
                if (c.rank3) {
                    const auto r3 = attend::scaled_dot_product_attention(drop_heads(x.q), drop_heads(x.k),
                                                                         drop_heads(x.v), mask, o);
                    out = add_heads(r3.out);
                    lse = add_heads(r3.lse);
                } else {
                    auto r4 = attend::scaled_dot_product_attention(x.q, x.k, x.v, mask, o);
                    out = r4.out;
                    lse = r4.lse;
                }
                if (threads == 1) {
                    first_out = out;
                    first_lse = lse;
                    for (index b = 0; b < c.batch; ++b)
                        for (index h = 0; h < c.heads; ++h)
                            for (index i = 0; i < c.query_len; ++i) {
                                const double l = static_cast<double>(lse(b, h, i));
                                if (e.l(b, h, i) == minus_inf) {
                                    ASSERT_EQ(l, minus_inf);
                                } else {
                                    ASSERT_NEAR(l, e.l(b, h, i), tol);
                                }
                                for (index d = 0; d < c.value_dim; ++d)
                                    ASSERT_NEAR(static_cast<double>(out(b, h, i, d)), e.o(b, h, i, d), tol)
                                        << "out (" << b << ',' << h << ',' << i << ',' << d << ") without weights";
                            }
                } else {
                    ASSERT_TRUE(identical(out, first_out)) << threads << " threads";
                    ASSERT_TRUE(identical(lse, first_lse)) << threads << " threads";
                }
            }
        });
    }
}

/// Every zero-size call of one kernel: results of the right (empty) shape, no throw, under the default policy.
template <class T>
void check_zero_size_calls(attend::kernel kernel) {
    for (const auto& dims : std::vector<std::array<index, 2>>{{0, 5}, {3, 0}, {0, 0}}) {
        const index B = dims[0], L = dims[1], H = 4, G = 2, S = 7, D = 3, Dv = 5;
        SCOPED_TRACE(std::string("kernel ") + name_of(kernel) + ", batch " + std::to_string(B) + ", query_len " +
                     std::to_string(L));
        attend::sdpa_options o;  // default policy: empty_rows::error, and still no throw
        o.kernel = kernel;
        o.need_weights = true;
        o.need_lse = true;
        tensor<T, 4> q(B, H, L, D), k(B, G, S, D), v(B, G, S, Dv);
        attend_test::fill_uniform(k, 1);
        attend_test::fill_uniform(v, 2);
        std::vector<index> lengths(at(B), S);
        const auto check4 = [&](const auto& r) {
            EXPECT_EQ(r.out.dimensions(), (std::array<index, 4>{B, H, L, Dv}));
            EXPECT_EQ(r.weights.dimensions(), (std::array<index, 4>{B, H, L, S}));
            EXPECT_EQ(r.lse.dimensions(), (std::array<index, 3>{B, H, L}));
            EXPECT_EQ(r.out.size(), 0);
        };
        EXPECT_NO_THROW(check4(attend::scaled_dot_product_attention(q, k, v, o)));
        EXPECT_NO_THROW(
            check4(attend::scaled_dot_product_attention(q, k, v, attend::causal(attend::alignment::bottom_right), o)));
        EXPECT_NO_THROW(check4(attend::scaled_dot_product_attention(q, k, v, attend::key_padding(lengths), o)));
        tensor<bool, 2> everything(L, S);
        everything.setConstant(true);
        EXPECT_NO_THROW(check4(
            attend::scaled_dot_product_attention(q, k, v, attend::allowed_mask::from_torch_sdpa(everything), o)));
        tensor<T, 4> out(B, H, L, Dv), weights(B, H, L, S);
        tensor<T, 3> lse(B, H, L);
        EXPECT_NO_THROW(attend::scaled_dot_product_attention_into(q, k, v, attend::no_mask{}, out, o, weights, lse));
        attend::sdpa_options out_only = o;  // without weights (the tiled kernel's decode path is chosen then)
        out_only.need_weights = false;
        EXPECT_NO_THROW((void)attend::scaled_dot_product_attention(q, k, v, out_only));
        // Rank 3.
        tensor<T, 3> q3(B, L, D), k3(B, S, D), v3(B, S, Dv);
        attend_test::fill_uniform(k3, 3);
        attend_test::fill_uniform(v3, 4);
        EXPECT_NO_THROW({
            const auto r =
                attend::scaled_dot_product_attention(q3, k3, v3, attend::causal(attend::alignment::top_left), o);
            EXPECT_EQ(r.out.dimensions(), (std::array<index, 3>{B, L, Dv}));
            EXPECT_EQ(r.lse.dimensions(), (std::array<index, 2>{B, L}));
        });
    }
}

// Each kernel runs in a child process first (a gtest death-test fork), so that a crash (e.g. a division by zero on
// an empty shape) fails this test instead of killing the whole binary; then in process for the detailed messages.
TYPED_TEST(SdpaProperty, ZeroBatchOrZeroQueryLenGivesAnEmptyResultWithoutError) {
    using T = TypeParam;
    GTEST_FLAG_SET(death_test_style, "threadsafe");
    for (const auto kernel : {attend::kernel::reference, attend::kernel::tiled, attend::kernel::automatic}) {
        SCOPED_TRACE(name_of(kernel));
        EXPECT_EXIT(
            {
                check_zero_size_calls<T>(kernel);
                std::exit(::testing::Test::HasFailure() ? 1 : 0);
            },
            ::testing::ExitedWithCode(0), "")
            << "zero-size calls crashed or failed in a child process";
        if (!::testing::Test::HasFailure()) check_zero_size_calls<T>(kernel);
    }
}

}  // namespace
