// SPDX-License-Identifier: MIT
// The tiled kernel (detail/tiled_kernel.hpp) against the reference kernel over many seeded random
// configurations, plus thread determinism and dispatch.
//
// Error measure, for out and weights: max |tiled - reference| / max(1, max |reference|) over the whole tensor;
// for lse, per element |tiled - reference| / max(1, |reference|), with -inf required at exactly the same places.
// Bounds: 1e-5 in float, 1e-12 in double. Every tiled value must also be free of NaN, and a weight of a forbidden
// position must be exactly 0.

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <attend/attend.hpp>

#include "support/compare.hpp"
#include "support/dense_masks.hpp"
#include "support/kept_scratch.hpp"
#include "support/paged_model.hpp"
#include "support/random.hpp"

namespace {

using attend::alignment;
using attend::index_t;
using attend::detail::tile_config;
using attend_test::bit_equal;

template <class T>
double tolerance() {
    return std::is_same_v<T, float> ? 1e-5 : 1e-12;
}

/// Input storage for one configuration: contiguous rank 3 / rank 4 tensors, or projected [B, len, heads * dim]
/// buffers read through split_heads (the strided views multi-head attention uses).
template <class T>
struct inputs {
    std::vector<T> q_data, k_data, v_data;
    attend::strided_view<const T> q, k, v;
};

template <class T>
attend::strided_view<const T> make_view(std::vector<T>& data, attend_test::rng& g, double amplitude, int rank,
                                        bool split, index_t batch, index_t heads, index_t len, index_t dim) {
    data.resize(static_cast<std::size_t>(batch * heads * len * dim));
    for (auto& x : data) x = static_cast<T>(amplitude * g.uniform(-1.0, 1.0));
    attend::strided_view<const T> view;
    if (split) return attend::split_heads<const T>(data.data(), batch, len, heads, dim);
    view.data = data.data();
    view.rank = rank;
    view.dims = {batch, heads, len, dim};
    view.strides = {heads * len * dim, len * dim, dim, 1};
    return view;
}

/// Everything one random configuration decides besides the mask.
struct config {
    std::uint64_t seed = 0;
    int rank = 4;
    bool split = false;
    bool strided_out = false;
    index_t batch = 1, heads = 1, kv_heads = 1, query_len = 1, key_len = 1, head_dim = 1, value_dim = 1;
    double q_amplitude = 1;
    attend::sdpa_options options;
    int threads = 1;
    bool default_tiles = true;
    tile_config tiles;
    std::string bias_kind = "none";
    std::string mask_kind;

    std::string describe() const {
        std::ostringstream s;
        s << "seed " << seed << " rank " << rank << (split ? " split_heads" : "") << (strided_out ? " strided_out" : "")
          << " B " << batch << " H " << heads << " KH " << kv_heads << " L " << query_len << " S " << key_len << " D "
          << head_dim << " Dv " << value_dim << " mask " << mask_kind << " bias " << bias_kind << " dropout "
          << (options.dropout.training ? options.dropout.probability : 0.0) << " weights " << options.need_weights
          << (options.weights_after_dropout ? " (after dropout)" : "") << " lse " << options.need_lse << " empty_rows "
          << (options.empty_rows == attend::empty_rows::zero ? "zero" : "error") << " threads " << threads;
        if (!default_tiles)
            s << " tiles {" << tiles.query_rows << ", " << tiles.key_tile << ", trim " << tiles.trim_step << ", slab "
              << tiles.slab_rows << ", gemv " << tiles.gemv_rows << ", decode " << tiles.decode_queries << "/"
              << tiles.decode_chunk << "}";
        return s.str();
    }
};

struct tally {
    int compared = 0;
    int rejected = 0;  ///< empty rows under empty_rows::error: both kernels are behind the same check
};

template <class T>
struct run_outputs {
    std::vector<T> out_data, weights, lse;
    attend::detail::attention_outputs<T> o;
};

template <class T>
run_outputs<T> make_outputs(const config& c, bool strided) {
    run_outputs<T> r;
    const index_t rows = c.batch * c.heads * c.query_len;
    r.out_data.assign(static_cast<std::size_t>(rows * c.value_dim), std::numeric_limits<T>::quiet_NaN());
    if (strided) {
        r.o.out = attend::split_heads<T>(r.out_data.data(), c.batch, c.query_len, c.heads, c.value_dim);
    } else {
        r.o.out.data = r.out_data.data();
        r.o.out.dims = {c.batch, c.heads, c.query_len, c.value_dim};
        r.o.out.strides = {c.heads * c.query_len * c.value_dim, c.query_len * c.value_dim, c.value_dim, 1};
    }
    if (c.options.need_weights) {
        r.weights.assign(static_cast<std::size_t>(rows * c.key_len), std::numeric_limits<T>::quiet_NaN());
        r.o.weights = r.weights.data();
    }
    if (c.options.need_lse) {
        r.lse.assign(static_cast<std::size_t>(rows), std::numeric_limits<T>::quiet_NaN());
        r.o.lse = r.lse.data();
    }
    return r;
}

template <class T>
T out_at(const run_outputs<T>& r, index_t b, index_t h, index_t i, index_t d) {
    return r.o.out.row(b, h, i)[d];
}

/// Runs both kernels on one configuration and checks the tiled one against the reference.
template <class T, class Mask>
void compare(const config& c, const inputs<T>& in, const Mask& mask, tally& t) {
    SCOPED_TRACE(c.describe());
    const attend::attention_shape s = attend::detail::check_views(in.q, in.k, in.v);
    std::optional<decltype(attend::detail::check_call(in.q, in.k, in.v, s, mask, c.options))> call;
    try {
        call.emplace(attend::detail::check_call(in.q, in.k, in.v, s, mask, c.options));
    } catch (const attend::mask_error& e) {
        ASSERT_EQ(c.options.empty_rows, attend::empty_rows::error) << e.what();
        ASSERT_STREQ(e.id().c_str(), "attend.mask.empty_row");
        ++t.rejected;
        return;
    }
    auto ref = make_outputs<T>(c, false);
    auto til = make_outputs<T>(c, c.strided_out);
    attend::detail::reference_attention(in.q, in.k, in.v, s, call->mask, call->params, ref.o);
    if (c.default_tiles)
        attend::detail::tiled_attention(in.q, in.k, in.v, s, call->mask, call->params, til.o, c.threads);
    else attend::detail::tiled_attention(in.q, in.k, in.v, s, call->mask, call->params, til.o, c.threads, c.tiles);

    const double tol = tolerance<T>();
    double ref_max = 0, diff = 0;
    bool nan = false;
    for (index_t b = 0; b < s.batch; ++b)
        for (index_t h = 0; h < s.heads; ++h)
            for (index_t i = 0; i < s.query_len; ++i)
                for (index_t d = 0; d < s.value_dim; ++d) {
                    const double a = out_at(ref, b, h, i, d), x = out_at(til, b, h, i, d);
                    nan = nan || std::isnan(x);
                    ref_max = std::max(ref_max, std::abs(a));
                    diff = std::max(diff, std::abs(a - x));
                }
    EXPECT_FALSE(nan) << "NaN in tiled out";
    EXPECT_LE(diff / std::max(1.0, ref_max), tol) << "out";
    if (c.options.need_lse) {
        for (std::size_t n = 0; n < ref.lse.size(); ++n) {
            const double a = ref.lse[n], x = til.lse[n];
            ASSERT_FALSE(std::isnan(x)) << "NaN in tiled lse at " << n;
            if (std::isinf(a) || std::isinf(x)) {
                ASSERT_EQ(a, x) << "lse at " << n;
                continue;
            }
            ASSERT_LE(std::abs(a - x) / std::max(1.0, std::abs(a)), tol) << "lse at " << n << ": " << a << " vs " << x;
        }
    }
    if (c.options.need_weights) {
        double wmax = 0, wdiff = 0;
        for (std::size_t n = 0; n < ref.weights.size(); ++n) {
            ASSERT_FALSE(std::isnan(til.weights[n])) << "NaN in tiled weights at " << n;
            wmax = std::max(wmax, std::abs(static_cast<double>(ref.weights[n])));
            wdiff =
                std::max(wdiff, std::abs(static_cast<double>(ref.weights[n]) - static_cast<double>(til.weights[n])));
        }
        EXPECT_LE(wdiff / std::max(1.0, wmax), tol) << "weights";
        for (index_t b = 0; b < s.batch; ++b)
            for (index_t h = 0; h < s.heads; ++h)
                for (index_t i = 0; i < s.query_len; ++i)
                    for (index_t j = 0; j < s.key_len; ++j)
                        if (!call->mask.allowed(b, h, i, j) || call->mask.query_padded(b, i)) {
                            ASSERT_EQ(til.weights[static_cast<std::size_t>(
                                          ((b * s.heads + h) * s.query_len + i) * s.key_len + j)],
                                      T(0))
                                << "forbidden weight (" << b << ',' << h << ',' << i << ',' << j << ") is not 0";
                        }
    }
    ++t.compared;
}

// ---- masks --------------------------------------------------------------------------------------------------------

/// Dims of a dense mask broadcasting to the scores: rank 2..score rank, each axis full or 1.
std::vector<index_t> dense_dims(attend_test::rng& g, const config& c) {
    const std::vector<index_t> score = c.rank == 4 ? std::vector<index_t>{c.batch, c.heads, c.query_len, c.key_len}
                                                   : std::vector<index_t>{c.batch, c.query_len, c.key_len};
    const auto rank = static_cast<std::size_t>(g.uniform_int(2, static_cast<index_t>(score.size())));
    std::vector<index_t> dims(score.end() - static_cast<std::ptrdiff_t>(rank), score.end());
    for (auto& d : dims)
        if (g.bernoulli(0.3)) d = 1;
    return dims;
}

template <int Rank, class V>
attend::tensor<V, Rank> dense_tensor(const std::vector<index_t>& dims) {
    std::array<index_t, Rank> d{};
    for (int a = 0; a < Rank; ++a) d[static_cast<std::size_t>(a)] = dims[static_cast<std::size_t>(a)];
    return attend::tensor<V, Rank>(d);
}

/// Calls f with an allowed_mask (or, with `forbidden`, to_allowed of a forbidden_mask) of random broadcast shape.
template <class F>
void with_dense_boolean(attend_test::rng& g, const config& c, bool forbidden, F&& f) {
    const auto dims = dense_dims(g, c);
    const double density = g.uniform(0.3, 1.0);
    const auto fill = [&](auto& x) {
        for (index_t n = 0; n < x.size(); ++n) x.data()[n] = g.bernoulli(density) != forbidden;
    };
    const auto make = [&](const auto& x) {
        if (forbidden) f(attend::to_allowed(attend_test::dense_mask<attend::forbidden_mask>(x)));
        else f(attend_test::dense_mask<attend::allowed_mask>(x));
    };
    if (dims.size() == 2) {
        auto x = dense_tensor<2, bool>(dims);
        fill(x);
        make(x);
    } else if (dims.size() == 3) {
        auto x = dense_tensor<3, bool>(dims);
        fill(x);
        make(x);
    } else {
        auto x = dense_tensor<4, bool>(dims);
        fill(x);
        make(x);
    }
}

/// An additive mask of random broadcast shape: -inf, 0 and finite values.
template <class T>
attend::additive_mask<T> dense_additive(attend_test::rng& g, const config& c) {
    const auto dims = dense_dims(g, c);
    const double forbid = g.uniform(0.0, 0.5), zero = g.uniform(0.0, 0.5);
    const auto fill = [&](auto& x) {
        for (index_t n = 0; n < x.size(); ++n) {
            const double u = g.uniform();
            x.data()[n] = u < forbid          ? -std::numeric_limits<T>::infinity()
                          : u < forbid + zero ? T(0)
                                              : static_cast<T>(g.uniform(-4.0, 4.0));
        }
    };
    if (dims.size() == 2) {
        auto x = dense_tensor<2, T>(dims);
        fill(x);
        return attend::additive_mask<T>::query_key_grid(x);
    }
    if (dims.size() == 3) {
        auto x = dense_tensor<3, T>(dims);
        fill(x);
        return attend::additive_mask<T>::from_values(x);
    }
    auto x = dense_tensor<4, T>(dims);
    fill(x);
    return attend::additive_mask<T>::from_values(x);
}

std::vector<index_t> lengths(attend_test::rng& g, index_t batch, index_t max) {
    std::vector<index_t> n(static_cast<std::size_t>(batch));
    for (auto& x : n) x = g.bernoulli(0.2) ? max : g.uniform_int(0, max);
    return n;
}

alignment any_alignment(attend_test::rng& g) {
    return g.bernoulli(0.5) ? alignment::top_left : alignment::bottom_right;
}

/// Any diagonal a rule takes: an alignment, one offset for every batch row (at times far outside the scores),
/// one offset per row, or per-row key lengths (ONNX's nonpad_kv_seqlen).
attend::diagonal any_diagonal(attend_test::rng& g, const config& c) {
    const index_t reach = c.query_len + c.key_len;
    const auto offset = [&] {
        if (g.bernoulli(0.1)) return g.bernoulli(0.5) ? std::numeric_limits<index_t>::max() : -reach * 1000;
        return g.uniform_int(-c.query_len, c.key_len);
    };
    switch (g.uniform_int(0, 4)) {
        case 0: return attend::diagonal_offset(offset());
        case 1: {
            std::vector<index_t> offsets(static_cast<std::size_t>(c.batch));
            for (auto& x : offsets) x = offset();
            return attend::diagonal_offsets(std::move(offsets));
        }
        case 2: return attend::aligned_to_key_lengths(lengths(g, c.batch, c.key_len));
        default: return any_alignment(g);
    }
}

attend::sliding_window_rule any_window(attend_test::rng& g, const config& c) {
    const index_t span = std::max(c.query_len, c.key_len);
    const index_t left = g.bernoulli(0.1) ? attend::unbounded : g.uniform_int(0, span / 2 + 2);
    const index_t right = g.bernoulli(0.1) ? attend::unbounded : g.uniform_int(0, span / 4 + 1);
    return attend::sliding_window(left, right, any_diagonal(g, c));
}

std::vector<index_t> block_lengths(attend_test::rng& g, index_t total) {
    std::vector<index_t> n;
    index_t left = total;
    while (left > 0) {
        const index_t x = std::min(left, g.uniform_int(0, total / 3 + 2));
        n.push_back(x);
        left -= x;
    }
    return n;
}

/// Picks a mask expression and calls compare with it.
template <class T>
void compare_random_mask(attend_test::rng& g, config& c, const inputs<T>& in, tally& t) {
    constexpr int kinds = 20;
    int kind = static_cast<int>(g.uniform_int(0, kinds - 1));
    if (kind == 10 && c.query_len != c.key_len) kind = 4;
    const auto run = [&](const char* name, const auto& mask) {
        c.mask_kind = name;
        compare(c, in, mask, t);
    };
    switch (kind) {
        case 0: return run("none", attend::no_mask{});
        case 1: return with_dense_boolean(g, c, false, [&](const auto& m) { run("allowed_mask", m); });
        case 2: return with_dense_boolean(g, c, true, [&](const auto& m) { run("to_allowed(forbidden)", m); });
        case 3: return run("additive", dense_additive<T>(g, c));
        case 4: return run("causal top_left", attend::causal(alignment::top_left));
        case 5: return run("causal bottom_right", attend::causal(alignment::bottom_right));
        case 6: return run("sliding_window", any_window(g, c));
        case 7: return run("prefix_lm", attend::prefix_lm(g.uniform_int(0, c.key_len), any_diagonal(g, c)));
        case 8: return run("key_padding", attend::key_padding(lengths(g, c.batch, c.key_len)));
        case 9:
            return run("query_padding && causal",
                       attend::query_padding(lengths(g, c.batch, c.query_len)) && attend::causal(any_diagonal(g, c)));
        case 10:
            return run("block_diagonal",
                       attend::block_diagonal(attend::segment_lengths(block_lengths(g, c.query_len))));
        case 11:
            return run("causal && key_padding",
                       attend::causal(any_diagonal(g, c)) && attend::key_padding(lengths(g, c.batch, c.key_len)));
        case 12:
            return run("sliding_window || prefix_lm",
                       any_window(g, c) || attend::prefix_lm(g.uniform_int(0, c.key_len), any_diagonal(g, c)));
        case 13: return with_dense_boolean(g, c, false, [&](const auto& m) { run("!allowed_mask", !m); });
        case 14: return run("additive + causal", dense_additive<T>(g, c) + attend::causal(any_diagonal(g, c)));
        case 15:
            return with_dense_boolean(g, c, false, [&](const auto& m) {
                run("query_padding && allowed_mask", attend::query_padding(lengths(g, c.batch, c.query_len)) && m);
            });
        case 16: return run("!causal || sliding_window", !attend::causal(any_alignment(g)) || any_window(g, c));
        case 17:
            return with_dense_boolean(g, c, true, [&](const auto& m) {
                run("additive + (to_allowed(forbidden) && sliding_window)",
                    dense_additive<T>(g, c) + (m && any_window(g, c)));
            });
        case 18:
            return run("query_padding && key_padding + additive",
                       (attend::query_padding(lengths(g, c.batch, c.query_len)) &&
                        attend::key_padding(lengths(g, c.batch, c.key_len))) +
                           dense_additive<T>(g, c));
        default:
            return with_dense_boolean(g, c, false, [&](const auto& m) {
                run("allowed_mask || causal", m || attend::causal(any_alignment(g)));
            });
    }
}

// ---- random configurations ----------------------------------------------------------------------------------------

index_t pick(attend_test::rng& g, const std::vector<index_t>& values) {
    return values[static_cast<std::size_t>(g.uniform_int(0, static_cast<index_t>(values.size()) - 1))];
}

template <class T>
void random_configuration(std::uint64_t seed, tally& t) {
    attend_test::rng g(seed);
    config c;
    c.seed = seed;
    c.rank = g.bernoulli(0.2) ? 3 : 4;
    c.default_tiles = g.bernoulli(0.5);
    const std::vector<index_t> sizes{1, 2, 7, 16, 31, 63, 64, 65, 100, 129, 257, 513, 1000};
    // Work (reference flops) stays bounded; tiny tiles get tiny problems.
    const double budget = c.default_tiles ? 4e6 : 2.5e5;
    for (int attempt = 0;; ++attempt) {
        c.batch = g.uniform_int(1, 3);
        c.heads = c.rank == 3 ? 1 : pick(g, {1, 2, 3, 4, 8});
        std::vector<index_t> divisors;
        for (index_t d = 1; d <= c.heads; ++d)
            if (c.heads % d == 0) divisors.push_back(d);
        c.kv_heads = pick(g, divisors);
        c.query_len = pick(g, sizes);
        c.key_len = g.bernoulli(0.2) ? c.query_len : pick(g, sizes);
        c.head_dim = pick(g, {1, 3, 8, 16, 32, 64});
        c.value_dim = g.bernoulli(0.6) ? c.head_dim : pick(g, {1, 5, 16, 24, 64});
        const double work = static_cast<double>(c.batch * c.heads * c.query_len * c.key_len) *
                            static_cast<double>(c.head_dim + c.value_dim);
        if (work <= budget || attempt > 50) break;
    }
    c.split = c.rank == 4 && g.bernoulli(0.3);
    c.strided_out = c.rank == 4 && g.bernoulli(0.3);
    c.q_amplitude = g.bernoulli(0.3) ? 4.0 : 1.0;
    c.threads = static_cast<int>(g.uniform_int(1, 4));
    if (!c.default_tiles) {
        c.tiles.query_rows = pick(g, {1, 3, 8, 16, 64});
        c.tiles.key_tile = pick(g, {1, 5, 16, 32, 100});
        c.tiles.trim_step = pick(g, {1, 2, 7, 16});
        c.tiles.decode_queries = pick(g, {0, 4, 16});
        c.tiles.decode_chunk = c.tiles.key_tile * pick(g, {1, 2, 3});
        c.tiles.slab_rows = pick(g, {1, 3, 32});
        c.tiles.gemv_rows = pick(g, {0, 2, 8});
    }
    auto& o = c.options;
    o.empty_rows = g.bernoulli(0.7) ? attend::empty_rows::zero : attend::empty_rows::error;
    o.need_lse = g.bernoulli(0.7);
    o.need_weights = g.bernoulli(0.35);
    if (g.bernoulli(0.2)) o.scale = g.uniform(0.05, 2.0);
    if (g.bernoulli(0.25)) {
        o.dropout.training = true;
        o.dropout.probability = g.uniform(0.05, 0.7);
        o.dropout.seed = g.next();
        o.weights_after_dropout = g.bernoulli(0.5);
    }
    const double bias = g.uniform();
    if (bias < 0.15) {
        std::vector<double> slopes(static_cast<std::size_t>(c.heads));
        for (auto& x : slopes) x = g.uniform(0.0, 0.3);
        o.score_bias = attend::score_bias::alibi(slopes, any_alignment(g));
        c.bias_kind = "alibi";
    } else if (bias < 0.3) {
        attend::relative_position_bias<double> table(c.heads, g.bernoulli(0.5), pick(g, {8, 32}), pick(g, {20, 128}),
                                                     g.next());
        o.score_bias = attend::score_bias::relative(table, any_alignment(g));
        c.bias_kind = "relative";
    }
    inputs<T> in;
    in.q = make_view(in.q_data, g, c.q_amplitude, c.rank, c.split, c.batch, c.heads, c.query_len, c.head_dim);
    in.k = make_view(in.k_data, g, 1.0, c.rank, c.split, c.batch, c.kv_heads, c.key_len, c.head_dim);
    in.v = make_view(in.v_data, g, 1.0, c.rank, c.split, c.batch, c.kv_heads, c.key_len, c.value_dim);
    compare_random_mask(g, c, in, t);
}

TEST(TiledKernel, MatchesReferenceFloat) {
    tally t;
    const int n = attend_test::repeat(320);
    for (int i = 0; i < n; ++i) {
        random_configuration<float>(0x5eed0000ULL + static_cast<std::uint64_t>(i), t);
        if (HasFatalFailure()) return;
    }
    std::printf("float: %d configurations compared, %d rejected as empty rows before either kernel ran\n", t.compared,
                t.rejected);
    EXPECT_GT(t.compared, n / 2);
}

TEST(TiledKernel, MatchesReferenceDouble) {
    tally t;
    const int n = attend_test::repeat(240);
    for (int i = 0; i < n; ++i) {
        random_configuration<double>(0xd0b1e000ULL + static_cast<std::uint64_t>(i), t);
        if (HasFatalFailure()) return;
    }
    std::printf("double: %d configurations compared, %d rejected as empty rows before either kernel ran\n", t.compared,
                t.rejected);
    EXPECT_GT(t.compared, n / 2);
}

/// The sizes the issue names, each against every other, with default tiles and a causal mask and without.
TEST(TiledKernel, NamedSizesFloat) {
    tally t;
    const std::vector<index_t> sizes{1, 7, 63, 65, 129, 1000};
    std::uint64_t seed = 77;
    for (index_t l : sizes)
        for (index_t sk : sizes) {
            attend_test::rng g(seed++);
            config c;
            c.seed = seed;
            c.heads = 2;
            c.kv_heads = 1;
            c.query_len = l;
            c.key_len = sk;
            c.head_dim = 64;
            c.value_dim = 48;
            c.threads = 2;
            c.options.need_lse = true;
            c.options.empty_rows = attend::empty_rows::zero;
            inputs<float> in;
            in.q = make_view(in.q_data, g, 2.0, 4, false, c.batch, c.heads, l, c.head_dim);
            in.k = make_view(in.k_data, g, 1.0, 4, false, c.batch, c.kv_heads, sk, c.head_dim);
            in.v = make_view(in.v_data, g, 1.0, 4, false, c.batch, c.kv_heads, sk, c.value_dim);
            c.mask_kind = "none";
            compare(c, in, attend::no_mask{}, t);
            c.mask_kind = "causal bottom_right";
            compare(c, in, attend::causal(alignment::bottom_right), t);
            if (HasFatalFailure()) return;
        }
    EXPECT_EQ(t.compared, 72);
}

// ---- determinism and dispatch ------------------------------------------------------------------------------------

TEST(TiledKernel, BitIdenticalForAnyThreadCount) {
    const auto q = attend_test::random_tensor<float>(1, 2, 4, 333, 32);
    const auto k = attend_test::random_tensor<float>(2, 2, 2, 517, 32);
    const auto v = attend_test::random_tensor<float>(3, 2, 2, 517, 40);
    attend::sdpa_options o;
    o.kernel = attend::kernel::tiled;
    o.need_weights = true;
    o.need_lse = true;
    o.empty_rows = attend::empty_rows::zero;
    o.dropout = {0.2, 1234, true};
    o.score_bias = attend::score_bias::alibi(attend::alibi_slopes(4), attend::alignment::top_left);
    const auto mask = attend::causal(alignment::bottom_right) && attend::key_padding({517, 300});
    o.threads = 1;
    const auto one = attend::scaled_dot_product_attention(q, k, v, mask, o);
    for (int threads : {2, 7}) {
        o.threads = threads;
        const auto r = attend::scaled_dot_product_attention(q, k, v, mask, o);
        EXPECT_TRUE(bit_equal(one.out, r.out)) << threads << " threads";
        EXPECT_TRUE(bit_equal(one.weights, r.weights)) << threads << " threads";
        EXPECT_TRUE(bit_equal(one.lse, r.lse)) << threads << " threads";
    }
}

/// Random q [batch, heads, query_len, head_dim], k [batch, kv_heads, key_len, head_dim] and v (value_dim wide) from
/// seeds seed, seed + 1, seed + 2, q scaled by `q_scale`, with their views and checked shape (views into the
/// tensors: not copyable).
template <class T>
struct random_call {
    attend::tensor<T, 4> q, k, v;
    attend::strided_view<const T> qv, kv, vv;
    attend::attention_shape s;

    random_call(std::uint64_t seed, index_t batch, index_t heads, index_t kv_heads, index_t query_len, index_t key_len,
                index_t head_dim, index_t value_dim, T q_scale = T(1))
        : q(attend_test::random_tensor<T>(seed, batch, heads, query_len, head_dim) * q_scale),
          k(attend_test::random_tensor<T>(seed + 1, batch, kv_heads, key_len, head_dim)),
          v(attend_test::random_tensor<T>(seed + 2, batch, kv_heads, key_len, value_dim)),
          qv(attend::detail::as_view(q)),
          kv(attend::detail::as_view(k)),
          vv(attend::detail::as_view(v)),
          s(attend::check_shapes(q, k, v)) {}
    random_call(const random_call&) = delete;
    random_call& operator=(const random_call&) = delete;
};

template <class T>
void expect_weights_in_unit_range_at_huge_scores(T amplitude) {
    // Query padding makes every tile mixed: the forward pass takes the scores by 1-row slabs (the row kernels),
    // the weights pass over the whole 5-row block (the micro-kernel), and the two sum in different orders. With
    // scores near amplitude, one rounding apart is far more than exp can take: a weight must still be in [0, 1].
    const random_call<T> in(1, 3, 1, 1, 16, 3, 5, 1, amplitude);
    attend::sdpa_options o;
    o.need_weights = true;
    o.empty_rows = attend::empty_rows::zero;
    o.check_finite = false;
    const auto call = attend::detail::check_call(in.qv, in.kv, in.vv, in.s, attend::query_padding({16, 9, 3}), o);
    tile_config tiles;
    tiles.query_rows = 5;
    tiles.key_tile = tiles.trim_step = tiles.slab_rows = tiles.gemv_rows = 1;
    attend::tensor<T, 4> out(3, 1, 16, 1), w(3, 1, 16, 3);
    w.setConstant(std::numeric_limits<T>::quiet_NaN());
    attend::detail::attention_outputs<T> r;
    r.out = attend::detail::as_mutable_view(out);
    r.weights = w.data();
    attend::detail::tiled_attention(in.qv, in.kv, in.vv, in.s, call.mask, call.params, r, 1, tiles);
    for (index_t n = 0; n < w.size(); ++n)
        ASSERT_TRUE(w.data()[n] >= T(0) && w.data()[n] <= T(1)) << "weight " << n << " is " << w.data()[n];
}

/// A unit runs up to tile_config::shared_blocks query blocks of one (batch, kv head) over each packed K and V tile,
/// switching their states tile by tile: out, lse and weights have the bits of one block per unit, for any grouping
/// (one that leaves a short last unit too) and thread count, with a causal diagonal, padding, bias, dropout and sinks,
/// in float panels and (bf16, where the target has AVX-512 BF16) the pair kernels.
template <class T>
void expect_shared_blocks_change_no_bit() {
    const index_t B = 2, H = 4, KH = 2, L = 150, S = 170, D = 32;
    const attend::tensor<T, 4> q = attend_test::random_tensor<float>(41, B, H, L, D).cast<T>();
    const attend::tensor<T, 4> k = attend_test::random_tensor<float>(42, B, KH, S, D).cast<T>();
    const attend::tensor<T, 4> v = attend_test::random_tensor<float>(43, B, KH, S, D).cast<T>();
    const auto qv = attend::detail::as_view(q), kv = attend::detail::as_view(k), vv = attend::detail::as_view(v);
    const auto s = attend::check_shapes(q, k, v);
    attend::sdpa_options o;
    o.need_weights = true;
    o.dropout = {0.1, 99, true};
    o.score_bias = attend::score_bias::alibi(attend::alibi_slopes(H), attend::alignment::top_left);
    o.sinks = attend::attention_sinks(std::vector<double>{0.5, -1.0, 2.0, 0.0});
    o.empty_rows = attend::empty_rows::zero;
    const auto mask = attend::causal(alignment::bottom_right) && attend::key_padding({170, 131});
    const auto call = attend::detail::check_call(qv, kv, vv, s, mask, o);
    tile_config tiles;
    tiles.query_rows = 32;  // 16 queries of 2 heads a block: 10 blocks per (batch, kv head)
    tiles.key_tile = 64;
    std::vector<std::vector<T>> results;
    for (const auto& [shared, threads] : {std::pair{index_t(1), 1}, std::pair{index_t(8), 1}, std::pair{index_t(3), 1},
                                          std::pair{index_t(8), 2}, std::pair{index_t(4), 7}}) {
        tiles.shared_blocks = shared;
        attend::tensor<T, 4> out(B, H, L, D), w(B, H, L, S);
        attend::tensor<float, 3> lse(B, H, L);
        attend::detail::attention_outputs<T> r;
        r.out = attend::detail::as_mutable_view(out);
        r.weights = w.data();
        r.lse = lse.data();
        attend::detail::tiled_attention(qv, kv, vv, s, call.mask, call.params, r, threads, tiles);
        std::vector<T> all(out.data(), out.data() + out.size());
        all.insert(all.end(), w.data(), w.data() + w.size());
        for (index_t n = 0; n < lse.size(); ++n) all.push_back(static_cast<T>(lse.data()[n]));
        results.push_back(std::move(all));
    }
    for (std::size_t n = 1; n < results.size(); ++n)
        EXPECT_EQ(std::memcmp(results[0].data(), results[n].data(), results[0].size() * sizeof(T)), 0) << "run " << n;
}

TEST(TiledKernel, QueryBlocksSharingPackedTilesChangeNoBit) {
    expect_shared_blocks_change_no_bit<float>();
    expect_shared_blocks_change_no_bit<Eigen::bfloat16>();
}

TEST(TiledKernel, WeightsStayInZeroToOneWhereSlabsAndBlocksRoundScoresApart) {
    expect_weights_in_unit_range_at_huge_scores<double>(1e100);
    expect_weights_in_unit_range_at_huge_scores<float>(1e15f);
}

TEST(TiledKernel, DecodePathBitIdenticalForAnyThreadCount) {
    // query_len 3 <= 16 and key_len 5000 > the decode chunk: keys are split into chunks merged in order.
    for (bool small_chunks : {false, true}) {
        const random_call<float> in(11, 1, 8, 2, 3, 5000, 64, 64);
        const auto &qv = in.qv, &kv = in.kv, &vv = in.vv;
        const auto& s = in.s;
        attend::sdpa_options o;
        o.need_lse = true;
        const auto mask = attend::causal(alignment::bottom_right) && attend::key_padding({4321});
        const auto call = attend::detail::check_call(qv, kv, vv, s, mask, o);
        tile_config tiles = attend::detail::default_tile_config<float>(s);
        if (small_chunks) tiles.decode_chunk = 300;
        ASSERT_LE(s.query_len, tiles.decode_queries);
        ASSERT_GT(s.key_len, tiles.decode_chunk);
        std::vector<std::vector<float>> outs, lses;
        for (int threads : {1, 2, 7}) {
            attend::tensor<float, 4> out(1, 8, 3, 64);
            attend::tensor<float, 3> lse(1, 8, 3);
            attend::detail::attention_outputs<float> r;
            r.out = attend::detail::as_mutable_view(out);
            r.lse = lse.data();
            attend::detail::tiled_attention(qv, kv, vv, s, call.mask, call.params, r, threads, tiles);
            outs.emplace_back(out.data(), out.data() + out.size());
            lses.emplace_back(lse.data(), lse.data() + lse.size());
        }
        EXPECT_EQ(outs[0], outs[1]);
        EXPECT_EQ(outs[0], outs[2]);
        EXPECT_EQ(lses[0], lses[1]);
        EXPECT_EQ(lses[0], lses[2]);
        o.kernel = attend::kernel::reference;
        const auto ref = attend::scaled_dot_product_attention(in.q, in.k, in.v, mask, o);
        double diff = 0, lse_diff = 0;
        for (index_t n = 0; n < ref.out.size(); ++n)
            diff =
                std::max(diff, static_cast<double>(std::abs(ref.out.data()[n] - outs[0][static_cast<std::size_t>(n)])));
        for (index_t n = 0; n < ref.lse.size(); ++n)
            lse_diff = std::max(lse_diff, std::abs(static_cast<double>(ref.lse.data()[n]) -
                                                   static_cast<double>(lses[0][static_cast<std::size_t>(n)])) /
                                              std::max(1.0, std::abs(static_cast<double>(ref.lse.data()[n]))));
        EXPECT_LE(diff, 1e-5);
        EXPECT_LE(lse_diff, 1e-5);
    }
}

/// Runs a decode-shaped call with check_finite on (the scan rides on the decode pass, within one chunk too) and off
/// (no scan; a call within one chunk takes the block path) and expects the same bits of out and lse.
template <class T, class Mask>
void expect_check_finite_changes_no_bit(index_t heads, index_t kv_heads, index_t query_len, index_t key_len,
                                        const Mask& mask, const attend::sdpa_options& options) {
    const attend::tensor<T, 4> q = attend_test::random_tensor<float>(31, 2, heads, query_len, 16).cast<T>();
    const attend::tensor<T, 4> k = attend_test::random_tensor<float>(32, 2, kv_heads, key_len, 16).cast<T>();
    const attend::tensor<T, 4> v = attend_test::random_tensor<float>(33, 2, kv_heads, key_len, 12).cast<T>();
    attend::sdpa_options checked = options, unchecked = options;
    checked.check_finite = true;
    unchecked.check_finite = false;
    for (const int threads : {1, 2}) {
        checked.threads = unchecked.threads = threads;
        const auto with_scan = attend::scaled_dot_product_attention(q, k, v, mask, checked);
        const auto without = attend::scaled_dot_product_attention(q, k, v, mask, unchecked);
        EXPECT_TRUE(bit_equal(with_scan.out, without.out)) << threads << " threads";
        EXPECT_TRUE(bit_equal(with_scan.lse, without.lse)) << threads << " threads";
    }
}

TEST(TiledKernel, CheckFiniteChangesNoBitOfADecodeWithinOneChunkOrBeyond) {
    attend::sdpa_options plain, modified;
    plain.kernel = modified.kernel = attend::kernel::tiled;
    plain.empty_rows = modified.empty_rows = attend::empty_rows::zero;  // causal rows before the first key
    modified.softcap = 4.0;
    modified.sinks = attend::attention_sinks({0.5, -1.0, 2.0, 0.0});
    const auto cases = [&](auto scalar) {
        using T = decltype(scalar);
        for (const index_t key_len : {index_t(1), index_t(9), index_t(700), index_t(2048), index_t(2600)})
            for (const index_t query_len : {index_t(1), index_t(3), index_t(16)}) {
                SCOPED_TRACE(std::to_string(query_len) + " queries, " + std::to_string(key_len) + " keys");
                const auto padding = attend::key_padding({key_len, std::max<index_t>(1, key_len / 3)});
                expect_check_finite_changes_no_bit<T>(4, 1, query_len, key_len, attend::no_mask{}, plain);
                expect_check_finite_changes_no_bit<T>(4, 2, query_len, key_len, padding, modified);
                expect_check_finite_changes_no_bit<T>(4, 4, query_len, key_len,
                                                      attend::causal(alignment::bottom_right) && padding, plain);
                expect_check_finite_changes_no_bit<T>(4, 4, query_len, key_len,
                                                      attend::sliding_window(50, 0, alignment::bottom_right), modified);
            }
    };
    cases(float{});
    cases(double{});
    cases(Eigen::bfloat16{});
}

TEST(TiledKernel, AutomaticIsTiled) {
    const auto q = attend_test::random_tensor<double>(21, 2, 3, 70, 16);
    const auto k = attend_test::random_tensor<double>(22, 2, 3, 90, 16);
    const auto v = attend_test::random_tensor<double>(23, 2, 3, 90, 8);
    attend::sdpa_options o;
    o.need_lse = true;
    o.threads = 2;
    const auto automatic = attend::scaled_dot_product_attention(q, k, v, attend::causal(alignment::bottom_right), o);
    o.kernel = attend::kernel::tiled;
    const auto tiled = attend::scaled_dot_product_attention(q, k, v, attend::causal(alignment::bottom_right), o);
    o.kernel = attend::kernel::reference;
    const auto reference = attend::scaled_dot_product_attention(q, k, v, attend::causal(alignment::bottom_right), o);
    EXPECT_TRUE(bit_equal(automatic.out, tiled.out));
    EXPECT_TRUE(bit_equal(automatic.lse, tiled.lse));
    double diff = 0;
    for (index_t n = 0; n < reference.out.size(); ++n)
        diff = std::max(diff, std::abs(reference.out.data()[n] - tiled.out.data()[n]));
    EXPECT_LE(diff, 1e-12);
}

TEST(TiledKernel, ThreadsOption) {
    const auto q = attend_test::random_tensor<float>(31, 1, 2, 9, 8);
    attend::sdpa_options o;
    o.threads = -1;
    try {
        (void)attend::scaled_dot_product_attention(q, q, q, o);
        FAIL() << "threads -1 accepted";
    } catch (const attend::value_error& e) {
        EXPECT_EQ(e.id(), "attend.value.threads");
    }
    o.threads = 0;  // hardware concurrency
    const auto r = attend::scaled_dot_product_attention(q, q, q, o);
    EXPECT_EQ(r.out.dimension(2), 9);
    EXPECT_GE(attend::detail::resolve_threads(0), 1);
    EXPECT_EQ(attend::detail::resolve_threads(3), 3);
}

TEST(TiledKernel, ScratchKeptFromEarlierCallsChangesNoBit) {
    // The calling thread keeps its freed scratch blocks for the next call of the same shape (scratch_blocks): a
    // call whose scratch held another call's scores and panels gives the bits of a call on fresh scratch, and the
    // kept blocks are reused, not added to.
    using attend::detail::scratch_blocks;
    const auto inputs = [](std::uint64_t seed) {
        return std::array<attend::tensor<float, 4>, 3>{attend_test::random_tensor<float>(seed, 1, 4, 300, 64),
                                                       attend_test::random_tensor<float>(seed + 1, 1, 2, 300, 64),
                                                       attend_test::random_tensor<float>(seed + 2, 1, 2, 300, 64)};
    };
    const auto a = inputs(71), b = inputs(81);
    for (const int threads : {1, 2}) {
        attend::sdpa_options o;
        o.kernel = attend::kernel::tiled;
        o.threads = threads;
        const auto run = [&](const std::array<attend::tensor<float, 4>, 3>& x) {
            return attend::scaled_dot_product_attention(x[0], x[1], x[2], attend::causal(alignment::top_left), o);
        };
        const auto first = run(a);
        const scratch_blocks* kept = scratch_blocks::of_this_thread();
        ASSERT_NE(kept, nullptr);
        const std::size_t blocks = kept->block_count(), bytes = kept->held_bytes();
        EXPECT_GT(bytes, 0u);
        (void)run(b);  // the same shape: every block reused, other values left in them
        const auto again = run(a);
        EXPECT_EQ(kept->block_count(), blocks);
        EXPECT_EQ(kept->held_bytes(), bytes);
        EXPECT_TRUE(bit_equal(first.out, again.out));
        EXPECT_TRUE(bit_equal(first.lse, again.lse));
    }
}

/// q [1, 4, L, 64] of T over k and v [1, 2, S, 64]: causal (bottom right) or not, on `threads` threads.
template <class T>
void expect_sdpa_scratch_full_of_nan_changes_no_bit(index_t L, index_t S, bool causal, int threads) {
    const attend::tensor<T, 4> q = attend_test::random_tensor<float>(51, 1, 4, L, 64).cast<T>();
    const attend::tensor<T, 4> k = attend_test::random_tensor<float>(52, 1, 2, S, 64).cast<T>();
    const attend::tensor<T, 4> v = attend_test::random_tensor<float>(53, 1, 2, S, 64).cast<T>();
    attend::sdpa_options o;
    o.kernel = attend::kernel::tiled;
    o.threads = threads;
    attend_test::expect_scratch_full_of_nan_changes_no_bit(
        [&] {
            return causal ? attend::scaled_dot_product_attention(q, k, v, attend::causal(alignment::bottom_right), o)
                          : attend::scaled_dot_product_attention(q, k, v, o);
        },
        attend_test::describe("L ", L, ", S ", S, causal ? ", causal" : "", ", ", sizeof(T), "-byte storage"));
}

TEST(TiledKernel, ScratchFullOfNanChangesNoBit) {
    // Partial panels and blocks, causal slabs, the decode path's chunks, staged fp16 rows, bf16, double.
    expect_sdpa_scratch_full_of_nan_changes_no_bit<float>(300, 300, false, 2);
    expect_sdpa_scratch_full_of_nan_changes_no_bit<float>(300, 300, true, 1);
    expect_sdpa_scratch_full_of_nan_changes_no_bit<float>(1, 3000, false, 2);
    expect_sdpa_scratch_full_of_nan_changes_no_bit<Eigen::half>(200, 200, true, 1);
    expect_sdpa_scratch_full_of_nan_changes_no_bit<Eigen::bfloat16>(200, 260, false, 2);
    expect_sdpa_scratch_full_of_nan_changes_no_bit<double>(130, 300, false, 1);
    // An int8 cache (its rows widened into the stage) and a paged cache whose sequence's blocks alternate with
    // another's (slices that cross a block edge are copied into the stage).
    attend::q8_kv_cache q8(attend::kv_cache_config{}.with_kv_heads(2).with_capacity(700).with_head_dim(64));
    q8.append(attend_test::random_tensor<float>(54, 1, 2, 700, 64),
              attend_test::random_tensor<float>(55, 1, 2, 700, 64));
    attend::paged_kv_cache<float> paged(attend_test::paged_config(2, 64, 48, 40, 2));
    const index_t id = paged.add_sequence(), other = paged.add_sequence();
    for (index_t at = 0; at < 700; at += 48) {
        const index_t n = std::min<index_t>(48, 700 - at);
        const attend::tensor<float, 4> kn =
            attend_test::random_tensor<float>(56 + static_cast<std::uint64_t>(at), 1, 2, n, 64);
        const attend::tensor<float, 4> vn =
            attend_test::random_tensor<float>(57 + static_cast<std::uint64_t>(at), 1, 2, n, 64);
        paged.append(id, kn, vn);
        paged.append(other, kn, vn);
    }
    for (const index_t L : {index_t(1), index_t(40)}) {
        const attend::tensor<float, 4> q = attend_test::random_tensor<float>(58, 1, 4, L, 64);
        attend::sdpa_options o;
        o.threads = 2;
        attend_test::expect_scratch_full_of_nan_changes_no_bit(
            [&] {
                return attend::scaled_dot_product_attention(q, q8.keys(), q8.values(),
                                                            attend::causal(alignment::bottom_right), o);
            },
            attend_test::describe("q8_0 cache, L ", L));
        attend_test::expect_scratch_full_of_nan_changes_no_bit(
            [&] { return attend::paged_attention(q, paged, {id}, {L}, o); },
            attend_test::describe("paged cache, L ", L));
    }
}

TEST(TiledKernel, KeptScratchStaysWithinItsLimits) {
    using attend::detail::scratch_blocks;
    for (index_t len = 40; len <= 1400; len += 97) {  // many shapes: many sizes of blocks
        const auto q = attend_test::random_tensor<float>(5, 1, 2, len, 64);
        const auto k = attend_test::random_tensor<float>(6, 1, 2, len, 64);
        attend::sdpa_options o;
        o.kernel = attend::kernel::tiled;
        o.threads = 2;
        (void)attend::scaled_dot_product_attention(q, k, k, o);
        const scratch_blocks* kept = scratch_blocks::of_this_thread();
        ASSERT_NE(kept, nullptr);
        EXPECT_LE(kept->block_count(), scratch_blocks::max_blocks);
        EXPECT_LE(kept->held_bytes(), scratch_blocks::max_bytes);
    }
    // release_scratch frees them at once.
    const std::size_t held = attend::detail::scratch_blocks::of_this_thread()->held_bytes();
    EXPECT_GT(held, 0u);
    EXPECT_EQ(attend::release_scratch(), held);
    EXPECT_EQ(attend::detail::scratch_blocks::of_this_thread()->held_bytes(), 0u);
    EXPECT_EQ(attend::detail::scratch_blocks::of_this_thread()->block_count(), 0u);
    // A thread that calls and exits gives its blocks back (a leak checker sees any that stay).
    std::thread([] {
        const auto q = attend_test::random_tensor<float>(7, 1, 1, 100, 32);
        (void)attend::scaled_dot_product_attention(q, q, q);
        EXPECT_GT(scratch_blocks::of_this_thread()->held_bytes(), 0u);
    }).join();
}

TEST(TiledKernel, ParallelForRunsEveryUnitOnceAndRethrows) {
    for (int threads : {1, 2, 7}) {
        std::vector<int> hits(23, 0);
        attend::detail::parallel_for(23, threads, [&](index_t unit, int) { ++hits[static_cast<std::size_t>(unit)]; });
        EXPECT_EQ(std::count(hits.begin(), hits.end(), 1), 23);
    }
    EXPECT_THROW(attend::detail::parallel_for(10, 3,
                                              [](index_t unit, int) {
                                                  if (unit == 4) throw std::runtime_error("unit 4");
                                              }),
                 std::runtime_error);
}

TEST(TiledKernel, MergeRowIsMergePartialsFormula) {
    const float a[2] = {1.0f, -2.0f}, b[2] = {3.0f, 0.5f};
    float out[2];
    const float lse = attend::detail::merge_row(a, 0.5f, b, -1.0f, out, 2);
    const float wa = std::exp(0.0f), wb = std::exp(-1.5f);
    EXPECT_FLOAT_EQ(out[0], (wa * 1.0f + wb * 3.0f) / (wa + wb));
    EXPECT_FLOAT_EQ(lse, 0.5f + std::log(wa + wb));
    const float inf = std::numeric_limits<float>::infinity();
    EXPECT_EQ(attend::detail::merge_row(a, -inf, b, -inf, out, 2), -inf);
    EXPECT_EQ(out[0], 0.0f);
}

}  // namespace
