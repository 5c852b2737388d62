// SPDX-License-Identifier: MIT
#pragma once
/// The tiled kernel's two products on bfloat16 pairs, for targets with AVX-512 BF16 (vdpbf16ps: 16 float lanes,
/// each adding the two products of a pair of bf16 values). A bf16 product is exact in float (8 x 8 significant
/// bits), so the sums are float sums of exact products, as in micro_kernel.hpp, in pairs:
///   scores = scale (Q Kᵀ)  Q's rows as they are stored, keys packed into panels of 32 keys x pairs of dimensions;
///   acc   += P V           P rounded to bf16 once (as PyTorch's bf16 CPU flash kernel and oneDNN do), values packed
///                          into column blocks of 32 x pairs of keys.
/// Each output element is one sum over the inner dimension in ascending pairs, of the same operations whatever the
/// row group or column block it falls in, so a result depends on the shape only. The instruction treats subnormal
/// bf16 inputs and float results as zero: magnitudes below 2^-126, far under what a score or a weight can change.
/// Without AVX-512 BF16 (bf16_dot_products false) nothing here is compiled and bf16 widens to float instead.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include <Eigen/Core>

#include "../tensor.hpp"
#include "memory.hpp"
#include "micro_kernel.hpp"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
#include <immintrin.h>
#define ATTEND_BF16_DOT_PRODUCTS 1
#else
#define ATTEND_BF16_DOT_PRODUCTS 0
#endif

namespace attend::detail {

/// Whether this target computes bf16 attention's products on bf16 pairs (compile time, from the target flags).
inline constexpr bool bf16_dot_products = ATTEND_BF16_DOT_PRODUCTS != 0;

/// Sizes of the pair micro-tiles: rows x 32 columns (two packets of 16 float lanes), 24 accumulators, which with
/// two loads and a broadcast fit AVX-512's 32 vector registers.
struct bf16_tile {
    static constexpr index_t lanes = 16;
    static constexpr index_t cols = 32;  ///< keys per key panel, value columns per block
    static constexpr index_t rows = 12;  ///< query rows per micro-tile
    /// 32-bit words (pairs) of a key tile's panels: keys rounded up to whole panels, times head_dim / 2.
    static index_t key_panel_words(index_t keys, index_t head_dim) {
        return (keys + cols - 1) / cols * cols * (head_dim / 2);
    }
    /// Words of a value tile's blocks: keys rounded up to pairs, times value_dim (whole blocks only).
    static index_t value_panel_words(index_t keys, index_t value_dim) { return (keys + 1) / 2 * value_dim; }
    /// Words of a row of P rounded to pairs: keys rounded up to pairs, halved (a zero after an odd last key).
    static index_t probability_row_words(index_t keys) { return (keys + 1) / 2; }
};

/// Scratch of the pair path, in 32-bit words (pairs of bf16): empty unless a call takes it.
struct pair_scratch {
    aligned_vector<std::uint32_t> queries;        ///< [rows, head_dim / 2]: the block's query rows as stored
    aligned_vector<std::uint32_t> keys;           ///< key_panel_words(key_tile, head_dim)
    aligned_vector<std::uint32_t> values;         ///< value_panel_words(key_tile, value_dim)
    aligned_vector<std::uint32_t> probabilities;  ///< [rows, probability_row_words(key_tile)]: P in bf16
};

// The pair path's functions, declared for every target: the tiled kernel names them in branches that targets
// without AVX-512 BF16 discard at compile time, and only those with it define them (below).
inline std::uint32_t pair_at(const Eigen::bfloat16* x);
inline void pack_key_pairs(const Eigen::bfloat16* keys, index_t ld, index_t nk, index_t head_dim,
                           std::uint32_t* panels);
inline void pack_value_pairs(const Eigen::bfloat16* v, index_t ld, index_t nk, index_t dv, std::uint32_t* panels);
inline void round_to_pairs(const float* p, index_t ldp, index_t rows, index_t nk, std::uint32_t* out, index_t ldo);
template <class Epilogue>
void scores_from_key_pairs(const std::uint32_t* q, index_t ldq, index_t rows, index_t head_dim,
                           const std::uint32_t* panels, index_t nk, float scale, float* scores, index_t lds,
                           const Epilogue& epilogue);
inline void accumulate_from_value_pairs(const std::uint32_t* p, index_t ldp, index_t rows, index_t nk, index_t dv,
                                        const std::uint32_t* blocks, index_t block_stride, float* acc, index_t lda);

#if ATTEND_BF16_DOT_PRODUCTS

static_assert(micro_tile<float>::lanes == bf16_tile::lanes, "pack_key_pairs transposes words as float packets");

/// The 32-bit word holding x[0] and x[1] (x[0] in the low half, as vdpbf16ps pairs them).
inline std::uint32_t pair_at(const Eigen::bfloat16* x) {
    std::uint32_t w;
    std::memcpy(&w, x, 4);
    return w;
}

/// Keys [nk, head_dim] bf16 (rows at `ld`, head_dim even) into panels of 32 keys, each [head_dim / 2, 32] words:
/// word (x, c) is key c's dimensions 2x and 2x + 1, so a packet loads one pair of dimensions of 16 consecutive keys.
/// The last panel is padded with zero keys. Squares of 16 keys x 16 pairs are transposed in registers, as floats
/// (Eigen's ptranspose moves 32-bit lanes, whatever they hold), where the rows are a whole number of words apart.
inline void pack_key_pairs(const Eigen::bfloat16* keys, index_t ld, index_t nk, index_t head_dim,
                           std::uint32_t* panels) {
    constexpr index_t lanes = bf16_tile::lanes, nr = bf16_tile::cols;
    const index_t pairs = head_dim / 2, square_pairs = pairs / lanes * lanes;
    for (index_t p0 = 0; p0 < nk; p0 += nr) {
        std::uint32_t* panel = panels + p0 * pairs;
        for (index_t c0 = 0; c0 < nr; c0 += lanes) {
            const index_t present = std::clamp<index_t>(nk - p0 - c0, 0, lanes);
            const Eigen::bfloat16* first = keys + (p0 + c0) * ld;
            index_t x = 0;
            if (present == lanes && ld % 2 == 0)  // words of 16 keys x 16 pairs: a float transpose of the bits
                for (; x < square_pairs; x += lanes)
                    transpose_square<float>(reinterpret_cast<const float*>(first + 2 * x), ld / 2,
                                            reinterpret_cast<float*>(panel + x * nr + c0), nr);
            for (; x < pairs; ++x)
                for (index_t c = 0; c < lanes; ++c)
                    panel[x * nr + c0 + c] = c < present ? pair_at(first + c * ld + 2 * x) : 0u;
        }
    }
}

/// Values [nk, dv] bf16 (rows at `ld`, dv a multiple of 32) into column blocks of 32, block b at
/// panels + b * ((nk + 1) / 2) * 32 words, [pairs of keys, 32]: word (j, e) is values 2j and 2j + 1 of column e (a
/// zero value after an odd last key).
inline void pack_value_pairs(const Eigen::bfloat16* v, index_t ld, index_t nk, index_t dv, std::uint32_t* panels) {
    const index_t pairs = (nk + 1) / 2;
    // Interleaves 32 columns of two rows into 32 words: the first 16 from columns 0..15, the next from 16..31.
    alignas(64) static constexpr std::uint16_t first_half[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                                 37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                                 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    alignas(64) static constexpr std::uint16_t second_half[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21,
                                                                  53, 22, 54, 23, 55, 24, 56, 25, 57, 26, 58,
                                                                  27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
    const __m512i lo_index = _mm512_load_si512(first_half), hi_index = _mm512_load_si512(second_half);
    for (index_t e0 = 0; e0 < dv; e0 += bf16_tile::cols) {
        std::uint32_t* block = panels + (e0 / bf16_tile::cols) * pairs * bf16_tile::cols;
        for (index_t j = 0; j < pairs; ++j) {
            const __m512i even = _mm512_loadu_si512(v + 2 * j * ld + e0);
            const __m512i odd = 2 * j + 1 < nk ? _mm512_loadu_si512(v + (2 * j + 1) * ld + e0) : _mm512_setzero_si512();
            _mm512_storeu_si512(block + j * bf16_tile::cols, _mm512_permutex2var_epi16(even, lo_index, odd));
            _mm512_storeu_si512(block + j * bf16_tile::cols + 16, _mm512_permutex2var_epi16(even, hi_index, odd));
        }
    }
}

/// Masks of the first n of 32 lanes (n from 1 to 32) over two packets of 16: the low packet's and the high one's.
inline std::pair<__mmask16, __mmask16> first_lanes(index_t n) {
    return {static_cast<__mmask16>(n >= 16 ? 0xffff : (1u << n) - 1),
            static_cast<__mmask16>(n >= 32   ? 0xffff
                                   : n <= 16 ? 0
                                             : (1u << (n - 16)) - 1)};
}

/// rows x nk floats (rows at `ldp`) rounded to bf16 (to nearest even) into pairs: row r at out + r * ldo words,
/// (nk + 1) / 2 words, a zero after an odd last column.
inline void round_to_pairs(const float* p, index_t ldp, index_t rows, index_t nk, std::uint32_t* out, index_t ldo) {
    for (index_t r = 0; r < rows; ++r) {
        const float* src = p + r * ldp;
        std::uint32_t* dst = out + r * ldo;
        for (index_t j = 0; j < nk; j += 32) {
            const index_t n = std::min<index_t>(32, nk - j);
            const auto [lo_mask, hi_mask] = first_lanes(n);
            const __m512 lo = _mm512_maskz_loadu_ps(lo_mask, src + j),
                         hi = _mm512_maskz_loadu_ps(hi_mask, src + j + 16);
            const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));  // lo in the low half
            const index_t words = (n + 1) / 2;
            _mm512_mask_storeu_epi32(dst + j / 2, static_cast<__mmask16>(words >= 16 ? 0xffff : (1u << words) - 1),
                                     both);
        }
    }
}

namespace micro {

/// Rows x 32 scores of one key panel: out[r, c] = epilogue(scale * sum over pairs x of q-pair[r, x] . panel[x, c]).
template <int Rows, class Epilogue>
void score_pairs(const std::uint32_t* q, index_t ldq, index_t pairs, const std::uint32_t* panel, float scale,
                 float* out, index_t ldo, const Epilogue& epilogue) {
    __m512 lo[Rows], hi[Rows];
    ATTEND_UNROLL_FULLY
    for (int r = 0; r < Rows; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
    for (index_t x = 0; x < pairs; ++x) {
        const __m512bh k0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(panel + x * bf16_tile::cols));
        const __m512bh k1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(panel + x * bf16_tile::cols + 16));
        ATTEND_UNROLL_FULLY
        for (int r = 0; r < Rows; ++r) {
            const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(q[r * ldq + x])));
            lo[r] = _mm512_dpbf16_ps(lo[r], a, k0);
            hi[r] = _mm512_dpbf16_ps(hi[r], a, k1);
        }
    }
    const __m512 s = _mm512_set1_ps(scale);
    ATTEND_UNROLL_FULLY
    for (int r = 0; r < Rows; ++r) {
        _mm512_storeu_ps(out + r * ldo, epilogue(_mm512_mul_ps(s, lo[r])));
        _mm512_storeu_ps(out + r * ldo + 16, epilogue(_mm512_mul_ps(s, hi[r])));
    }
}

/// acc[r, 0 : 32) += sum over pairs j of p-pair[r, j] . block[j, 0 : 32).
template <int Rows>
void accumulate_pairs(const std::uint32_t* p, index_t ldp, index_t pairs, const std::uint32_t* block, float* acc,
                      index_t lda) {
    __m512 c0[Rows], c1[Rows];
    ATTEND_UNROLL_FULLY
    for (int r = 0; r < Rows; ++r) {
        c0[r] = _mm512_loadu_ps(acc + r * lda);
        c1[r] = _mm512_loadu_ps(acc + r * lda + 16);
    }
    for (index_t j = 0; j < pairs; ++j) {
        const __m512bh v0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(block + j * bf16_tile::cols));
        const __m512bh v1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(block + j * bf16_tile::cols + 16));
        ATTEND_UNROLL_FULLY
        for (int r = 0; r < Rows; ++r) {
            const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(p[r * ldp + j])));
            c0[r] = _mm512_dpbf16_ps(c0[r], a, v0);
            c1[r] = _mm512_dpbf16_ps(c1[r], a, v1);
        }
    }
    ATTEND_UNROLL_FULLY
    for (int r = 0; r < Rows; ++r) {
        _mm512_storeu_ps(acc + r * lda, c0[r]);
        _mm512_storeu_ps(acc + r * lda + 16, c1[r]);
    }
}

/// The kernels above for a row group of 1 to bf16_tile::rows rows, so its size is a constant inside them.
template <class Epilogue>
auto score_pairs_for(index_t rows) {
    constexpr auto table = by_row_count(std::make_integer_sequence<int, bf16_tile::rows>{},
                                        [](auto n) { return &score_pairs<decltype(n)::value, Epilogue>; });
    return table[static_cast<std::size_t>(rows - 1)];
}
inline auto accumulate_pairs_for(index_t rows) {
    constexpr auto table = by_row_count(std::make_integer_sequence<int, bf16_tile::rows>{},
                                        [](auto n) { return &accumulate_pairs<decltype(n)::value>; });
    return table[static_cast<std::size_t>(rows - 1)];
}

}  // namespace micro

/// scores[rows, nk] (rows at `lds`) = scale times q-pairs[rows, head_dim / 2] (rows at `ldq` words) against the keys
/// packed by pack_key_pairs, each packet through `epilogue` before it is stored; a partial last panel goes through
/// a panel-sized buffer, so nothing is written past column nk.
template <class Epilogue>
void scores_from_key_pairs(const std::uint32_t* q, index_t ldq, index_t rows, index_t head_dim,
                           const std::uint32_t* panels, index_t nk, float scale, float* scores, index_t lds,
                           const Epilogue& epilogue) {
    using bt = bf16_tile;
    const index_t pairs = head_dim / 2;
    alignas(64) float edge[bt::rows * bt::cols];
    for (index_t p0 = 0; p0 < nk; p0 += bt::cols) {
        const std::uint32_t* panel = panels + p0 * pairs;
        const index_t n = std::min(bt::cols, nk - p0);
        for_each_row_group(rows, bt::rows, [&](index_t r0, index_t m) {
            float* out = n == bt::cols ? scores + r0 * lds + p0 : edge;
            const index_t ldo = n == bt::cols ? lds : bt::cols;
            micro::score_pairs_for<Epilogue>(m)(q + r0 * ldq, ldq, pairs, panel, scale, out, ldo, epilogue);
            if (n < bt::cols)
                for (index_t r = 0; r < m; ++r)
                    std::copy(edge + r * bt::cols, edge + r * bt::cols + n, scores + (r0 + r) * lds + p0);
        });
    }
}

/// acc[rows, dv] (rows at `lda`) += p-pairs[rows, (nk + 1) / 2] (rows at `ldp` words) times the values packed by
/// pack_value_pairs (blocks `block_stride` words apart, starting at an even key). Keys go by in slices whose block
/// part stays in L1 while every row group reads it (16 KiB).
inline void accumulate_from_value_pairs(const std::uint32_t* p, index_t ldp, index_t rows, index_t nk, index_t dv,
                                        const std::uint32_t* blocks, index_t block_stride, float* acc, index_t lda) {
    using bt = bf16_tile;
    const index_t pairs = (nk + 1) / 2, slice = 16384 / static_cast<index_t>(4 * bt::cols);
    for (index_t j0 = 0; j0 < pairs; j0 += slice) {
        const index_t nj = std::min(slice, pairs - j0);
        for (index_t e = 0; e < dv; e += bt::cols)
            for_each_row_group(rows, bt::rows, [&](index_t r0, index_t m) {
                micro::accumulate_pairs_for(m)(p + r0 * ldp + j0, ldp, nj,
                                               blocks + (e / bt::cols) * block_stride + j0 * bt::cols,
                                               acc + r0 * lda + e, lda);
            });
    }
}

#endif  // ATTEND_BF16_DOT_PRODUCTS

}  // namespace attend::detail
