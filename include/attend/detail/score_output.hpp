// SPDX-License-Identifier: MIT
#pragma once
/// The scores output (sdpa_options::need_scores, ONNX Attention's qk_matmul_output modes 0 to 2): the score of
/// every (query, key) pair at one stage of the pipeline, `[batch, heads, query_len, key_len]` in the query's
/// storage type. A pass of its own, beside the kernel: it widens a head's rows, takes Q·Kᵀ × scale in the
/// accumulation type and runs the same stage functions as the kernels (softcap, score_mod, score_bias, the mask)
/// on the result, so the scores are the kernel's within the rounding of a differently ordered dot product.

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <vector>

#include "../score_bias.hpp"
#include "../shape.hpp"
#include "kernel_interface.hpp"
#include "mask_nodes.hpp"
#include "memory.hpp"
#include "parallel_for.hpp"
#include "quantized_rows.hpp"
#include "widen.hpp"

namespace attend::detail {

/// Rows [0, dims[2]) of (b, h) of a strided view (of any storage type) or of quantized rows, widened to Acc into a
/// dense `[len, dim]` block at dst.
template <class Acc, class Rows>
void widen_head(const Rows& x, index_t b, index_t h, Acc* dst) {
    if constexpr (quantized_rows_v<Rows>) {
        widen_rows(x, b, h, 0, x.dims[2], dst);
    } else {
        for (index_t i = 0; i < x.dims[2]; ++i)
            std::transform(x.row(b, h, i), x.row(b, h, i) + x.dims[3], dst + i * x.dims[3], [](auto value) {
                // through the value's own accumulation type: Eigen's 16-bit types convert to float exactly
                return static_cast<Acc>(static_cast<accumulator_t<std::decay_t<decltype(value)>>>(value));
            });
    }
}

/// Which stages the scores output includes after Q·Kᵀ × scale.
struct score_stages {
    bool softcap = false;  ///< the softcap, when the call has one
    bool masked = false;   ///< score_mod, score_bias and the mask (-inf where forbidden, every key of a padded query)
};

/// The scratch of the scores pass, allocated before the call writes anything (so a failed allocation is
/// resource_error attend.resource.allocation with nothing written), then the pass itself.
template <class T>
class score_writer {
public:
    using Acc = accumulator_t<T>;
    static constexpr index_t block_queries = 64;  ///< queries per unit of work

    score_writer(const attention_shape& s, int threads) : s_(s) {
        const index_t rows = std::min(block_queries, s.query_len);
        units_ = s.batch * s.heads * ((s.query_len + block_queries - 1) / block_queries);
        workers_ = static_cast<int>(std::max<index_t>(1, std::min<index_t>(threads, units_)));
        // per worker: a block of queries, the head's keys and the block's scores, in Acc
        per_worker_ = rows * s.head_dim + s.key_len * s.head_dim + rows * s.key_len;
        const std::array<index_t, 2> dims{workers_, per_worker_};
        scratch_ = allocating([&] { return std::vector<Acc>(static_cast<std::size_t>(workers_ * per_worker_)); },
                              [&] { return allocation_text("the scores pass's scratch", dims, sizeof(Acc)); },
                              "need_scores widens a block of queries and a head's keys per thread; use fewer threads "
                              "or a shorter key_len");
    }

    /// scores[b, h, i, j] for every pair, at the given stages.
    template <class Rows>
    void write(const strided_view<const T>& q, const Rows& k, const mask_tiles& mask, const kernel_params<Acc>& p,
               score_stages stages, T* scores) {
        const index_t L = s_.query_len, S = s_.key_len, D = s_.head_dim;
        const index_t blocks = (L + block_queries - 1) / block_queries;
        parallel_for(units_, workers_, [&](index_t unit, int worker) {
            const index_t bh = unit / blocks, b = bh / s_.heads, h = bh % s_.heads;
            const index_t i0 = (unit % blocks) * block_queries, rows = std::min(block_queries, L - i0);
            Acc* const queries = scratch_.data() + worker * per_worker_;
            Acc* const keys = queries + std::min(block_queries, L) * D;
            Acc* const block = keys + S * D;
            for (index_t r = 0; r < rows; ++r)
                std::transform(q.row(b, h, i0 + r), q.row(b, h, i0 + r) + D, queries + r * D,
                               [](T value) { return static_cast<Acc>(value); });
            widen_head(k, b, s_.kv_head(h), keys);
            using matrix = Eigen::Map<row_matrix<Acc>>;
            using const_matrix = Eigen::Map<const row_matrix<Acc>>;
            matrix(block, rows, S).noalias() = const_matrix(queries, rows, D) * const_matrix(keys, S, D).transpose();
            matrix(block, rows, S) *= p.scale;
            if (stages.softcap && p.softcap > 0)
                for (index_t j = 0; j < rows * S; ++j) block[j] = p.softcap * std::tanh(block[j] / p.softcap);
            if (stages.masked) {
                const tile t{b, h, i0, i0 + rows, 0, S};
                if (p.score_mod) p.score_mod->apply(t, block, S, nullptr);
                if (p.bias && !p.bias->empty()) p.bias->add_tile(h, i0, 0, rows, S, L, S, block, S);
                mask.apply(t, block, S);
                for (index_t r = 0; r < rows; ++r)
                    if (mask.query_padded(b, i0 + r))
                        std::fill(block + r * S, block + (r + 1) * S, minus_infinity<Acc>());
            }
            narrow(block, rows * S, scores + ((b * s_.heads + h) * L + i0) * S);
        });
    }

private:
    attention_shape s_;
    index_t units_ = 0;
    int workers_ = 1;
    index_t per_worker_ = 0;
    std::vector<Acc> scratch_;
};

}  // namespace attend::detail
