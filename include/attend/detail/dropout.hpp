#pragma once
/// Attention dropout as a pure function of (seed, batch, head, query, key): a counter-based generator, so the
/// same seed drops the same weights for any thread count, tile size or kernel, and backward can replay it.

#include <cstdint>

#include "../tensor.hpp"

namespace attend::detail {

/// SplitMix64's finalizer: a bijective mix with full avalanche.
inline std::uint64_t mix64(std::uint64_t x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
}

/// A uniform double in [0, 1) for one position of the weight tensor `[batch, heads, query_len, key_len]`.
inline double dropout_uniform(std::uint64_t seed, index b, index h, index i, index j) {
    std::uint64_t x = mix64(seed ^ 0x9e3779b97f4a7c15ULL);
    x = mix64(x ^ static_cast<std::uint64_t>(b));
    x = mix64(x ^ static_cast<std::uint64_t>(h));
    x = mix64(x ^ static_cast<std::uint64_t>(i));
    x = mix64(x ^ static_cast<std::uint64_t>(j));
    return static_cast<double>(x >> 11) * 0x1.0p-53;
}

/// Keeps a weight with probability 1 - p.
struct dropout_rule {
    std::uint64_t seed = 0;
    double probability = 0;
    double keep_scale = 1;  ///< 1 / (1 - p), applied to kept weights

    bool active() const { return probability > 0; }
    bool keep(index b, index h, index i, index j) const {
        return dropout_uniform(seed, b, h, i, j) >= probability;
    }
};

}  // namespace attend::detail
