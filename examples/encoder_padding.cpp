// SPDX-License-Identifier: MIT
// An encoder self-attention over a padded batch: two sequences of lengths 4 and 2 stored as [batch 2, len 4,
// model_dim 8]. Key padding keeps every real query from reading padded keys; query padding zeroes the padded
// queries' outputs, which masking keys alone never does. The real outputs do not depend on what the padding
// positions hold.
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include <attend/mha.hpp>

namespace {

/// Fixed 4-decimal text; "-0.0000" is printed as "0.0000" so the output is stable.
std::string fixed4(double x) {
    char buffer[32];
    std::snprintf(buffer, sizeof buffer, "%.4f", x);
    const std::string s = buffer;
    return s == "-0.0000" ? "0.0000" : s;
}

void print_rows(const attend::tensor<double, 3>& t, attend::index_t b, const char* what) {
    std::cout << what << " (sequence " << b << "):\n";
    for (attend::index_t i = 0; i < t.dimension(1); ++i) {
        std::cout << "  q" << i << ':';
        for (attend::index_t j = 0; j < t.dimension(2); ++j) std::cout << ' ' << fixed4(t(b, i, j));
        std::cout << '\n';
    }
}

}  // namespace

int main() {
    using attend::index_t;
    const index_t batch = 2, len = 4, model_dim = 8;
    const std::vector<index_t> lengths{4, 2};
    const attend::multi_head_attention<double> encoder({model_dim, 2}, /*seed*/ 7);

    // Token features: exact small fractions, so the input is the same everywhere.
    attend::tensor<double, 3> x(batch, len, model_dim);
    for (index_t b = 0; b < batch; ++b)
        for (index_t i = 0; i < len; ++i)
            for (index_t e = 0; e < model_dim; ++e)
                x(b, i, e) = i < lengths[static_cast<std::size_t>(b)]
                                 ? static_cast<double>((b * 31 + i * 17 + e * 7) % 11 - 5) / 5.0
                                 : 0.0;

    attend::mha_options options;
    options.key_padding = lengths;  // keys j >= lengths[b] are ignored (nn.MultiheadAttention's key_padding_mask)
    options.attention.need_weights = true;  // averaged over heads, [batch, query_len, key_len]
    const auto padded_queries = attend::query_padding(lengths);

    std::cout << "allowed keys:\n"
              << attend::to_string(attend::key_padding(lengths) && padded_queries, {batch, 1, len, len});

    const auto r = encoder.forward(x, x, x, padded_queries, options);
    print_rows(r.averaged_weights(), 1, "weights");
    print_rows(r.out, 1, "out");

    bool padded_zero = true;
    for (index_t i = lengths[1]; i < len; ++i)
        for (index_t e = 0; e < model_dim; ++e) padded_zero = padded_zero && r.out(1, i, e) == 0.0;
    std::cout << "padded queries are zero: " << (padded_zero ? "yes" : "NO") << '\n';

    // Fill the padding with garbage: the real queries must not notice.
    for (index_t i = lengths[1]; i < len; ++i)
        for (index_t e = 0; e < model_dim; ++e) x(1, i, e) = 100.0 + static_cast<double>(e);
    const auto again = encoder.forward(x, x, x, padded_queries, options);
    bool unchanged = true;
    for (index_t b = 0; b < batch; ++b)
        for (index_t i = 0; i < len; ++i)
            for (index_t e = 0; e < model_dim; ++e) unchanged = unchanged && again.out(b, i, e) == r.out(b, i, e);
    std::cout << "outputs unchanged by what the padding holds: " << (unchanged ? "yes" : "NO") << '\n';

    // Without query padding the padded rows are not zero: key padding alone does not remove padded queries.
    const auto keys_only = encoder.forward(x, x, x, options);
    std::cout << "without query_padding, padded query q3 of sequence 1 starts " << fixed4(keys_only.out(1, 3, 0))
              << ", not zero\n";
    return padded_zero && unchanged ? 0 : 1;
}
