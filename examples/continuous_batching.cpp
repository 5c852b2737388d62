// SPDX-License-Identifier: MIT
// Continuous batching over a paged KV cache: requests join the batch when they arrive and leave when they are
// done, each step decodes every live sequence at once (a ragged batch: a prompt's first step feeds the whole
// prompt, later steps one token), one request is forked into two continuations that share its prompt's blocks,
// and one speculative draft is rolled back. The model is a tiny fixed-weight layer (6-token vocabulary, tied
// embeddings, 4 query heads over 1 key/value head, rotary positions). At the end every finished sequence is
// decoded again alone, token by token, with a plain kv_cache: the outputs are the same bits.
#include <algorithm>
#include <cstdio>
#include <iterator>
#include <map>
#include <vector>

#include <attend/attend.hpp>

namespace {

using attend::index_t;

constexpr index_t vocab = 6, model_dim = 8;

float embedding(index_t token, index_t e) { return static_cast<float>((token * 5 + e * 3) % 7 - 3) / 3.0f; }

/// The most likely next token after hidden state row (b, i): argmax of h · embedding^T.
index_t next_token(const attend::tensor<float, 3>& h, index_t b, index_t i) {
    index_t best = 0;
    float best_logit = 0;
    for (index_t t = 0; t < vocab; ++t) {
        float logit = 0;
        for (index_t e = 0; e < model_dim; ++e) logit += h(b, i, e) * embedding(t, e);
        if (t == 0 || logit > best_logit) {
            best = t;
            best_logit = logit;
        }
    }
    return best;
}

/// What happened to one sequence's cache: tokens fed (and the hidden states they gave) or a rollback.
struct event {
    std::vector<index_t> fed;
    std::vector<float> hidden;  ///< [fed, model_dim]
    index_t truncated_to = -1;  ///< >= 0: a rollback to this length instead
};

struct request {
    std::vector<index_t> tokens;  ///< prompt, then what was generated
    index_t pending = 0;          ///< tokens at the end of `tokens` not yet fed to the model
    index_t to_generate = 0;
    std::vector<event> history;
};

attend::tensor<float, 3> embed(const std::vector<index_t>& tokens) {
    attend::tensor<float, 3> x(1, static_cast<index_t>(tokens.size()), model_dim);
    for (index_t i = 0; i < x.dimension(1); ++i)
        for (index_t e = 0; e < model_dim; ++e) x(0, i, e) = embedding(tokens[static_cast<std::size_t>(i)], e);
    return x;
}

void print_tokens(const std::vector<index_t>& tokens) {
    for (index_t t : tokens) std::printf("%lld", static_cast<long long>(t));
}

}  // namespace

int main() {
    using attend::index_t;
    const attend::multi_head_attention<float> layer({model_dim, 4, /*kv_heads*/ 1}, /*seed*/ 2024);
    attend::mha_options options;
    options.rotary = attend::rotary_embedding{layer.head_dim()};
    options.attention.threads = 1;
    // 24 blocks of 4 positions, shared by at most 4 sequences.
    attend::paged_cache_config config;
    config.kv_heads = 1;
    config.head_dim = layer.head_dim();
    config.block_size = 4;
    config.blocks = 24;
    config.max_sequences = 4;
    attend::paged_kv_cache<float> cache(config);

    // Arrival step -> prompt and how many tokens to generate.
    const std::map<int, std::pair<std::vector<index_t>, index_t>> arrivals{
        {0, {{1, 2, 3, 4, 5}, 6}}, {1, {{3, 1}, 5}}, {3, {{5, 5, 0, 2, 1, 3, 4}, 4}}};
    std::map<index_t, request> live;      // sequence id -> request
    std::map<index_t, request> finished;  // sequence id at the end -> request
    index_t next_name = 0;
    std::map<index_t, index_t> name_of;  // sequence id -> request name, for printing

    for (int step = 0; !live.empty() || step <= arrivals.rbegin()->first; ++step) {
        if (const auto a = arrivals.find(step); a != arrivals.end()) {
            const index_t id = cache.add_sequence();
            live[id] = request{a->second.first, static_cast<index_t>(a->second.first.size()), a->second.second, {}};
            name_of[id] = next_name++;
        }
        if (step == 4) {  // request 0 forks: a second continuation shares its blocks, then goes its own way
            const index_t from = live.begin()->first;
            const index_t free_before = cache.free_blocks();
            const index_t id = cache.fork(from);
            live[id] = live[from];
            live[id].tokens.back() = (live[id].tokens.back() + 1) % vocab;  // a different sample for the last token
            name_of[id] = next_name++;
            std::printf("step %d: fork of request %lld as request %lld, blocks taken %lld\n", step,
                        static_cast<long long>(name_of[from]), static_cast<long long>(name_of[id]),
                        static_cast<long long>(free_before - cache.free_blocks()));
        }
        // One ragged batch: every live sequence feeds its pending tokens.
        std::vector<index_t> ids, counts;
        for (const auto& [id, r] : live) {
            ids.push_back(id);
            counts.push_back(r.pending);
        }
        const index_t width = *std::max_element(counts.begin(), counts.end());
        attend::tensor<float, 3> x(static_cast<index_t>(ids.size()), width, model_dim);
        x.setZero();
        for (std::size_t n = 0; n < ids.size(); ++n) {
            const auto& r = live[ids[n]];
            const index_t first = static_cast<index_t>(r.tokens.size()) - r.pending;
            for (index_t i = 0; i < r.pending; ++i)
                for (index_t e = 0; e < model_dim; ++e)
                    x(static_cast<index_t>(n), i, e) = embedding(r.tokens[static_cast<std::size_t>(first + i)], e);
        }
        const auto h = layer.forward_cached(x, cache, ids, counts, options).out;
        std::printf("step %d: batch", step);
        for (std::size_t n = 0; n < ids.size(); ++n) {
            auto& r = live[ids[n]];
            event fed{{r.tokens.end() - r.pending, r.tokens.end()}, {}, -1};
            for (index_t i = 0; i < counts[n]; ++i)
                for (index_t e = 0; e < model_dim; ++e) fed.hidden.push_back(h(static_cast<index_t>(n), i, e));
            r.history.push_back(std::move(fed));
            r.tokens.push_back(next_token(h, static_cast<index_t>(n), counts[n] - 1));
            r.pending = 1;
            --r.to_generate;
            std::printf(" %lld:", static_cast<long long>(name_of[ids[n]]));
            print_tokens(r.tokens);
        }
        std::printf(" | free blocks %lld\n", static_cast<long long>(cache.free_blocks()));
        if (step == 2) {
            // Request 1's last fed token was a draft the verifier rejects: the cache forgets it, the text drops
            // what was predicted from it, and the verifier's own token (here: the next one in the vocabulary)
            // is fed instead in the next step.
            const index_t id = std::next(live.begin())->first;
            auto& r = live[id];
            cache.truncate(id, cache.length(id) - 1);
            r.history.push_back(event{{}, {}, cache.length(id)});
            r.tokens.pop_back();
            r.tokens.back() = (r.tokens.back() + 1) % vocab;
            ++r.to_generate;
            std::printf("step %d: request %lld rolled back its draft token, cache length %lld\n", step,
                        static_cast<long long>(name_of[id]), static_cast<long long>(cache.length(id)));
        }
        for (auto it = live.begin(); it != live.end();) {  // finished requests leave and free their blocks
            if (it->second.to_generate > 0) {
                ++it;
                continue;
            }
            finished[name_of[it->first]] = it->second;
            cache.remove_sequence(it->first);
            it = live.erase(it);
        }
    }

    // Every finished request, replayed alone (the same chunks, the same rollback) through a plain kv_cache of
    // its own: the batch it shared never changed a bit of its hidden states.
    for (const auto& [name, r] : finished) {
        auto plain = layer.make_cache(1, 64);
        bool same = true;
        for (const event& e : r.history) {
            if (e.truncated_to >= 0) {
                plain.truncate(e.truncated_to);
                continue;
            }
            const auto h = layer.forward_cached(embed(e.fed), plain, options).out;
            same = same && std::equal(e.hidden.begin(), e.hidden.end(), h.data());
        }
        std::printf("request %lld: ", static_cast<long long>(name));
        print_tokens(r.tokens);
        std::printf(" | replayed alone: %s\n", same ? "same bits" : "DIFFERENT");
    }
    std::printf("free blocks at the end: %lld of %lld\n", static_cast<long long>(cache.free_blocks()),
                static_cast<long long>(cache.blocks()));
    return 0;
}
