// SPDX-License-Identifier: MIT
#pragma once
/// A user's score modifier (PyTorch FlexAttention's score_mod): score -> f(score, batch, head, query, key) on every
/// score the kernels compute, after the scale and soft-capping and before score_bias and the mask. For the
/// backward the modifier also needs its derivative d f / d score; a backward call whose score_mod has none throws
/// value_error attend.value.score_mod_derivative before computing anything.
///
/// The kernels are compiled once per scalar type, so they reach the function through one virtual call per tile;
/// inside it the function is inlined on the tile's scores, as a mask function is (mask_function.hpp).

#include <cstdint>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>

#include "detail/mask_nodes.hpp"
#include "error.hpp"
#include "shape.hpp"
#include "tensor.hpp"

namespace attend {

namespace detail {

/// The kernels' view of a score modifier: f on a tile of scores `[rows, cols]` (row stride ld) of tile t, in place,
/// and, when `slope` is not null (same layout), slope *= d f / d score at the scores f was given.
class score_tiles {
public:
    virtual ~score_tiles() = default;
    virtual void apply(const tile& t, float* scores, index_t ld, float* slope) const = 0;
    virtual void apply(const tile& t, double* scores, index_t ld, double* slope) const = 0;
    virtual bool has_derivative() const = 0;
};

/// No derivative given: the backward refuses the call (score_tiles::has_derivative is false).
struct no_score_derivative {};

template <class F, class DF>
class score_function_tiles final : public score_tiles {
public:
    score_function_tiles(F f, DF df) : f_(std::move(f)), df_(std::move(df)) {}
    void apply(const tile& t, float* scores, index_t ld, float* slope) const override { run(t, scores, ld, slope); }
    void apply(const tile& t, double* scores, index_t ld, double* slope) const override { run(t, scores, ld, slope); }
    bool has_derivative() const override { return !std::is_same_v<DF, no_score_derivative>; }

private:
    template <class T>
    void run(const tile& t, T* scores, index_t ld, T* slope) const {
        const auto rows = static_cast<mod_index>(t.query_end - t.query_begin);
        const auto cols = static_cast<mod_index>(t.key_end - t.key_begin);
        const auto b = static_cast<mod_index>(t.batch), h = static_cast<mod_index>(t.head);
        const auto j0 = static_cast<mod_index>(t.key_begin);
        for (mod_index r = 0; r < rows; ++r) {
            T* s = scores + r * ld;
            const auto i = static_cast<mod_index>(t.query_begin + r);
            if constexpr (!std::is_same_v<DF, no_score_derivative>)
                if (slope)
                    for (mod_index c = 0; c < cols; ++c)
                        slope[r * ld + c] *= static_cast<T>(df_(s[c], b, h, i, j0 + c));
            for (mod_index c = 0; c < cols; ++c) s[c] = static_cast<T>(f_(s[c], b, h, i, j0 + c));
        }
    }

    F f_;
    DF df_;
};

/// Another modifier seen from a block of a longer call: the block's query i and key j are query_begin + i and
/// key_begin + j of the whole call (ring attention).
class shifted_score_tiles final : public score_tiles {
public:
    shifted_score_tiles(std::shared_ptr<const score_tiles> whole, index_t query_begin, index_t key_begin)
        : whole_(std::move(whole)), query_begin_(query_begin), key_begin_(key_begin) {}
    void apply(const tile& t, float* scores, index_t ld, float* slope) const override {
        whole_->apply(shifted(t), scores, ld, slope);
    }
    void apply(const tile& t, double* scores, index_t ld, double* slope) const override {
        whole_->apply(shifted(t), scores, ld, slope);
    }
    bool has_derivative() const override { return whole_->has_derivative(); }

private:
    tile shifted(tile t) const {
        t.query_begin += query_begin_;
        t.query_end += query_begin_;
        t.key_begin += key_begin_;
        t.key_end += key_begin_;
        return t;
    }

    std::shared_ptr<const score_tiles> whole_;
    index_t query_begin_, key_begin_;
};

/// F is callable as f(score, batch, head, query, key) with a result convertible to the score's type T.
template <class F, class T>
constexpr bool is_score_function_v = std::is_invocable_r_v<T, const F&, T, mod_index, mod_index, mod_index, mod_index>;

}  // namespace detail

/// A score modifier for sdpa_options::score_mod (and mha_options::attention); empty: none. Build one with
/// attend::score_mod. Copies are cheap (the function is shared).
class score_function {
public:
    /// No modifier; empty() is true and the kernels skip it.
    score_function() = default;
    /// From the kernels' interface; attend::score_mod builds it.
    explicit score_function(std::shared_ptr<const detail::score_tiles> tiles) : tiles_(std::move(tiles)) {}

    bool empty() const { return tiles_ == nullptr; }                            ///< no modifier
    bool has_derivative() const { return tiles_ && tiles_->has_derivative(); }  ///< the backward can use it
    const detail::score_tiles* tiles() const { return tiles_.get(); }           ///< what the kernels call

    /// The modifier of a block of a longer call (ring attention): the block's query 0 and key 0 are query_begin and
    /// key_begin of the whole call, which f sees. Validate against the whole call's shape.
    score_function block_of(index_t query_begin, index_t key_begin) const {
        if (empty()) return {};
        return score_function(std::make_shared<detail::shifted_score_tiles>(tiles_, query_begin, key_begin));
    }

    /// A call of shape s can pass its positions as mod_index. Throws shape_error attend.shape.mod_positions for a
    /// batch, heads, query_len or key_len beyond its range.
    void validate(const attention_shape& s) const {
        if (!empty()) detail::check_mod_positions(s, "score_mod");
    }

private:
    std::shared_ptr<const detail::score_tiles> tiles_;
};

namespace detail {

/// A score_function of f and its derivative df (no_score_derivative: none), once f is checked.
template <class F, class DF>
score_function make_score_function(F f, DF df) {
    static_assert(is_score_function_v<F, float> && is_score_function_v<F, double>,
                  "attend: score_mod takes a function (score, batch, head, query, key) -> score for float and double "
                  "scores, e.g. [](auto s, auto b, auto h, auto i, auto j), the indices being attend::mod_index");
    return score_function(std::make_shared<score_function_tiles<F, DF>>(std::move(f), std::move(df)));
}

}  // namespace detail

/// A forward-only score modifier `f(score, batch, head, query, key) -> score`, for float and double scores (a
/// generic lambda, `[](auto s, auto b, auto h, auto i, auto j) { ... }`, serves both); the indices are
/// mod_index (int32). It must be pure: the kernels call it from several threads, on some scores more than once.
template <class F>
score_function score_mod(F f) {
    return detail::make_score_function(std::move(f), detail::no_score_derivative{});
}

/// A score modifier with its derivative `df(score, batch, head, query, key) -> d f / d score` (at the score f is
/// given), which the backward multiplies into the gradient of the scores.
template <class F, class DF>
score_function score_mod(F f, DF derivative) {
    static_assert(detail::is_score_function_v<DF, float> && detail::is_score_function_v<DF, double>,
                  "attend: a score_mod derivative is a function (score, batch, head, query, key) -> d f / d score for "
                  "float and double scores");
    return detail::make_score_function(std::move(f), std::move(derivative));
}

}  // namespace attend
