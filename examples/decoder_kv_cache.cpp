// SPDX-License-Identifier: MIT
// Greedy decoding with a KV cache and rotary positions over a tiny fixed-weight model: a 6-token vocabulary with
// tied embeddings, one multi-query attention layer (4 query heads sharing 1 key/value head) and a fixed readout.
// Each step feeds only the newest token; its key and value are appended to the cache, rotated at the token's
// global position (the cache length), and the query attends over the whole cache with bottom-right causal
// alignment. Then one causal pass over the whole sequence recomputes every step at once: the outputs agree.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <vector>

#include <attend/mha.hpp>

namespace {

using attend::index_t;

constexpr index_t vocab = 6, model_dim = 8;

/// Tied embedding row of a token: exact small fractions.
float embedding(index_t token, index_t e) { return static_cast<float>((token * 5 + e * 3) % 7 - 3) / 3.0f; }

attend::tensor<float, 3> embed(const std::vector<index_t>& tokens) {
    attend::tensor<float, 3> x(1, static_cast<index_t>(tokens.size()), model_dim);
    for (index_t i = 0; i < x.dimension(1); ++i)
        for (index_t e = 0; e < model_dim; ++e) x(0, i, e) = embedding(tokens[static_cast<std::size_t>(i)], e);
    return x;
}

/// The most likely next token after hidden state row i of h: argmax of h · embedding^T.
index_t next_token(const attend::tensor<float, 3>& h, index_t i) {
    index_t best = 0;
    float best_logit = 0;
    for (index_t t = 0; t < vocab; ++t) {
        float logit = 0;
        for (index_t e = 0; e < model_dim; ++e) logit += h(0, i, e) * embedding(t, e);
        if (t == 0 || logit > best_logit) {
            best = t;
            best_logit = logit;
        }
    }
    return best;
}

}  // namespace

int main() {
    using attend::index_t;
    const attend::multi_head_attention<float> layer({model_dim, 4, /*kv_heads*/ 1}, /*seed*/ 2024);
    attend::mha_options options;
    options.rotary = attend::rotary_embedding{layer.head_dim()};  // head_dim 2: one rotating pair per head

    const index_t steps = 6;
    auto cache = layer.make_cache(/*batch*/ 1, /*capacity*/ steps);
    std::vector<index_t> tokens{1};
    attend::tensor<float, 3> step_out(1, steps, model_dim);  // attention output of every step, for the check
    for (index_t s = 0; s < steps; ++s) {
        const auto x = embed({tokens.back()});
        const auto r = layer.forward_cached(x, cache, options);
        // A fixed toy readout: the attention output, minus the current token so it does not just repeat itself.
        attend::tensor<float, 3> h = r.out * 4.0f - x;
        for (index_t e = 0; e < model_dim; ++e) step_out(0, s, e) = r.out(0, 0, e);
        const index_t next = next_token(h, 0);
        std::cout << "step " << s << ": position " << s << ", token " << tokens.back() << " -> " << next
                  << " (cache length " << cache.length() << " of " << cache.capacity() << ")\n";
        tokens.push_back(next);
    }
    std::cout << "generated:";
    for (const index_t t : tokens) std::cout << ' ' << t;
    std::cout << '\n';

    // One causal pass over the tokens the steps consumed: the same outputs, row by row.
    const std::vector<index_t> consumed(tokens.begin(), tokens.end() - 1);
    const auto x = embed(consumed);
    const auto full = layer.forward(x, x, x, attend::causal(attend::alignment::top_left), options);
    double max_diff = 0;
    for (index_t n = 0; n < full.out.size(); ++n)
        max_diff = std::max(max_diff, static_cast<double>(std::abs(full.out.data()[n] - step_out.data()[n])));
    const bool same = max_diff < 1e-5;
    std::cout << "max |step - full| < 1e-5: " << (same ? "yes" : "NO") << '\n';

    // The cache is full now: one more token is an error, and nothing is appended.
    try {
        layer.forward_cached(embed({tokens.back()}), cache, options);
        std::cout << "appended past the capacity?!\n";
        return 1;
    } catch (const attend::position_error& e) {
        std::cout << "one more step: " << e.id() << ", cache length still " << cache.length() << '\n';
    }
    return same ? 0 : 1;
}
