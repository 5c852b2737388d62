// SPDX-License-Identifier: MIT
// Cross-attention of a decoder over an encoder memory: 3 target queries (model_dim 8) read 5 source positions
// whose features are 6 wide (key_dim = value_dim = 6, PyTorch's kdim / vdim), so L != S and the key/value
// projections are not square. The second source sentence has 3 real tokens; its padding gets exactly zero
// weight. There is no causal mask on the cross step: the target's causality is the decoder self-attention's job,
// so query 0 may read the last source token.
#include <cmath>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include <attend/mha.hpp>

namespace {

std::string fixed3(double x) {
    char buffer[32];
    std::snprintf(buffer, sizeof buffer, "%.3f", x);
    const std::string s = buffer;
    return s == "-0.000" ? "0.000" : s;
}

}  // namespace

int main() {
    using attend::index_t;
    const index_t batch = 2, target_len = 3, source_len = 5, model_dim = 8, source_dim = 6;
    attend::mha_config config{model_dim, 2};
    config.key_dim = source_dim;
    config.value_dim = source_dim;
    const attend::multi_head_attention<double> cross(config, /*seed*/ 11);
    std::cout << "parameters: " << cross.parameter_count()
              << " (q [8,8], k [8,6], v [8,6], out [8,8], biases 24 + 8)\n";

    attend::tensor<double, 3> target(batch, target_len, model_dim), memory(batch, source_len, source_dim);
    for (index_t b = 0; b < batch; ++b) {
        for (index_t i = 0; i < target_len; ++i)
            for (index_t e = 0; e < model_dim; ++e)
                target(b, i, e) = static_cast<double>((b * 13 + i * 5 + e * 3) % 9 - 4) / 4.0;
        for (index_t j = 0; j < source_len; ++j)
            for (index_t e = 0; e < source_dim; ++e)
                memory(b, j, e) = static_cast<double>((b * 7 + j * 11 + e * 5) % 13 - 6) / 6.0;
    }
    const std::vector<index_t> source_lengths{5, 3};

    attend::mha_options options;
    options.key_padding = source_lengths;  // the only mask: source padding
    options.attention.need_weights = true;
    const auto r = cross.forward(target, memory, memory, options);
    const auto& weights = r.averaged_weights();  // [batch, query_len, key_len], the mean over heads

    bool rows_sum_to_one = true;
    for (index_t b = 0; b < batch; ++b) {
        std::cout << "weights, sentence " << b << " (source length " << source_lengths[static_cast<std::size_t>(b)]
                  << "):\n";
        for (index_t i = 0; i < target_len; ++i) {
            double sum = 0;
            std::cout << "  q" << i << ':';
            for (index_t j = 0; j < source_len; ++j) {
                std::cout << ' ' << fixed3(weights(b, i, j));
                sum += weights(b, i, j);
            }
            std::cout << '\n';
            rows_sum_to_one = rows_sum_to_one && std::abs(sum - 1.0) < 1e-12;
        }
    }
    std::cout << "every row sums to 1: " << (rows_sum_to_one ? "yes" : "NO") << '\n';
    bool padding_zero = true;
    for (index_t i = 0; i < target_len; ++i)
        for (index_t j = source_lengths[1]; j < source_len; ++j) padding_zero = padding_zero && weights(1, i, j) == 0.0;
    std::cout << "weights on source padding are exactly 0: " << (padding_zero ? "yes" : "NO") << '\n';
    const bool sees_last = weights(0, 0, source_len - 1) > 0.0;
    std::cout << "no causal mask: q0 reads source position 4: " << (sees_last ? "yes" : "NO") << '\n';

    for (index_t j = source_lengths[1]; j < source_len; ++j)
        for (index_t e = 0; e < source_dim; ++e) memory(1, j, e) = -7.0 * static_cast<double>(e + 1);
    const auto again = cross.forward(target, memory, memory, options);
    bool unchanged = true;
    for (index_t n = 0; n < r.out.size(); ++n) unchanged = unchanged && again.out.data()[n] == r.out.data()[n];
    std::cout << "outputs unchanged by what the source padding holds: " << (unchanged ? "yes" : "NO") << '\n';

    std::cout << "out, sentence 1, q0:";
    for (index_t e = 0; e < model_dim; ++e) std::cout << ' ' << fixed3(r.out(1, 0, e));
    std::cout << '\n';
    return rows_sum_to_one && padding_zero && sees_last && unchanged ? 0 : 1;
}
