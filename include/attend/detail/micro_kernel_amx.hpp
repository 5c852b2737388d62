// SPDX-License-Identifier: MIT
#pragma once
/// The bf16 pair path's two products on AMX tiles (Intel Sapphire Rapids and later, where the target has AMX-BF16
/// and Linux lets the process use the tile registers). There vdpbf16ps gives half the products a second of float
/// multiply-adds (a bf16 prefill on the pair kernels of micro_kernel_bf16.hpp took 1.9 x the float prefill's time
/// on Emerald Rapids), while one tdpbf16ps multiplies a 16 x 32 bf16 tile by a 32 x 16 one into 16 x 16 float sums.
/// Same operands, same layouts as micro_kernel_bf16.hpp (the packed key panels and value blocks are tiles' rows as
/// they stand), same arithmetic: each product of two bf16 values is exact in float, each output element one float
/// sum over the inner dimension in ascending pairs, subnormal inputs and results taken as zero. Whether two products
/// of a pair are added to the sum one after the other or together is the hardware's (bits may differ from the
/// vdpbf16ps kernels in the last place); a result still depends on the shape only, not on the rows or columns that
/// share a call, so it is the same for any thread count.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "micro_kernel_bf16.hpp"

#if ATTEND_BF16_DOT_PRODUCTS && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define ATTEND_AMX_TARGET 1
#else
#define ATTEND_AMX_TARGET 0
#endif
#if ATTEND_AMX_TARGET && defined(__linux__) && !defined(ATTEND_NO_AMX)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define ATTEND_AMX_TILES 1
#else
#define ATTEND_AMX_TILES 0
#endif

namespace attend::detail {

/// Whether this target was compiled with AMX-BF16 (compile time). On such a target the pair path runs on tiles or
/// not at all: vdpbf16ps there is slower than the float kernels.
inline constexpr bool amx_target = ATTEND_AMX_TARGET != 0;
/// Whether the tile kernels below are compiled: an AMX target on Linux, unless ATTEND_NO_AMX is defined.
inline constexpr bool amx_tiles = ATTEND_AMX_TILES != 0;

/// Whether this process may use the tile registers: Linux grants them on request (arch_prctl
/// ARCH_REQ_XCOMP_PERM for XTILEDATA, Linux 5.16 and later), asked once per process, by the first bf16 call that
/// would take them. Once granted, signal frames carry the tile state (8 KiB): docs/engine.md.
inline bool amx_tiles_ready() {
#if ATTEND_AMX_TILES
    static const bool ready = [] {
        constexpr long request_permission = 0x1023, tile_data = 18;
        return syscall(SYS_arch_prctl, request_permission, tile_data) == 0;
    }();
    return ready;
#else
    return false;
#endif
}

/// Whether bf16 slabs of many rows with these dimensions take the pair path (micro_kernel_bf16.hpp) on this target
/// and machine: AVX-512 BF16, an even head_dim and whole blocks of 32 value columns; on an AMX target, tiles
/// compiled and granted and head_dim a whole number of tiles' 32 values.
inline bool bf16_pairs_for(index_t head_dim, index_t value_dim) {
    if (!bf16_dot_products || head_dim % 2 != 0 || value_dim % bf16_tile::cols != 0) return false;
    return !amx_target || (head_dim % 32 == 0 && amx_tiles_ready());
}

/// The pair path's two products on this target, as bf16_pairs_for chose it: on AMX tiles where they are compiled,
/// else on the vdpbf16ps kernels (micro_kernel_bf16.hpp). Same operands, same layouts. Declared for every target,
/// defined where the pair path exists (the tiled kernel names them in branches other targets discard).
template <class Epilogue>
void scores_on_pair_path(const std::uint32_t* q, index_t ldq, index_t rows, index_t head_dim,
                         const std::uint32_t* panels, index_t nk, float scale, float* scores, index_t lds,
                         const Epilogue& epilogue);
inline void accumulate_on_pair_path(const std::uint32_t* p, index_t ldp, index_t rows, index_t nk, index_t dv,
                                    const std::uint32_t* blocks, index_t block_stride, float* acc, index_t lda);

// Declared for every target, defined with AMX only (the definitions of the two functions above, at the end of this
// file, and the tests name them in branches other targets discard).
template <class Epilogue>
void scores_from_key_tiles(const std::uint32_t* q, index_t ldq, index_t rows, index_t head_dim,
                           const std::uint32_t* panels, index_t nk, float scale, float* scores, index_t lds,
                           const Epilogue& epilogue);
inline void accumulate_from_value_tiles(const std::uint32_t* p, index_t ldp, index_t rows, index_t nk, index_t dv,
                                        const std::uint32_t* blocks, index_t block_stride, float* acc, index_t lda);

#if ATTEND_AMX_TILES

/// Tile loads and the configuration's load as asm statements that say what they read. GCC 12's intrinsics say
/// that ldtilecfg reads the first 8 bytes of its configuration and that tileloadd reads no memory at all, so the
/// stores that fill a configuration or a tile's rows just before them may be dropped or moved past them: a
/// configuration filled in a small function lost every byte after its palette, and its first tile load faulted.
#define ATTEND_TILE_LOAD(tile, base, stride)                                                       \
    __asm__ volatile("{tileloadd\t(%0,%1,1), %%tmm" #tile "|tileloadd\t%%tmm" #tile ", [%0+%1*1]}" \
                     :                                                                             \
                     : "r"(static_cast<const void*>(base)), "r"(static_cast<long>(stride))         \
                     : "memory")

namespace amx {

/// Loads a 64-byte tile configuration (see ATTEND_TILE_LOAD).
inline void load_config(const std::uint8_t (&config)[64]) {
    struct bytes64 {
        std::uint8_t b[64];
    };
    __asm__ volatile("ldtilecfg %0" : : "m"(*reinterpret_cast<const bytes64*>(config)));
}

constexpr index_t tile_rows = 16;  ///< rows of a sum tile, pairs of an operand tile's inner dimension

/// The tile configuration (palette 1) for two row groups of m1 and m2 rows (m2 0: one group) and steps of `pairs`
/// pairs: tiles 0 and 1 the first group's sums (16 float columns each), 2 and 3 the second's, 4 and 5 the groups'
/// left operands (rows x pairs 32-bit words), 6 and 7 the right operands (pairs x 16 words). Loaded only when it
/// changes (ldtilecfg zeroes the tiles); released when the kernel returns, for cheaper context switches.
class tile_config {
public:
    void use(index_t m1, index_t m2, index_t pairs) {
        if (m1 == m1_ && m2 == m2_ && pairs == pairs_) return;
        alignas(64) std::uint8_t c[64] = {};
        c[0] = 1;
        const auto set = [&](int tile, index_t rows, index_t bytes) {  // a tile of no rows stays unconfigured (zeros)
            if (rows == 0) return;
            c[48 + tile] = static_cast<std::uint8_t>(rows);
            const auto b = static_cast<std::uint16_t>(bytes);
            std::memcpy(c + 16 + 2 * tile, &b, 2);
        };
        set(0, m1, 64);
        set(1, m1, 64);
        set(2, m2, 64);
        set(3, m2, 64);
        set(4, m1, 4 * pairs);
        set(5, m2, 4 * pairs);
        set(6, pairs, 64);
        set(7, pairs, 64);
        load_config(c);
        m1_ = m1;
        m2_ = m2;
        pairs_ = pairs;
    }
    ~tile_config() {
        if (m1_ != 0) _tile_release();
    }

private:
    index_t m1_ = 0, m2_ = 0, pairs_ = 0;
};

constexpr long bytes(index_t words) { return static_cast<long>(4 * words); }

/// Calls f(r0, m1, m2) for rows [0, rows) in pairs of row groups: [r0, r0 + m1) and [r0 + m1, r0 + m1 + m2),
/// m1 = 16 unless fewer rows are left, m2 = 0 when none are. Four sums in flight hide tdpbf16ps's latency.
template <class F>
void for_each_group_pair(index_t rows, const F& f) {
    for (index_t r0 = 0; r0 < rows; r0 += 2 * tile_rows) {
        const index_t m1 = std::min(tile_rows, rows - r0);
        f(r0, m1, std::clamp<index_t>(rows - r0 - tile_rows, 0, tile_rows));
    }
}

/// One step of the configured pairs: sums 0 and 1 (and 2 and 3 for a second row group) += the groups' left rows
/// (`ldl` words apart) times the two 16-column halves of `right` ([pairs, 32] words, as bf16_tile packs them).
inline void step(const std::uint32_t* right, const std::uint32_t* left1, const std::uint32_t* left2, index_t ldl,
                 bool second_group) {
    ATTEND_TILE_LOAD(6, right, bytes(bf16_tile::cols));
    ATTEND_TILE_LOAD(7, right + 16, bytes(bf16_tile::cols));
    ATTEND_TILE_LOAD(4, left1, bytes(ldl));
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (second_group) {
        ATTEND_TILE_LOAD(5, left2, bytes(ldl));
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
}

}  // namespace amx

/// scores_from_key_pairs (micro_kernel_bf16.hpp) on tiles: scale times q-pairs[rows, head_dim / 2] (rows at `ldq`
/// words) against the packed key panels, through `epilogue` by packets; head_dim a multiple of 32.
template <class Epilogue>
void scores_from_key_tiles(const std::uint32_t* q, index_t ldq, index_t rows, index_t head_dim,
                           const std::uint32_t* panels, index_t nk, float scale, float* scores, index_t lds,
                           const Epilogue& epilogue) {
    using bt = bf16_tile;
    const index_t pairs = head_dim / 2;
    alignas(64) float sums[2 * amx::tile_rows * bt::cols];  // [32 rows, 32 keys]
    const __m512 s = _mm512_set1_ps(scale);
    amx::tile_config config;
    amx::for_each_group_pair(rows, [&](index_t r0, index_t m1, index_t m2) {
        config.use(m1, m2, amx::tile_rows);
        const std::uint32_t* q1 = q + r0 * ldq;
        const std::uint32_t* q2 = q1 + m1 * ldq;
        for (index_t p0 = 0; p0 < nk; p0 += bt::cols) {
            const std::uint32_t* panel = panels + p0 * pairs;
            _tile_zero(0);
            _tile_zero(1);
            if (m2 > 0) {
                _tile_zero(2);
                _tile_zero(3);
            }
            for (index_t x = 0; x < pairs; x += amx::tile_rows)
                amx::step(panel + x * bt::cols, q1 + x, q2 + x, ldq, m2 > 0);
            _tile_stored(0, sums, amx::bytes(bt::cols));
            _tile_stored(1, sums + 16, amx::bytes(bt::cols));
            if (m2 > 0) {
                _tile_stored(2, sums + m1 * bt::cols, amx::bytes(bt::cols));
                _tile_stored(3, sums + m1 * bt::cols + 16, amx::bytes(bt::cols));
            }
            const auto [lo, hi] = first_lanes(std::min(bt::cols, nk - p0));
            for (index_t r = 0; r < m1 + m2; ++r) {
                float* out = scores + (r0 + r) * lds + p0;
                _mm512_mask_storeu_ps(out, lo, epilogue(_mm512_mul_ps(s, _mm512_load_ps(sums + r * bt::cols))));
                _mm512_mask_storeu_ps(out + 16, hi,
                                      epilogue(_mm512_mul_ps(s, _mm512_load_ps(sums + r * bt::cols + 16))));
            }
        }
    });
}

/// accumulate_from_value_pairs (micro_kernel_bf16.hpp) on tiles: acc[rows, dv] += p-pairs[rows, (nk + 1) / 2]
/// (rows at `ldp` words) times the packed value blocks (`block_stride` words apart). Whole 16-pair steps first,
/// then the last partial step with its own configuration, so no word past the operands is read.
inline void accumulate_from_value_tiles(const std::uint32_t* p, index_t ldp, index_t rows, index_t nk, index_t dv,
                                        const std::uint32_t* blocks, index_t block_stride, float* acc, index_t lda) {
    using bt = bf16_tile;
    const index_t pairs = (nk + 1) / 2, whole = pairs / amx::tile_rows * amx::tile_rows;
    const long acc_bytes = 4 * static_cast<long>(lda);
    amx::tile_config config;
    const auto steps = [&](index_t j0, index_t j1) {  // pairs [j0, j1) of every row group and value block
        amx::for_each_group_pair(rows, [&](index_t r0, index_t m1, index_t m2) {
            config.use(m1, m2, std::min(j1 - j0, amx::tile_rows));  // whole steps, or the last partial one
            const std::uint32_t* p1 = p + r0 * ldp;
            const std::uint32_t* p2 = p1 + m1 * ldp;
            for (index_t e = 0; e < dv; e += bt::cols) {
                const std::uint32_t* block = blocks + (e / bt::cols) * block_stride;
                float* a1 = acc + r0 * lda + e;
                float* a2 = a1 + m1 * lda;
                ATTEND_TILE_LOAD(0, a1, acc_bytes);
                ATTEND_TILE_LOAD(1, a1 + 16, acc_bytes);
                if (m2 > 0) {
                    ATTEND_TILE_LOAD(2, a2, acc_bytes);
                    ATTEND_TILE_LOAD(3, a2 + 16, acc_bytes);
                }
                for (index_t j = j0; j < j1; j += amx::tile_rows)
                    amx::step(block + j * bt::cols, p1 + j, p2 + j, ldp, m2 > 0);
                _tile_stored(0, a1, acc_bytes);
                _tile_stored(1, a1 + 16, acc_bytes);
                if (m2 > 0) {
                    _tile_stored(2, a2, acc_bytes);
                    _tile_stored(3, a2 + 16, acc_bytes);
                }
            }
        });
    };
    if (whole > 0) steps(0, whole);
    if (pairs > whole) steps(whole, pairs);
}

#undef ATTEND_TILE_LOAD

#endif  // ATTEND_AMX_TILES

#if ATTEND_BF16_DOT_PRODUCTS
template <class Epilogue>
void scores_on_pair_path(const std::uint32_t* q, index_t ldq, index_t rows, index_t head_dim,
                         const std::uint32_t* panels, index_t nk, float scale, float* scores, index_t lds,
                         const Epilogue& epilogue) {
    if constexpr (amx_tiles) scores_from_key_tiles(q, ldq, rows, head_dim, panels, nk, scale, scores, lds, epilogue);
    else scores_from_key_pairs(q, ldq, rows, head_dim, panels, nk, scale, scores, lds, epilogue);
}
inline void accumulate_on_pair_path(const std::uint32_t* p, index_t ldp, index_t rows, index_t nk, index_t dv,
                                    const std::uint32_t* blocks, index_t block_stride, float* acc, index_t lda) {
    if constexpr (amx_tiles) accumulate_from_value_tiles(p, ldp, rows, nk, dv, blocks, block_stride, acc, lda);
    else accumulate_from_value_pairs(p, ldp, rows, nk, dv, blocks, block_stride, acc, lda);
}
#endif  // ATTEND_BF16_DOT_PRODUCTS

}  // namespace attend::detail
