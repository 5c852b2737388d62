// SPDX-License-Identifier: MIT
/// Mask algebra fuzzer: random mask expressions (fuzz_masks.hpp) over random score shapes, checked against their
/// meaning and against themselves:
///   - building or binding a mask either succeeds or throws an attend::error with a well-formed id, and the
///     public materialize / classify / to_string throw the same id as bind;
///   - allowed(b, h, i, j), query_padded(b, i), materialize and to_string agree with the meaning computed from
///     the rules' definitions; a padded query has no allowed key;
///   - the tile classification the kernels skip and trust is sound on random tiles: empty => nothing allowed,
///     full => everything allowed and apply() changes nothing, public classify == bound classify;
///   - apply() writes -inf exactly at forbidden positions and leaves allowed ones finite (saturating biases);
///   - the empty-row search of the kernels' checks finds the first empty row a brute-force scan finds.

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <attend/mask.hpp>
#include <attend/sdpa.hpp>

#include "fuzz_check.hpp"
#include "fuzz_input.hpp"
#include "fuzz_masks.hpp"

namespace attend_fuzz {
namespace {

std::string at(const char* what, index_t b, index_t h, index_t i, index_t j) {
    std::ostringstream s;
    s << what << " at (" << b << ", " << h << ", " << i << ", " << j << ')';
    return s.str();
}

/// to_string's documented drawing, built from the meaning.
std::string expected_drawing(const meaning& m, const attention_shape& s) {
    std::ostringstream out;
    for (index_t b = 0; b < s.batch; ++b)
        for (index_t h = 0; h < s.heads; ++h) {
            if (s.batch * s.heads > 1) out << "batch " << b << ", head " << h << ":\n";
            for (index_t i = 0; i < s.query_len; ++i) {
                out << 'q' << i << ':';
                if (m.padded(b, i)) {
                    out << " (padded)\n";
                    continue;
                }
                bool any = false;
                for (index_t j = 0; j < s.key_len; ++j)
                    if (m.allowed(b, h, i, j)) {
                        out << " k" << j;
                        any = true;
                    }
                out << (any ? "\n" : " (none)\n");
            }
        }
    return out.str();
}

std::string spell(tile_class c) { return c == tile_class::empty ? "empty" : c == tile_class::full ? "full" : "mixed"; }

/// Applies the mask to a tile of scores in [-1, 1) and checks what it wrote, and what its class promised.
template <class T>
void check_tile(const any_bound& bound, const meaning& m, const tile& t, tile_class c, value_stream& g) {
    const index_t rows = t.query_end - t.query_begin, cols = t.key_end - t.key_begin, ld = cols + 3;
    std::vector<T> scores(static_cast<std::size_t>(rows * ld)), before;
    for (T& x : scores) x = static_cast<T>(g.uniform(-1.0, 1.0));
    before = scores;
    bound.apply(t, scores.data(), ld);
    for (index_t i = t.query_begin; i < t.query_end; ++i)
        for (index_t j = t.key_begin; j < t.key_end; ++j) {
            const std::size_t n = static_cast<std::size_t>((i - t.query_begin) * ld + (j - t.key_begin));
            const bool allowed = m.allowed(t.batch, t.head, i, j);
            if (c == tile_class::empty)
                require(!allowed, at("tile classified empty allows a key", t.batch, t.head, i, j));
            if (c == tile_class::full) {
                require(allowed, at("tile classified full forbids a key", t.batch, t.head, i, j));
                // The kernels never apply a full tile, so applying it must not change anything.
                require(scores[n] == before[n], at("apply changes a tile classified full", t.batch, t.head, i, j));
            }
            if (allowed)
                require(std::isfinite(scores[n]),
                        at("apply leaves an allowed score non-finite", t.batch, t.head, i, j));
            else
                require(scores[n] == -std::numeric_limits<T>::infinity(),
                        at("apply leaves a forbidden score other than -inf", t.batch, t.head, i, j));
        }
    for (index_t i = 0; i < rows; ++i)  // columns past the tile (the leading dimension's slack) are not written
        for (index_t j = cols; j < ld; ++j)
            require(scores[static_cast<std::size_t>(i * ld + j)] == before[static_cast<std::size_t>(i * ld + j)],
                    "apply writes past the tile's columns");
}

template <class Mask>
void check_expression(fuzz_input& in, const Mask& mask, const attention_shape& s) {
    const expression& e = *mask.node;
    const auto bind_id = error_id_of([&] { (void)mask.bind(s); });
    const attend::score_shape shape{s.batch, s.heads, s.query_len, s.key_len};
    if (s.rank == 4) {
        // The public functions bind the same rank-4 score shape.
        const attend::tile whole{0, 0, 0, s.query_len, 0, s.key_len};
        const auto materialize_id = error_id_of([&] { (void)attend::materialize(mask, shape); });
        const auto string_id = error_id_of([&] { (void)attend::to_string(mask, shape); });
        const auto classify_id = error_id_of([&] {
            if (s.batch > 0 && s.query_len > 0 && s.key_len > 0) (void)attend::classify(mask, shape, whole);
            else (void)mask.bind(s);
        });
        require(materialize_id == bind_id && string_id == bind_id && classify_id == bind_id,
                "bind throws " + attend_fuzz::spell(bind_id) + ", materialize " + attend_fuzz::spell(materialize_id) +
                    ", to_string " + attend_fuzz::spell(string_id) + ", classify " + attend_fuzz::spell(classify_id));
    }
    if (bind_id) return;
    const any_bound bound = mask.bind(s);
    const meaning m = e.mean(s);

    for (index_t b = 0; b < s.batch; ++b)
        for (index_t i = 0; i < s.query_len; ++i) {
            require(bound.query_padded(b, i) == m.padded(b, i),
                    at("query_padded disagrees with the meaning", b, 0, i, 0));
            for (index_t h = 0; h < s.heads; ++h)
                for (index_t j = 0; j < s.key_len; ++j) {
                    require(bound.allowed(b, h, i, j) == m.allowed(b, h, i, j),
                            at("allowed disagrees with the meaning", b, h, i, j));
                    if (m.padded(b, i))
                        require(!m.allowed(b, h, i, j), at("a padded query has an allowed key", b, h, i, j));
                }
        }
    if (s.rank == 4) {
        const attend::allowed_mask dense = attend::materialize(mask, shape);
        for (index_t b = 0; b < s.batch; ++b)
            for (index_t h = 0; h < s.heads; ++h)
                for (index_t i = 0; i < s.query_len; ++i)
                    for (index_t j = 0; j < s.key_len; ++j)
                        require(dense(b, h, i, j) == m.allowed(b, h, i, j),
                                at("materialize disagrees with the meaning", b, h, i, j));
        require(attend::to_string(mask, shape) == expected_drawing(m, s),
                "to_string differs from the documented drawing");
    }

    if (s.batch == 0 || s.query_len == 0 || s.key_len == 0) return;
    // The empty-row search the checks of every attention call run, against a brute-force scan (attention calls
    // have key_len >= 1: check_views rejects 0 before the search).
    const attend::detail::erased_mask<any_bound> erased(bound);
    std::optional<std::array<index_t, 3>> first;
    for (index_t b = 0; b < s.batch && !first; ++b)
        for (index_t h = 0; h < s.heads && !first; ++h)
            for (index_t i = 0; i < s.query_len && !first; ++i) {
                if (m.padded(b, i)) continue;
                bool any = false;
                for (index_t j = 0; j < s.key_len && !any; ++j) any = m.allowed(b, h, i, j);
                if (!any) first = std::array<index_t, 3>{b, h, i};
            }
    require(attend::detail::first_empty_row<attend::detail::mask_tiles>(erased, s) == first,
            "first_empty_row differs from a brute-force scan");

    value_stream g(in.word());
    const bool in_double = in.chance(128);
    for (int n = in.choose(24) + 1; n > 0; --n) {
        tile t;
        t.batch = in.in_range(0, s.batch - 1);
        t.head = in.in_range(0, s.heads - 1);
        t.query_begin = in.in_range(0, s.query_len - 1);
        t.query_end = in.in_range(t.query_begin + 1, s.query_len);
        t.key_begin = in.in_range(0, s.key_len - 1);
        t.key_end = in.in_range(t.key_begin + 1, s.key_len);
        const tile_class c = bound.classify(t);
        if (s.rank == 4)
            require(attend::classify(mask, shape, t) == c, "public classify differs from the bound one: " + spell(c));
        if (in_double) check_tile<double>(bound, m, t, c, g);
        else check_tile<float>(bound, m, t, c, g);
    }
}

void run_case(fuzz_input& in) {
    attention_shape s;
    s.rank = in.chance(64) ? 3 : 4;
    s.batch = in.chance(8) ? 0 : in.in_range(1, 3);
    s.heads = s.rank == 4 ? in.in_range(1, 3) : 1;
    s.kv_heads = s.heads;
    const bool large = in.chance(16);
    s.query_len = in.chance(8) ? 0 : in.in_range(1, large ? 300 : 24);
    s.key_len = in.chance(4) ? s.query_len : in.in_range(0, large ? 300 : 24);
    s.head_dim = s.value_dim = 1;
    std::ostringstream text;
    text << "scores rank " << s.rank << " [" << s.batch << ',' << s.heads << ',' << s.query_len << ',' << s.key_len
         << ']';
    case_description() = text.str();

    mask_generator generate(in, s, 4);
    const bool additive = in.chance(80);
    std::optional<runtime_allowed> a;
    std::optional<runtime_additive> x;
    // Building can throw (negative window or prefix, NaN in an additive mask): an attend::error with an id.
    if (error_id_of([&] {
            if (additive) x = generate.additive();
            else a = generate.allowed();
        }))
        return;
    case_description() = text.str() + " mask " + (a ? a->node->text : x->node->text);
    if (a) check_expression(in, *a, s);
    else check_expression(in, *x, s);
}

}  // namespace
}  // namespace attend_fuzz

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    attend_fuzz::fuzz_input in(data, size);
    attend_fuzz::run_case(in);
    return 0;
}
