// SPDX-License-Identifier: MIT
#pragma once
/// Attention dropout as a pure function of (seed, batch, head, query, key): a counter-based generator, so the
/// same seed drops the same weights for any thread count, tile size or kernel, and backward can replay it.

#include <cstdint>

#include "../tensor.hpp"
#include "random.hpp"

namespace attend::detail {

/// A uniform double in [0, 1) for one position of the weight tensor `[batch, heads, query_len, key_len]`.
inline double dropout_uniform(std::uint64_t seed, index_t b, index_t h, index_t i, index_t j) {
    return counter_uniform(seed, 0x9e3779b97f4a7c15ULL, b, h, i, j);
}

/// Keeps a weight with probability 1 - p. The offsets place a call's queries and keys in a longer sequence
/// (a shard of ring attention), so a block of that sequence drops exactly what the whole would drop there.
struct dropout_rule {
    std::uint64_t seed = 0;
    double probability = 0;
    double keep_scale = 1;     ///< 1 / (1 - p), applied to kept weights
    index_t query_offset = 0;  ///< position of the call's query 0 in the sequence the decisions are drawn for
    index_t key_offset = 0;    ///< position of the call's key 0 in that sequence

    bool active() const { return probability > 0; }
    bool keep(index_t b, index_t h, index_t i, index_t j) const {
        return dropout_uniform(seed, b, h, i + query_offset, j + key_offset) >= probability;
    }

    /// The one application of dropout in the tiled kernels: probabilities p[0, n) of query i against keys
    /// [j0, j0 + n) of (b, h) become p / (1 - probability) where kept and 0 where dropped. Zeros stay zeros
    /// without drawing (forbidden keys cost nothing).
    template <class Acc>
    void apply(Acc* p, index_t n, index_t b, index_t h, index_t i, index_t j0) const {
        const Acc scale = static_cast<Acc>(keep_scale);
        for (index_t j = 0; j < n; ++j)
            if (p[j] != Acc(0)) p[j] = keep(b, h, i, j0 + j) ? p[j] * scale : Acc(0);
    }

    /// The factors apply multiplies by, 1 / (1 - probability) or 0, for every key of the run (the backward
    /// multiplies dP by the same factors).
    template <class Acc>
    void factors(Acc* f, index_t n, index_t b, index_t h, index_t i, index_t j0) const {
        const Acc scale = static_cast<Acc>(keep_scale);
        for (index_t j = 0; j < n; ++j) f[j] = keep(b, h, i, j0 + j) ? scale : Acc(0);
    }
};

}  // namespace attend::detail
