// SPDX-License-Identifier: MIT
#pragma once
/// Mask expressions decoded from fuzz input at run time, each paired with its meaning.
///
/// attend's mask expressions are types (mask_and<causal_rule, allowed_mask>, ...), so a fuzzer that wants a new
/// expression per input cannot spell them all. Instead a runtime_mask is a mask term whose bind() returns an
/// any_bound (an owning type-erased bound node), and the fuzzer combines runtime masks with attend's own
/// operators: `a && b` is attend::mask_and<runtime_allowed, runtime_allowed>, whose bind builds the library's
/// bound_intersection over the two bound operands. Leaves are built with the public constructors (causal,
/// sliding_window, allowed_mask::true_means_allowed, ...), so everything but the type erasure is library code.
///
/// Every expression also carries its meaning, computed from the rules' definitions in mask.hpp's comments and
/// DESIGN.md without any of mask_nodes.hpp: the value added to score (b, h, i, j) (-inf = forbidden) and whether
/// query i of batch b is padding. The fuzzers check the library against it.

#include <array>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <attend/mask.hpp>
#include <attend/mask_function.hpp>

#include "fuzz_input.hpp"
#include "support/dense_masks.hpp"

namespace attend_fuzz {

using attend::attention_shape;
using attend::tile;
// The algebra's operators live in attend; runtime masks are found there only by their base class's namespace.
using attend::operator&&;
using attend::operator||;
using attend::operator!;
using attend::operator+;
using attend::tile_class;

/// A bound mask of any type that owns its bound node (detail::erased_mask only refers to one).
class any_bound {
public:
    template <class Bound>
    static any_bound of(Bound bound) {
        struct owned {
            Bound node;
            attend::detail::erased_mask<Bound> tiles;
            explicit owned(Bound b) : node(std::move(b)), tiles(node) {}
        };
        auto held = std::make_shared<const owned>(std::move(bound));
        any_bound a;
        a.tiles_ = &held->tiles;
        a.owner_ = std::move(held);
        return a;
    }

    tile_class classify(const tile& t) const { return tiles_->classify(t); }
    template <class T>
    void apply(const tile& t, T* scores, index_t ld) const {
        tiles_->apply(t, scores, ld);
    }
    bool allowed(index_t b, index_t h, index_t i, index_t j) const { return tiles_->allowed(b, h, i, j); }
    bool query_padded(index_t b, index_t i) const { return tiles_->query_padded(b, i); }

private:
    std::shared_ptr<const void> owner_;
    const attend::detail::mask_tiles* tiles_ = nullptr;
};

/// What a mask means for one call shape: the value added to score (b, h, i, j), -inf where forbidden (0 at
/// allowed positions of Boolean terms), and whether query i of batch b is padding.
struct meaning {
    std::function<long double(index_t, index_t, index_t, index_t)> added;
    std::function<bool(index_t, index_t)> padded;
    /// The largest finite magnitude among the additive terms summed into added(b, h, i, j) and their partial sums;
    /// null for a single term (then |added|). The library adds the terms to the score one by one, each sum
    /// saturating at the scalar's range (mask_nodes.hpp), so terms near that range make the exact sum the wrong
    /// model.
    std::function<long double(index_t, index_t, index_t, index_t)> largest_term;

    bool allowed(index_t b, index_t h, index_t i, index_t j) const { return added(b, h, i, j) != minus_inf(); }
    long double largest(index_t b, index_t h, index_t i, index_t j) const {
        if (largest_term) return largest_term(b, h, i, j);
        const long double a = added(b, h, i, j);
        return a == minus_inf() ? 0.0L : std::abs(a);
    }
    static long double minus_inf() { return -std::numeric_limits<long double>::infinity(); }
};

/// One node of a runtime expression: how the library binds it, and what it means.
struct expression {
    std::function<any_bound(const attention_shape&)> bind;
    std::function<meaning(const attention_shape&)> mean;  ///< only for shapes bind accepted
    std::string text;                                     ///< for failure reports
    bool query_padding = false;  ///< the has_query_padding the library's static type would have
};

/// A mask term of the library's algebra whose structure is decided at run time. Term is boolean_term (an
/// allowed set, combines with && || !) or additive_term (combines with +).
template <class Term>
struct runtime_mask : Term {
    /// The static flag only gates `!query_padding(...)` at compile time; the generator keeps that rule itself.
    static constexpr bool has_query_padding = false;
    std::shared_ptr<const expression> node;

    any_bound bind(const attention_shape& s) const { return node->bind(s); }
};
using runtime_allowed = runtime_mask<attend::detail::boolean_term>;
using runtime_additive = runtime_mask<attend::detail::additive_term>;

template <class Mask>
Mask wrap(std::function<any_bound(const attention_shape&)> bind, std::function<meaning(const attention_shape&)> mean,
          std::string text, bool query_padding) {
    Mask m;
    m.node = std::make_shared<const expression>(
        expression{std::move(bind), std::move(mean), std::move(text), query_padding});
    return m;
}

/// A leaf: a public mask object of the library and its meaning.
template <class Mask, class Rule>
Mask leaf(const Rule& rule, std::function<meaning(const attention_shape&)> mean, std::string text,
          bool query_padding = false) {
    return wrap<Mask>([rule](const attention_shape& s) { return any_bound::of(rule.bind(s)); }, std::move(mean),
                      std::move(text), query_padding);
}

/// A combination built with the library's operator (&&, ||, ! or +) on runtime masks.
template <class Mask, class Combined>
Mask combined(const Combined& expr, std::function<meaning(const attention_shape&)> mean, std::string text,
              bool query_padding) {
    return wrap<Mask>([expr](const attention_shape& s) { return any_bound::of(expr.bind(s)); }, std::move(mean),
                      std::move(text), query_padding);
}

inline meaning boolean_meaning(
    std::function<bool(index_t, index_t, index_t, index_t)> allowed,
    std::function<bool(index_t, index_t)> padded = [](index_t, index_t) { return false; }) {
    return {[allowed](index_t b, index_t h, index_t i, index_t j) {
                return allowed(b, h, i, j) ? 0.0L : meaning::minus_inf();
            },
            std::move(padded), nullptr};
}

/// i' of the rules: the query's position on the key axis (bottom_right puts the last query at the last key).
inline long double aligned(attend::alignment a, const attention_shape& s, index_t i) {
    return static_cast<long double>(i) + (a == attend::alignment::bottom_right ? s.key_len - s.query_len : 0);
}

/// The flat position in a dense mask of dims `dims` (aligned from the right against the call's score axes, size-1
/// axes broadcast) that score (b, h, i, j) reads.
inline std::size_t dense_position(const std::vector<index_t>& dims, const attention_shape& s, index_t b, index_t h,
                                  index_t i, index_t j) {
    const std::array<index_t, 4> coordinate = s.rank == 4 ? std::array<index_t, 4>{b, h, i, j}
                                                          : std::array<index_t, 4>{b, i, j, 0};
    const std::size_t skip = static_cast<std::size_t>(s.rank) - dims.size();
    std::size_t flat = 0;
    for (std::size_t a = 0; a < dims.size(); ++a)
        flat = flat * static_cast<std::size_t>(dims[a]) +
               static_cast<std::size_t>(dims[a] == 1 ? 0 : coordinate[skip + a]);
    return flat;
}

/// Generates mask expressions from fuzz input for scores of `intended` shape: mostly valid for it, sometimes not
/// (wrong lengths, shapes that do not broadcast, negative sizes), so both the happy path and every mask error path
/// are exercised.
class mask_generator {
public:
    mask_generator(fuzz_input& in, const attention_shape& intended, int max_depth)
        : in_(in), s_(intended), values_(in.word()), max_depth_(max_depth) {}

    runtime_allowed allowed(int depth = 0) {
        const int kind = in_.choose(depth < max_depth_ ? 14 : 10);
        switch (kind) {
            case 0: return causal_leaf();
            case 1: return window_leaf();
            case 2: return prefix_leaf();
            case 3: return key_padding_leaf();
            case 4: return query_padding_leaf();
            case 5: return block_diagonal_leaf();
            case 6: return dense_boolean_leaf();
            case 7: return mask_function_leaf();
            case 8:
                return leaf<runtime_allowed>(
                    attend::no_mask{}, [](const attention_shape&) { return boolean_meaning(everything); }, "no_mask");
            case 9: return packed_segments_leaf();
            case 10: return both(allowed(depth + 1), allowed(depth + 1));
            case 11: return either(allowed(depth + 1), allowed(depth + 1));
            default: {
                runtime_allowed a = allowed(depth + 1);
                // `!query_padding(...)` does not compile in the library; a legal program never negates one.
                if (a.node->query_padding) return a;
                return complement(a);
            }
        }
    }

    runtime_additive additive(int depth = 0) {
        const int kind = in_.choose(depth < max_depth_ ? 6 : 2);
        switch (kind) {
            case 0: return in_.chance(128) ? dense_additive_leaf<float>() : dense_additive_leaf<double>();
            case 1: return dense_additive_leaf<double>();
            case 2: return sum(additive(depth + 1), additive(depth + 1));
            case 3: return sum(additive(depth + 1), allowed(depth + 1));
            case 4: return sum(allowed(depth + 1), additive(depth + 1));
            default: return sum(additive(depth + 1), additive(depth + 1));
        }
    }

private:
    static bool everything(index_t, index_t, index_t, index_t) { return true; }

    attend::alignment alignment() {
        return in_.chance(128) ? attend::alignment::top_left : attend::alignment::bottom_right;
    }
    static const char* spell(attend::alignment a) {
        return a == attend::alignment::top_left ? "top_left" : "bottom_right";
    }

    /// A size near [0, limit]: mostly inside, sometimes just past either end or far beyond.
    index_t size_near(index_t limit) {
        switch (in_.choose(16)) {
            case 0: return -1;
            case 1: return limit + 1;
            case 2: return index_t{1} << in_.in_range(20, 62);
            default: return in_.in_range(0, std::min<index_t>(limit, 60000));
        }
    }

    /// One length per batch entry in [0, limit] (sometimes one too many or too few, or out of range).
    std::vector<index_t> lengths(index_t limit) {
        index_t count = s_.batch;
        if (in_.chance(8)) count = count + (in_.chance(128) || count == 0 ? 1 : -1);
        std::vector<index_t> out;
        for (index_t b = 0; b < count; ++b) out.push_back(in_.chance(16) ? size_near(limit) : in_.in_range(0, limit));
        return out;
    }

    runtime_allowed causal_leaf() {
        const attend::alignment a = alignment();
        return leaf<runtime_allowed>(
            attend::causal(a),
            [a](const attention_shape& s) {
                return boolean_meaning(
                    [a, s](index_t, index_t, index_t i, index_t j) { return j <= aligned(a, s, i); });
            },
            std::string("causal(") + spell(a) + ")");
    }

    runtime_allowed window_leaf() {
        const index_t left = size_near(s_.query_len + s_.key_len), right = size_near(s_.query_len + s_.key_len);
        const attend::alignment a = alignment();
        const auto rule = attend::sliding_window(left, right, a);  // throws attend.mask.window for negative sizes
        return leaf<runtime_allowed>(
            rule,
            [=](const attention_shape& s) {
                return boolean_meaning([=](index_t, index_t, index_t i, index_t j) {
                    const long double at = aligned(a, s, i), key = static_cast<long double>(j);
                    return at - static_cast<long double>(left) <= key && key <= at + static_cast<long double>(right);
                });
            },
            "sliding_window(" + std::to_string(left) + ", " + std::to_string(right) + ", " + spell(a) + ")");
    }

    /// mask_mod: a top-left band with its exact block rule, or a modular pattern with no block rule.
    runtime_allowed mask_function_leaf() {
        if (in_.chance(128)) {
            const index_t left = in_.in_range(0, 40), right = in_.in_range(0, 40);
            const auto band = [left, right](index_t, index_t, index_t i, index_t j) {
                return j >= i - left && j <= i + right;
            };
            const auto blocks = [left, right](const attend::tile& t) {
                // Row i sees [i - left, i + right]: the first row has the lowest bounds, the last the highest.
                if (t.key_begin > t.query_end - 1 + right || t.key_end - 1 < t.query_begin - left)
                    return attend::tile_class::empty;
                if (t.key_begin >= t.query_end - 1 - left && t.key_end - 1 <= t.query_begin + right)
                    return attend::tile_class::full;
                return attend::tile_class::mixed;
            };
            return leaf<runtime_allowed>(
                attend::mask_mod(band, blocks),
                [=](const attention_shape&) {
                    return boolean_meaning([=](index_t, index_t, index_t i, index_t j) {
                        const long double key = static_cast<long double>(j), at = static_cast<long double>(i);
                        return at - static_cast<long double>(left) <= key &&
                               key <= at + static_cast<long double>(right);
                    });
                },
                "mask_mod(band " + std::to_string(left) + ", " + std::to_string(right) + ", exact blocks)");
        }
        const index_t a = in_.in_range(0, 3), m = in_.in_range(2, 5);
        return leaf<runtime_allowed>(
            attend::mask_mod([a, m](index_t, index_t h, index_t i, index_t j) { return (a * i + j + h) % m != 0; }),
            [=](const attention_shape&) {
                return boolean_meaning(
                    [=](index_t, index_t h, index_t i, index_t j) { return (a * i + j + h) % m != 0; });
            },
            "mask_mod((" + std::to_string(a) + " i + j + h) % " + std::to_string(m) + " != 0)");
    }

    runtime_allowed prefix_leaf() {
        const index_t prefix = size_near(s_.key_len);
        const attend::alignment a = alignment();
        const auto rule = attend::prefix_lm(prefix, a);
        return leaf<runtime_allowed>(
            rule,
            [=](const attention_shape& s) {
                return boolean_meaning([=](index_t, index_t, index_t i, index_t j) {
                    return j < prefix || static_cast<long double>(j) <= aligned(a, s, i);
                });
            },
            "prefix_lm(" + std::to_string(prefix) + ", " + spell(a) + ")");
    }

    runtime_allowed key_padding_leaf() {
        const std::vector<index_t> n = lengths(s_.key_len);
        return leaf<runtime_allowed>(
            attend::key_padding(n),
            [n](const attention_shape&) {
                return boolean_meaning(
                    [n](index_t b, index_t, index_t, index_t j) { return j < n[static_cast<std::size_t>(b)]; });
            },
            "key_padding");
    }

    runtime_allowed query_padding_leaf() {
        const std::vector<index_t> n = lengths(s_.query_len);
        const auto padded = [n](index_t b, index_t i) { return i >= n[static_cast<std::size_t>(b)]; };
        return leaf<runtime_allowed>(
            attend::query_padding(n),
            [=](const attention_shape&) {
                return boolean_meaning([=](index_t b, index_t, index_t i, index_t) { return !padded(b, i); }, padded);
            },
            "query_padding", true);
    }

    runtime_allowed block_diagonal_leaf() {
        std::vector<index_t> sequences;
        index_t total = 0;
        const index_t target = s_.query_len;
        while (total < target && sequences.size() < 64) {
            const index_t n = in_.chance(24) ? 0 : in_.in_range(1, target - total);
            sequences.push_back(n);
            total += n;
        }
        if (in_.chance(16)) sequences.push_back(in_.chance(128) ? 0 : (in_.chance(128) ? 1 : -1));
        std::vector<index_t> starts{0};
        for (index_t n : sequences) starts.push_back(starts.back() + n);
        // The sequence of position p: the one whose [start, start + n) holds p (empty sequences hold nothing).
        const auto sequence_of = [starts](index_t p) {
            for (std::size_t n = 0; n + 1 < starts.size(); ++n)
                if (starts[n] <= p && p < starts[n + 1]) return static_cast<index_t>(n);
            return index_t{-1};
        };
        return leaf<runtime_allowed>(
            attend::block_diagonal(attend::segment_lengths(sequences)),
            [sequence_of](const attention_shape&) {
                return boolean_meaning(
                    [sequence_of](index_t, index_t, index_t i, index_t j) { return sequence_of(i) == sequence_of(j); });
            },
            "block_diagonal");
    }

    /// Slots along both axes with real lengths (sometimes past a slot, sometimes offsets that decrease or overrun
    /// the axis), no band, causal or a window aligned in either corner of each segment.
    runtime_allowed packed_segments_leaf() {
        const index_t segments = in_.in_range(1, 6);
        std::vector<index_t> qo{0}, ko{0}, ql, kl;
        for (index_t n = 0; n < segments; ++n) {
            const index_t q_slot = in_.in_range(0, std::max<index_t>(1, s_.query_len / segments));
            const index_t k_slot = in_.in_range(0, std::max<index_t>(1, s_.key_len / segments));
            qo.push_back(qo.back() + q_slot);
            ko.push_back(ko.back() + k_slot);
            ql.push_back(in_.chance(16) ? q_slot + 1 : in_.in_range(0, q_slot));
            kl.push_back(in_.chance(16) ? -1 : in_.in_range(0, k_slot));
        }
        if (in_.chance(16)) ko.back() = s_.key_len + 1;
        if (in_.chance(16) && qo.size() > 2) std::swap(qo[1], qo[2]);
        const int band = in_.choose(4);  // none, causal, window, window with the right side open
        const attend::alignment a = in_.chance(128) ? attend::alignment::top_left : attend::alignment::bottom_right;
        const index_t left = in_.in_range(0, 4), right = in_.in_range(0, 3);
        auto rule =
            attend::packed_segments(attend::segment_offsets(qo), attend::segment_offsets(ko)).with_lengths(ql, kl);
        if (band == 1) rule = rule.causal(a);
        if (band >= 2) rule = rule.window(left, right, a);
        // Query i's segment n: qo[n] <= i < qo[n] + ql[n]; it sees keys ko[n] + j' with j' < kl[n] in its band.
        const auto segment_of = [=](index_t i) {
            for (std::size_t n = 0; n < ql.size(); ++n)
                if (qo[n] <= i && i < qo[n] + ql[n]) return static_cast<index_t>(n);
            return index_t{-1};
        };
        const auto padded = [=](index_t, index_t i) { return segment_of(i) < 0; };
        return leaf<runtime_allowed>(
            rule,
            [=](const attention_shape&) {
                return boolean_meaning(
                    [=](index_t, index_t, index_t i, index_t j) {
                        const index_t n = segment_of(i);
                        if (n < 0) return false;
                        const auto u = static_cast<std::size_t>(n);
                        const index_t jj = j - ko[u];
                        if (jj < 0 || jj >= kl[u]) return false;
                        if (band == 0) return true;
                        const index_t d = (i - qo[u]) + (a == attend::alignment::bottom_right ? kl[u] - ql[u] : 0);
                        return band == 1 ? jj <= d : jj >= d - left && jj <= d + right;
                    },
                    padded);
            },
            "packed_segments(" + std::to_string(segments) + " segments, band " + std::to_string(band) + ", " +
                spell(a) + ")",
            true);
    }

    /// Dims of a dense mask: rank 2 to 4, each axis the score axis it aligns with, 1 (broadcast), or rarely wrong.
    std::vector<index_t> dense_dims() {
        const std::array<index_t, 4> score{s_.batch, s_.heads, s_.query_len, s_.key_len};
        const std::vector<int> axes = s_.rank == 4 ? std::vector<int>{0, 1, 2, 3} : std::vector<int>{0, 2, 3};
        const int rank = in_.chance(16) ? 4 : static_cast<int>(in_.in_range(2, static_cast<index_t>(axes.size())));
        std::vector<index_t> dims;
        for (int a = 0; a < rank; ++a) {
            const int from_right = rank - a;
            const index_t n =
                from_right <= static_cast<int>(axes.size())
                    ? score[static_cast<std::size_t>(axes[axes.size() - static_cast<std::size_t>(from_right)])]
                    : 1;
            const int pick = in_.choose(32);
            dims.push_back(pick == 0 ? n + 1 : pick < 10 ? 1 : n);
        }
        return dims;
    }

    template <class V, int Rank>
    static attend::tensor<V, Rank> tensor_of(const std::vector<index_t>& dims, const std::vector<V>& flat) {
        std::array<index_t, Rank> d{};
        for (int a = 0; a < Rank; ++a) d[static_cast<std::size_t>(a)] = dims[static_cast<std::size_t>(a)];
        attend::tensor<V, Rank> t(d);
        for (std::size_t n = 0; n < flat.size(); ++n) t.data()[n] = flat[n];
        return t;
    }

    /// Calls make(tensor) with the values as a tensor of the dims' rank.
    template <class V, class Make>
    static auto with_tensor(const std::vector<index_t>& dims, const std::vector<V>& flat, Make make) {
        if (dims.size() == 2) return make(tensor_of<V, 2>(dims, flat));
        if (dims.size() == 3) return make(tensor_of<V, 3>(dims, flat));
        return make(tensor_of<V, 4>(dims, flat));
    }

    static std::size_t count(const std::vector<index_t>& dims) {
        std::size_t n = 1;
        for (index_t d : dims) n *= static_cast<std::size_t>(d);
        return n;
    }

    runtime_allowed dense_boolean_leaf() {
        const std::vector<index_t> dims = dense_dims();
        const double density = static_cast<double>(in_.byte()) / 255.0;
        std::vector<bool> stored(count(dims));
        for (std::size_t n = 0; n < stored.size(); ++n) stored[n] = values_.bernoulli(density);
        // Half the time the data follows the forbidden convention and reaches the algebra through to_allowed.
        const bool blocked_convention = in_.chance(128);
        const auto mask = with_tensor<bool>(dims, stored, [&](const auto& t) {
            return blocked_convention ? attend::to_allowed(attend_test::dense_mask<attend::forbidden_mask>(t))
                                      : attend_test::dense_mask<attend::allowed_mask>(t);
        });
        return leaf<runtime_allowed>(
            mask,
            [=](const attention_shape& s) {
                return boolean_meaning([=](index_t b, index_t h, index_t i, index_t j) {
                    return stored[dense_position(dims, s, b, h, i, j)] != blocked_convention;
                });
            },
            blocked_convention ? "to_allowed(forbidden_mask)" : "allowed_mask");
    }

    /// An additive entry: mostly ordinary biases, often -inf, sometimes extreme finite values; rarely NaN or
    /// +inf, which from_values rejects.
    template <class V>
    V additive_value() {
        using limits = std::numeric_limits<V>;
        switch (values_.uniform_int(0, 23)) {
            case 0:
            case 1:
            case 2:
            case 3: return -limits::infinity();
            case 4: return limits::lowest();
            case 5: return V(-1e30);
            case 6: return limits::max();
            case 7: return limits::denorm_min();
            case 8: return V(-300);
            case 9: return V(0);
            case 10: return values_.bernoulli(0.02) ? limits::quiet_NaN() : V(0);
            case 11: return values_.bernoulli(0.02) ? limits::infinity() : V(0);
            default: return static_cast<V>(4 * values_.uniform(-1.0, 1.0));
        }
    }

    template <class V>
    runtime_additive dense_additive_leaf() {
        const std::vector<index_t> dims = dense_dims();
        std::vector<V> flat(count(dims));
        const bool plain = in_.chance(128);  // half the masks hold only ordinary values and -inf
        for (V& x : flat) {
            x = additive_value<V>();
            if (plain && std::isfinite(x) && std::abs(x) > 10) x = V(1);
        }
        const auto mask = with_tensor<V>(dims, flat, [](const auto& t) {
            return attend_test::dense_mask<attend::additive_mask<V>>(t);
        });
        return leaf<runtime_additive>(
            mask,
            [=](const attention_shape& s) {
                return meaning{[=](index_t b, index_t h, index_t i, index_t j) {
                                   return static_cast<long double>(flat[dense_position(dims, s, b, h, i, j)]);
                               },
                               [](index_t, index_t) { return false; }, nullptr};
            },
            sizeof(V) == 4 ? "additive_mask<float>" : "additive_mask<double>");
    }

    static runtime_allowed both(const runtime_allowed& a, const runtime_allowed& b) {
        return combined<runtime_allowed>(
            a && b,
            [a, b](const attention_shape& s) {
                const meaning x = a.node->mean(s), y = b.node->mean(s);
                return boolean_meaning([x, y](index_t bb, index_t h, index_t i,
                                              index_t j) { return x.allowed(bb, h, i, j) && y.allowed(bb, h, i, j); },
                                       [x, y](index_t bb, index_t i) { return x.padded(bb, i) || y.padded(bb, i); });
            },
            "(" + a.node->text + " && " + b.node->text + ")", a.node->query_padding || b.node->query_padding);
    }

    static runtime_allowed either(const runtime_allowed& a, const runtime_allowed& b) {
        return combined<runtime_allowed>(
            a || b,
            [a, b](const attention_shape& s) {
                const meaning x = a.node->mean(s), y = b.node->mean(s);
                return boolean_meaning([x, y](index_t bb, index_t h, index_t i,
                                              index_t j) { return x.allowed(bb, h, i, j) || y.allowed(bb, h, i, j); },
                                       [x, y](index_t bb, index_t i) { return x.padded(bb, i) && y.padded(bb, i); });
            },
            "(" + a.node->text + " || " + b.node->text + ")", a.node->query_padding && b.node->query_padding);
    }

    static runtime_allowed complement(const runtime_allowed& a) {
        return combined<runtime_allowed>(
            !a,
            [a](const attention_shape& s) {
                const meaning x = a.node->mean(s);
                return boolean_meaning(
                    [x](index_t b, index_t h, index_t i, index_t j) { return !x.allowed(b, h, i, j); });
            },
            "!" + a.node->text, false);
    }

    template <class A, class B>
    static runtime_additive sum(const A& a, const B& b) {
        return combined<runtime_additive>(
            a + b,
            [a, b](const attention_shape& s) {
                const meaning x = a.node->mean(s), y = b.node->mean(s);
                return meaning{[x, y](index_t bb, index_t h, index_t i, index_t j) {
                                   return x.added(bb, h, i, j) + y.added(bb, h, i, j);
                               },
                               [x, y](index_t bb, index_t i) { return x.padded(bb, i) || y.padded(bb, i); },
                               [x, y](index_t bb, index_t h, index_t i, index_t j) {
                                   const long double total = x.added(bb, h, i, j) + y.added(bb, h, i, j);
                                   return std::max({x.largest(bb, h, i, j), y.largest(bb, h, i, j),
                                                    total == meaning::minus_inf() ? 0.0L : std::abs(total)});
                               }};
            },
            "(" + a.node->text + " + " + b.node->text + ")", a.node->query_padding || b.node->query_padding);
    }

    fuzz_input& in_;
    attention_shape s_;
    value_stream values_;
    int max_depth_;
};

}  // namespace attend_fuzz
