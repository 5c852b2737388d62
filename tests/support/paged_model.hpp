// SPDX-License-Identifier: MIT
#pragma once
/// What the paged cache's tests and its fuzzer hold it against: its whole observable state, for "a throw leaves
/// it exactly as it was", its bookkeeping invariants, and random serving sessions checked against a model that
/// keeps every sequence in a plain kv_cache of its own. No test framework here: failures go to a callback (a
/// gtest failure in the unit tests, an abort in the fuzzer).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <vector>

#include <attend/cache.hpp>
#include <attend/mask.hpp>
#include <attend/paged_attention.hpp>
#include <attend/q8_cache.hpp>
#include <attend/sdpa.hpp>

#include "random.hpp"

namespace attend_test {

/// The parts streamed into one string: a failure's text.
template <class... Parts>
std::string describe(const Parts&... parts) {
    std::ostringstream text;
    (text << ... << parts);
    return text.str();
}

/// A paged cache's sizes in one line (value_dim = head_dim); `window` > 0 is a config's sliding_window (W keys, the
/// query's own included), 0 none.
inline attend::paged_cache_config paged_config(attend::index_t kv_heads, attend::index_t head_dim,
                                               attend::index_t block_size, attend::index_t blocks,
                                               attend::index_t max_sequences = 1, attend::index_t window = 0) {
    const auto c = attend::paged_cache_config{}
                       .with_kv_heads(kv_heads)
                       .with_head_dim(head_dim)
                       .with_block_size(block_size)
                       .with_blocks(blocks)
                       .with_max_sequences(max_sequences);
    return window > 0 ? c.with_window_from_config(window) : c;
}

/// Everything a paged cache shows: free blocks, every block's reference count, and per sequence its length,
/// dropped positions, block table and the bytes of the keys and values it holds.
template <class T>
struct paged_state {
    attend::index_t free = 0;
    std::vector<attend::index_t> references;
    struct sequence {
        attend::index_t id, length, dropped;
        std::vector<attend::index_t> table;
        std::vector<unsigned char> rows;
        bool operator==(const sequence& o) const {
            return id == o.id && length == o.length && dropped == o.dropped && table == o.table && rows == o.rows;
        }
    };
    std::vector<sequence> sequences;
    bool operator==(const paged_state& o) const {
        return free == o.free && references == o.references && sequences == o.sequences;
    }
};

template <class T>
paged_state<T> state_of(const attend::paged_kv_cache<T>& c) {
    paged_state<T> s;
    s.free = c.free_blocks();
    for (attend::index_t b = 0; b < c.blocks(); ++b) s.references.push_back(c.references(b));
    for (attend::index_t id : c.sequences()) {
        typename paged_state<T>::sequence q{id, c.length(id), c.dropped(id), c.block_table(id), {}};
        const auto bytes = [&](const T* row, attend::index_t dim) {
            const auto* first = reinterpret_cast<const unsigned char*>(row);
            q.rows.insert(q.rows.end(), first,
                          first + static_cast<std::size_t>(attend::detail::row_units<T>(dim)) * sizeof(T));
        };
        for (attend::index_t h = 0; h < c.kv_heads(); ++h)
            for (attend::index_t p = 0; p < q.length; ++p) {
                bytes(c.key_row(id, h, p), c.head_dim());
                bytes(c.value_row(id, h, p), c.value_dim());
            }
        s.sequences.push_back(std::move(q));
    }
    return s;
}

/// The pool's bookkeeping: every block is free or held, and held exactly as often as tables name it; dropped
/// positions map to the zero block. Returns the first problem, or an empty string.
template <class T>
std::string consistency_problem(const attend::paged_kv_cache<T>& c) {
    std::vector<attend::index_t> named(static_cast<std::size_t>(c.blocks()), 0);
    for (attend::index_t id : c.sequences()) {
        const auto& table = c.block_table(id);
        if (static_cast<attend::index_t>(table.size()) != (c.length(id) + c.block_size() - 1) / c.block_size())
            return describe("sequence ", id, " of length ", c.length(id), " has ", table.size(), " blocks");
        for (std::size_t at = 0; at < table.size(); ++at) {
            const bool dropped = static_cast<attend::index_t>(at) * c.block_size() < c.dropped(id);
            if (dropped != (table[at] == c.zero_block()) || table[at] < 0 || table[at] > c.blocks())
                return describe("sequence ", id, " maps entry ", at, " to block ", table[at]);
            if (!dropped) ++named[static_cast<std::size_t>(table[at])];
        }
    }
    attend::index_t held = 0;
    for (attend::index_t b = 0; b < c.blocks(); ++b) {
        if (c.references(b) != named[static_cast<std::size_t>(b)])
            return describe("block ", b, " has ", c.references(b), " references, tables name it ",
                            named[static_cast<std::size_t>(b)], " times");
        held += c.references(b) > 0;
    }
    if (c.free_blocks() != c.blocks() - held)
        return describe(c.free_blocks(), " free blocks, but ", held, " of ", c.blocks(), " are held");
    return {};
}

/// The contiguous cache that holds what a paged pool of Stored holds: kv_cache<Stored>, or for a quantized pool a
/// quantized_kv_cache of its blocks (which quantizes the same way).
template <class Stored, bool = attend::detail::is_quantized_block_v<Stored>>
struct plain_cache_of {
    using type = attend::kv_cache<Stored>;
};
template <class Stored>
struct plain_cache_of<Stored, true> {
    using type = attend::quantized_kv_cache<Stored>;
};
template <class Stored>
using plain_cache_t = typename plain_cache_of<Stored>::type;

/// Each sequence of a paged cache as it would be alone: a plain cache of batch 1 with its whole history.
template <class Stored>
struct plain_caches {
    attend::index_t kv_heads, head_dim, capacity;
    std::map<attend::index_t, plain_cache_t<Stored>> of;

    plain_cache_t<Stored>& add(attend::index_t id) {
        return of
            .insert_or_assign(
                id,
                plain_cache_t<Stored>(
                    attend::kv_cache_config{}.with_kv_heads(kv_heads).with_capacity(capacity).with_head_dim(head_dim)))
            .first->second;
    }
};

/// Whether two rows of `dim` values stored as Stored hold the same bytes.
template <class Stored>
bool same_row(const Stored* a, const Stored* b, attend::index_t dim) {
    return std::memcmp(a, b, static_cast<std::size_t>(attend::detail::row_units<Stored>(dim)) * sizeof(Stored)) == 0;
}

/// Random serving sessions, each operation checked at once: sequences join, leave, fork, roll back, reorder, and
/// ragged batches append and attend. `choose(lo, hi)` draws every decision (an rng in the unit tests, the fuzzer's
/// bytes in the fuzzer). After every step the cache must equal the model: each sequence's keys and values, its
/// length and dropped positions, the pool's bookkeeping; a failed operation must be a typed error that changes
/// nothing; attention over a ragged batch must equal, bit for bit, attention over each sequence's plain cache
/// alone (with a rolling window: over its whole history under sliding_window(window - 1, 0)). `fail(text)` is
/// called with the first problem, after which failed() is true and the session does nothing more. T: the queries'
/// and new keys' type; Stored: the pool's (T, or q8_0_block for an int8 pool under float queries).
template <class T, class Choose, class Fail, class Stored = T>
class paged_session {
public:
    struct sizes {
        attend::index_t heads = 4, kv_heads = 2, head_dim = 8, block_size = 4, blocks = 96, max_sequences = 5;
        attend::index_t window = 0, max_new = 6, prefill = 80;
        attend::index_t history = 1024;  ///< positions a sequence may reach (its plain cache's capacity)
    };

    /// Decisions come from `choose`, tensor values from an rng seeded with `values`.
    paged_session(const sizes& z, const attend::sdpa_options& attention, Choose choose, Fail fail, std::uint64_t values)
        : z_(z),
          attention_(attention),
          choose_(choose),
          fail_(fail),
          values_(values),
          cache_(config_of(z)),
          plain_{z.kv_heads, z.head_dim, z.history, {}} {}

    /// What a session did, so a test can show it reached the cases it is about.
    struct tally {
        attend::index_t attended_rows = 0, forks = 0, copies_on_write = 0, truncations = 0, reorders = 0, refusals = 0,
                        longest = 0, dropped_blocks = 0;
    };
    const attend::paged_kv_cache<Stored>& cache() const { return cache_; }
    const tally& done() const { return done_; }
    bool failed() const { return failed_; }

    /// One operation, checked.
    void step() {
        if (failed_) return;
        switch (choose_(0, 9)) {
            case 0: return add();
            case 1: return remove();
            case 2: return fork();
            case 3: return truncate();
            case 4: return reorder();
            default: return append_and_attend();
        }
    }

    /// The model and the cache agree on every sequence, and the pool's bookkeeping holds.
    void check_model() {
        if (failed_) return;
        if (!check(cache_.sequences().size() == plain_.of.size(),
                   [&] { return "the cache holds another number of sequences"; }))
            return;
        for (const auto& [id, plain] : plain_.of) {
            if (!check(cache_.contains(id) && cache_.length(id) == plain.length() &&
                           cache_.dropped(id) == dropped_.at(id),
                       [&, id = id] { return describe("sequence ", id, ": its length or dropped positions differ"); }))
                return;
            for (attend::index_t h = 0; h < z_.kv_heads; ++h)
                for (attend::index_t p = dropped_.at(id); p < plain.length(); ++p)
                    if (!check(same_row(cache_.key_row(id, h, p), plain.keys().row(0, h, p), z_.head_dim) &&
                                   same_row(cache_.value_row(id, h, p), plain.values().row(0, h, p), z_.head_dim),
                               [&, id = id] { return describe("sequence ", id, " position ", p, " differs"); }))
                        return;
        }
        const std::string problem = consistency_problem(cache_);
        check(problem.empty(), [&] { return problem; });
    }

private:
    /// Reports the problem `what()` describes unless `condition`; returns `condition`.
    template <class What>
    bool check(bool condition, What&& what) {
        if (condition || failed_) return condition && !failed_;
        failed_ = true;
        fail_(std::string(what()));
        return false;
    }

    static attend::paged_cache_config config_of(const sizes& z) {
        return paged_config(z.kv_heads, z.head_dim, z.block_size, z.blocks, z.max_sequences, z.window);
    }
    attend::index_t pick(const std::vector<attend::index_t>& ids) {
        return ids[static_cast<std::size_t>(choose_(0, static_cast<attend::index_t>(ids.size()) - 1))];
    }

    /// Runs an operation that the model says must fail with `id`: it must, as an E, and change nothing.
    template <class E, class F>
    void expect_refused(F&& f, const char* id) {
        const auto before = state_of(cache_);
        ++done_.refusals;
        std::string got = "nothing thrown";
        try {
            f();
        } catch (const attend::error& e) {
            got = typeid(e) == typeid(E) ? e.id() : std::string("another error type: ") + e.what();
        }
        if (!check(got == id, [&] { return describe("expected ", id, ", got ", got); })) return;
        check(state_of(cache_) == before, [&] { return describe(id, " changed the cache"); });
    }

    void add() {
        if (static_cast<attend::index_t>(plain_.of.size()) == z_.max_sequences)
            return expect_refused<attend::position_error>([&] { cache_.add_sequence(); },
                                                          "attend.position.sequence_slots");
        const attend::index_t id = cache_.add_sequence();
        if (!check(plain_.of.count(id) == 0, [&] { return describe("add_sequence returned live id ", id); })) return;
        plain_.add(id);
        dropped_[id] = 0;
        last_append_[id] = 0;
    }

    void remove() {
        const auto ids = cache_.sequences();
        if (ids.empty()) return;
        const attend::index_t id = pick(ids);
        cache_.remove_sequence(id);
        plain_.of.erase(id);
        dropped_.erase(id);
        last_append_.erase(id);
    }

    void fork() {
        const auto ids = cache_.sequences();
        if (ids.empty()) return;
        const attend::index_t from = pick(ids);
        if (static_cast<attend::index_t>(ids.size()) == z_.max_sequences)
            return expect_refused<attend::position_error>([&] { cache_.fork(from); }, "attend.position.sequence_slots");
        const attend::index_t free_before = cache_.free_blocks();
        const attend::index_t id = cache_.fork(from);
        // A fork copies block numbers: no block is taken, and both read the same memory.
        const bool shares = cache_.length(from) == dropped_[from] ||
                            cache_.key_row(id, 0, dropped_[from]) == cache_.key_row(from, 0, dropped_[from]);
        if (!check(cache_.free_blocks() == free_before && shares, [&] { return "a fork took blocks or copied keys"; }))
            return;
        ++done_.forks;
        plain_.of.insert_or_assign(id, plain_.of.at(from));
        dropped_[id] = dropped_[from];
        last_append_[id] = last_append_[from];
    }

    void truncate() {
        const auto ids = cache_.sequences();
        if (ids.empty()) return;
        const attend::index_t id = pick(ids), length = cache_.length(id);
        // Mostly a rollback of the last append (always possible); sometimes further back.
        const attend::index_t back = choose_(0, 3) == 0 ? choose_(0, length) : choose_(0, last_append_[id]);
        const attend::index_t target = length - back;
        if (z_.window > 0 && dropped_[id] > 0 && target - z_.window + 1 < dropped_[id])
            return expect_refused<attend::position_error>([&] { cache_.truncate(id, target); },
                                                          "attend.position.window");
        cache_.truncate(id, target);
        ++done_.truncations;
        plain_.of.at(id).truncate(target);
        last_append_[id] = std::max<attend::index_t>(0, last_append_[id] - back);
    }

    void reorder() {
        auto ids = cache_.sequences();
        if (ids.empty()) return;
        const auto n = static_cast<std::size_t>(choose_(1, static_cast<attend::index_t>(ids.size())));
        ids.resize(n);
        std::vector<attend::index_t> sources;
        for (std::size_t k = 0; k < n; ++k) sources.push_back(pick(cache_.sequences()));
        cache_.reorder(ids, sources);
        ++done_.reorders;
        std::map<attend::index_t, plain_cache_t<Stored>> copies;
        std::map<attend::index_t, attend::index_t> dropped, last;
        for (std::size_t k = 0; k < n; ++k) {
            copies.insert_or_assign(ids[k], plain_.of.at(sources[k]));
            dropped[ids[k]] = dropped_[sources[k]];
            last[ids[k]] = last_append_[sources[k]];
        }
        for (std::size_t k = 0; k < n; ++k) {
            plain_.of.insert_or_assign(ids[k], copies.at(ids[k]));
            dropped_[ids[k]] = dropped[ids[k]];
            last_append_[ids[k]] = last[ids[k]];
        }
    }

    /// Blocks an append of `t` tokens to `id` takes: new blocks, plus one when it writes into a shared block.
    attend::index_t blocks_needed(attend::index_t id, attend::index_t t) const {
        const attend::index_t bs = z_.block_size, length = cache_.length(id);
        attend::index_t needed = (length + t + bs - 1) / bs - (length + bs - 1) / bs;
        const auto& table = cache_.block_table(id);
        if (t > 0 && length % bs != 0 && cache_.references(table.back()) > 1) ++needed;
        return needed;
    }

    void append_and_attend() {
        auto active = cache_.sequences();
        if (active.empty()) return add();
        const auto n = static_cast<std::size_t>(
            choose_(1, std::min<attend::index_t>(4, static_cast<attend::index_t>(active.size()))));
        std::vector<attend::index_t> ids, counts;
        for (std::size_t k = 0; k < n; ++k) {
            const auto at = static_cast<std::size_t>(choose_(0, static_cast<attend::index_t>(active.size()) - 1));
            ids.push_back(active[at]);
            active.erase(active.begin() + static_cast<std::ptrdiff_t>(at));
            const attend::index_t t = choose_(0, 7) == 0 ? choose_(0, z_.prefill) : choose_(0, z_.max_new);
            counts.push_back(std::min(t, z_.history - cache_.length(ids.back())));
        }
        const attend::index_t L = *std::max_element(counts.begin(), counts.end());
        const auto B = static_cast<attend::index_t>(n), G = z_.kv_heads, D = z_.head_dim;
        attend::tensor<T, 4> k(B, G, L, D), v(B, G, L, D), q(B, z_.heads, L, D);
        for (auto* x : {&k, &v, &q})
            for (attend::index_t e = 0; e < x->size(); ++e)
                x->data()[e] = static_cast<T>(choose_(-1000, 1000)) / T(500);
        attend::index_t needed = 0;
        for (std::size_t m = 0; m < n; ++m) needed += blocks_needed(ids[m], counts[m]);
        if (needed > cache_.free_blocks())
            return expect_refused<attend::position_error>([&] { cache_.append(ids, k, v, counts); },
                                                          "attend.position.cache_full");
        attend::index_t fresh = 0;
        for (std::size_t m = 0; m < n; ++m)
            fresh += (cache_.length(ids[m]) + counts[m] + z_.block_size - 1) / z_.block_size -
                     (cache_.length(ids[m]) + z_.block_size - 1) / z_.block_size;
        const attend::index_t free_before = cache_.free_blocks();
        cache_.append(ids, k, v, counts);
        // Blocks taken beyond the new ones are copies of shared blocks; blocks handed back are the window's.
        done_.copies_on_write += needed - fresh;
        done_.dropped_blocks += cache_.free_blocks() - (free_before - needed);
        for (std::size_t m = 0; m < n; ++m) {
            const attend::index_t id = ids[m], t = counts[m];
            auto& plain = plain_.of.at(id);
            if (z_.window > 0) {
                const attend::index_t first_needed = plain.length() - z_.window + 1;
                if (first_needed > 0)
                    dropped_[id] = std::max(dropped_[id], first_needed / z_.block_size * z_.block_size);
            }
            plain.append(
                attend::tensor<T, 4>(k.slice(std::array<attend::index_t, 4>{static_cast<attend::index_t>(m), 0, 0, 0},
                                             std::array<attend::index_t, 4>{1, G, t, D})),
                attend::tensor<T, 4>(v.slice(std::array<attend::index_t, 4>{static_cast<attend::index_t>(m), 0, 0, 0},
                                             std::array<attend::index_t, 4>{1, G, t, D})));
            last_append_[id] = t;
            done_.longest = std::max(done_.longest, plain.length());
        }
        const auto r = attend::paged_attention(q, cache_, ids, counts, attention_);
        for (std::size_t m = 0; m < n; ++m) expect_alone(r, q, static_cast<attend::index_t>(m), ids[m], counts[m]);
    }

    /// Batch row m of a paged_attention result against scaled_dot_product_attention over the sequence's plain
    /// cache alone: the same bits, and zeros with lse -inf in the padding rows.
    void expect_alone(const attend::attention_result<T, 4>& r, const attend::tensor<T, 4>& q, attend::index_t m,
                      attend::index_t id, attend::index_t t) {
        const auto& plain = plain_.of.at(id);
        const attend::index_t H = z_.heads, L = q.dimension(2), D = z_.head_dim;
        if (t == 0) {  // nothing to attend alone (an empty sequence has no keys): all padding
            for (attend::index_t e = 0; e < H * L * D; ++e)
                if (!check(r.out.data()[m * H * L * D + e] == T(0), [&] { return "a padding row is not zero"; }))
                    return;
            for (attend::index_t e = 0; e < H * L; ++e)
                if (!check(r.lse.data()[m * H * L + e] == -std::numeric_limits<Lse>::infinity(),
                           [&] { return "a padding row's lse is not -inf"; }))
                    return;
            return;
        }
        attend::tensor<T, 4> qm(1, H, t, D);
        for (attend::index_t h = 0; h < H; ++h)
            for (attend::index_t i = 0; i < t; ++i)
                for (attend::index_t d = 0; d < D; ++d) qm(0, h, i, d) = q(m, h, i, d);
        const auto rule = z_.window > 0 ? z_.window - 1 : plain.length();
        const auto alone =
            z_.window > 0
                ? attend::scaled_dot_product_attention(qm, plain.keys(), plain.values(),
                                                       attend::causal(attend::alignment::bottom_right) &&
                                                           attend::sliding_window(rule, 0,
                                                                                  attend::alignment::bottom_right),
                                                       attention_)
                : attend::scaled_dot_product_attention(qm, plain.keys(), plain.values(),
                                                       attend::causal(attend::alignment::bottom_right), attention_);
        for (attend::index_t h = 0; h < H; ++h)
            for (attend::index_t i = 0; i < L; ++i) {
                for (attend::index_t d = 0; d < D; ++d) {
                    const T want = i < t ? alone.out(0, h, i, d) : T(0);
                    if (!check(same_bits(r.out(m, h, i, d), want), [&] {
                            return describe("sequence ", id, " head ", h, " query ", i, " of ", t, ": paged ",
                                            r.out(m, h, i, d), ", alone ", want);
                        }))
                        return;
                }
                const Lse lse = i < t ? alone.lse(0, h, i) : -std::numeric_limits<Lse>::infinity();
                if (!check(same_bits(r.lse(m, h, i), lse),
                           [&] { return describe("lse of sequence ", id, " head ", h, " query ", i); }))
                    return;
            }
        done_.attended_rows += t;
    }

    using Lse = attend::accumulator_t<T>;  ///< the lse's type: float for 16-bit storage

    template <class S>
    static bool same_bits(S a, S b) {
        return std::memcmp(&a, &b, sizeof(S)) == 0;
    }

    sizes z_;
    attend::sdpa_options attention_;
    Choose choose_;
    Fail fail_;
    rng values_;
    bool failed_ = false;
    attend::paged_kv_cache<Stored> cache_;
    plain_caches<Stored> plain_;
    std::map<attend::index_t, attend::index_t> dropped_, last_append_;
    tally done_;
};

}  // namespace attend_test
