// SPDX-License-Identifier: MIT
#pragma once
/// A mask given as a function (PyTorch FlexAttention's mask_mod): allowed(batch, head, query, key) -> bool, true
/// = may attend (the allowed_mask convention), for rules the built-in ones do not express (document ids, a
/// dilated window, a pattern of global tokens). It joins the mask algebra like any rule (`causal(a) &&
/// mask_mod(f)`), the kernels call it inline on the tiles they must test, and an optional block rule classifies
/// whole tiles so the kernels can skip or take them without testing each position, as they do for the built-in
/// rules.

#include <type_traits>
#include <utility>

#include "mask.hpp"

namespace attend {

/// No block rule: every tile is tested position by position.
struct every_tile_mixed {
    tile_class operator()(const tile&) const { return tile_class::mixed; }  ///< mixed, whatever the tile
};

namespace detail {

/// A mask function and its block rule, bound to a call (nothing to resolve: both see absolute positions).
template <class Allowed, class Block>
struct bound_mask_function {
    Allowed allowed_fn;
    Block block;

    bool allowed(index_t b, index_t h, index_t i, index_t j) const {
        return static_cast<bool>(allowed_fn(static_cast<mod_index>(b), static_cast<mod_index>(h),
                                            static_cast<mod_index>(i), static_cast<mod_index>(j)));
    }
    bool query_padded(index_t, index_t) const { return false; }
    tile_class classify(const tile& t) const { return block(t); }
    template <class T>
    void apply(const tile& t, T* scores, index_t ld) const {
        apply_by_position(*this, t, scores, ld);
    }
};

}  // namespace detail

/// The rule of mask_mod: `allowed(b, h, i, j)` for query i and key j of head h of batch entry b, and `block(t)`,
/// a tile_class for the tile t of one (batch, head). The block rule must never contradict the function: empty
/// only if it allows nothing in the tile, full only if it allows everything (mixed is always right). The
/// function must be pure (the kernels call it from several threads, on some positions more than once).
template <class Allowed, class Block = every_tile_mixed>
struct mask_function_rule : detail::boolean_term {
    static constexpr bool has_query_padding = false;
    Allowed allowed;  ///< (batch, head, query, key) -> bool, true = may attend
    Block block;      ///< tile -> tile_class, exact for empty and full

    /// Throws shape_error attend.shape.mod_positions when the call's positions do not fit mod_index.
    detail::bound_mask_function<Allowed, Block> bind(const attention_shape& s) const {
        detail::check_mod_positions(s, "mask_mod");
        return {allowed, block};
    }
};

/// A mask from a function `allowed(batch, head, query, key) -> bool` (true = may attend; the indices are
/// mod_index, int32, as score_mod's) and optionally a block
/// rule `block(const attend::tile&) -> tile_class` that lets the kernels skip tiles the function allows nothing
/// in, and take tiles it allows everything in untested; without one every tile is tested.
template <class Allowed, class Block = every_tile_mixed>
mask_function_rule<std::decay_t<Allowed>, std::decay_t<Block>> mask_mod(Allowed&& allowed, Block&& block = {}) {
    static_assert(std::is_invocable_r_v<bool, const std::decay_t<Allowed>&, mod_index, mod_index, mod_index, mod_index>,
                  "attend: mask_mod takes a function (batch, head, query, key) -> bool, true = may attend");
    static_assert(std::is_invocable_r_v<tile_class, const std::decay_t<Block>&, const tile&>,
                  "attend: a mask_mod block rule is a function (const attend::tile&) -> attend::tile_class");
    return {{}, std::forward<Allowed>(allowed), std::forward<Block>(block)};
}

}  // namespace attend
