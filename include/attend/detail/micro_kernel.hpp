// SPDX-License-Identifier: MIT
#pragma once
/// The tiled kernel's two products on register-blocked micro-tiles, written over Eigen's packet primitives (what
/// Eigen's own GEMM is built from), so the same code compiles to AVX-512, AVX2, SSE2 or NEON:
///   scores = Q Kᵀ  a block's query rows against a key tile packed once into key panels (pack_key_panels);
///   acc   += P V   the same rows' probabilities against the tile's values packed into column blocks
///                  (pack_value_panels), so a micro-tile reads them in one sequential stream.
/// Eigen's GEMM packs both operands on every call, so a per-tile GEMM re-packed Q, K, P and V once per query block
/// and key tile; here Q and P are read where they are, and K and V are packed once per block and tile.
/// Each output element is one sum over the inner dimension in ascending order, of the same operations whatever
/// the row group or column block it falls in, so a result depends on the shape and the instruction set only.

#include <algorithm>
#include <array>
#include <cstddef>
#include <type_traits>
#include <utility>

#include <Eigen/Core>

#include "../tensor.hpp"

/// Unrolls the loops over a micro-tile's rows and packets before GCC's scalar replacement runs, so the
/// accumulator arrays become registers; left to the later unrolling, they stayed arrays on the stack, zeroed by
/// memset and copied in and out around the inner loop (a tenth of a 64-deep score panel).
#if defined(__GNUC__)
#define ATTEND_UNROLL_FULLY _Pragma("GCC unroll 16")
#else
#define ATTEND_UNROLL_FULLY
#endif

namespace attend::detail {

/// Micro-tile sizes of Acc (float or double) on the target's widest packet: rows x (2 packets) accumulators, which
/// with two loads and a broadcast fit the vector registers: 12 rows (24 accumulators) in AVX-512's 32, 6 rows in
/// the 16 of AVX2, SSE2 and NEON.
template <class Acc>
struct micro_tile {
    using packet = typename Eigen::internal::packet_traits<Acc>::type;
    static constexpr index_t lanes = Eigen::internal::packet_traits<Acc>::size;
    static constexpr index_t cols = 2 * lanes;  ///< keys per key panel, value columns per micro-tile
    static constexpr index_t rows = EIGEN_ARCH_DEFAULT_NUMBER_OF_REGISTERS >= 32 ? 12
                                                                                 : 6;  ///< query rows per micro-tile
    /// Elements of a key tile's panels: keys rounded up to whole panels, times head_dim.
    static index_t panel_elements(index_t keys, index_t head_dim) { return (keys + cols - 1) / cols * cols * head_dim; }
};

/// f(r0, m) for the row groups of `rows` rows, in order, at most `tile_rows` each: whole micro-tiles, but the last
/// two halved where the last alone would be short (256 rows of 12-row tiles: 20 x 12 + 8 + 8, not 21 x 12 + 4). A
/// group of 4 rows has 8 accumulators, too few to cover the multiply-adds' latency, and ran at about 0.7 of a 12-row
/// group's rate. Which group a row falls in changes no bit of it.
template <class F>
void for_each_row_group(index_t rows, index_t tile_rows, const F& f) {
    for (index_t r0 = 0; r0 < rows;) {
        const index_t left = rows - r0;
        const index_t m = left > tile_rows && left < tile_rows + tile_rows * 2 / 3 ? (left + 1) / 2
                                                                                   : std::min(tile_rows, left);
        f(r0, m);
        r0 += m;
    }
}

/// to[c, r] = from[r, c] for a square of lanes x lanes (rows at `ld_from`, `ld_to`), in registers: Eigen's
/// ptranspose. (A packet's vector attributes are not part of PacketBlock's type, which GCC warns about.)
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wignored-attributes"
#endif
template <class Acc>
void transpose_square(const Acc* from, index_t ld_from, Acc* to, index_t ld_to) {
    using namespace Eigen::internal;
    using packet = typename micro_tile<Acc>::packet;
    constexpr index_t lanes = micro_tile<Acc>::lanes;
    PacketBlock<packet, static_cast<int>(lanes)> block;
    for (index_t r = 0; r < lanes; ++r) block.packet[r] = ploadu<packet>(from + r * ld_from);
    ptranspose(block);
    for (index_t c = 0; c < lanes; ++c) pstoreu(to + c * ld_to, block.packet[c]);
}
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

/// Keys [nk, head_dim] (rows at `ld`) into panels of micro_tile::cols keys, each laid out [head_dim, cols] so a
/// packet loads one dimension of consecutive keys; the last panel is padded with zero keys. Square blocks of
/// lanes keys x lanes dimensions are transposed in registers (Eigen's ptranspose); the edges element by element.
template <class Acc>
void pack_key_panels(const Acc* keys, index_t ld, index_t nk, index_t head_dim, Acc* panels) {
    constexpr index_t lanes = micro_tile<Acc>::lanes, nr = micro_tile<Acc>::cols;
    const index_t square_dims = head_dim / lanes * lanes;
    for (index_t p0 = 0; p0 < nk; p0 += nr) {
        Acc* panel = panels + p0 * head_dim;
        for (index_t c0 = 0; c0 < nr; c0 += lanes) {  // lanes keys of the panel at a time
            const index_t present = std::clamp<index_t>(nk - p0 - c0, 0, lanes);
            const Acc* first = keys + (p0 + c0) * ld;
            index_t x = 0;
            if (present == lanes)
                for (; x < square_dims; x += lanes) transpose_square<Acc>(first + x, ld, panel + x * nr + c0, nr);
            for (; x < head_dim; ++x)
                for (index_t c = 0; c < lanes; ++c) panel[x * nr + c0 + c] = c < present ? first[c * ld + x] : Acc(0);
        }
    }
}

namespace micro {

template <class Acc>
using packet_of = typename micro_tile<Acc>::packet;

/// What score_panel does to each packet of dot products before storing it: nothing (the scores pipeline's
/// first step, soft-capping, passes its own, so the cap costs no pass over the tile).
struct keep_products {
    template <class Packet>
    const Packet& operator()(const Packet& p) const {
        return p;
    }
};

/// Rows x cols scores of one key panel: out[r, c] = epilogue(sum over x of q[r, x] * panel[x, c]).
template <int Rows, class Acc, class Epilogue>
void score_panel(const Acc* q, index_t ldq, index_t head_dim, const Acc* panel, Acc* out, index_t ldo,
                 const Epilogue& epilogue) {
    using namespace Eigen::internal;
    using packet = packet_of<Acc>;
    constexpr index_t lanes = micro_tile<Acc>::lanes, nr = micro_tile<Acc>::cols;
    packet lo[Rows], hi[Rows];
    ATTEND_UNROLL_FULLY
    for (int r = 0; r < Rows; ++r) lo[r] = hi[r] = pset1<packet>(Acc(0));
    for (index_t x = 0; x < head_dim; ++x) {
        const packet k0 = ploadu<packet>(panel + x * nr), k1 = ploadu<packet>(panel + x * nr + lanes);
        ATTEND_UNROLL_FULLY
        for (int r = 0; r < Rows; ++r) {
            const packet a = pset1<packet>(q[r * ldq + x]);
            lo[r] = pmadd(a, k0, lo[r]);
            hi[r] = pmadd(a, k1, hi[r]);
        }
    }
    ATTEND_UNROLL_FULLY
    for (int r = 0; r < Rows; ++r) {
        pstoreu(out + r * ldo, epilogue(lo[r]));
        pstoreu(out + r * ldo + lanes, epilogue(hi[r]));
    }
}

/// acc[r, 0 : Packets * lanes) += sum over j < nk of p[r, j] * v[j, 0 : Packets * lanes).
template <int Rows, int Packets, class Acc>
void accumulate_values(const Acc* p, index_t ldp, index_t pcs, index_t nk, const Acc* v, index_t ldv, Acc* acc,
                       index_t lda) {
    using namespace Eigen::internal;
    using packet = packet_of<Acc>;
    constexpr index_t lanes = micro_tile<Acc>::lanes;
    packet c[Rows][Packets];
    ATTEND_UNROLL_FULLY
    for (int r = 0; r < Rows; ++r) {
        ATTEND_UNROLL_FULLY
        for (int i = 0; i < Packets; ++i) c[r][i] = ploadu<packet>(acc + r * lda + i * lanes);
    }
    for (index_t j = 0; j < nk; ++j) {
        packet value[Packets];
        ATTEND_UNROLL_FULLY
        for (int i = 0; i < Packets; ++i) value[i] = ploadu<packet>(v + j * ldv + i * lanes);
        ATTEND_UNROLL_FULLY
        for (int r = 0; r < Rows; ++r) {
            const packet a = pset1<packet>(p[r * ldp + j * pcs]);
            ATTEND_UNROLL_FULLY
            for (int i = 0; i < Packets; ++i) c[r][i] = pmadd(a, value[i], c[r][i]);
        }
    }
    ATTEND_UNROLL_FULLY
    for (int r = 0; r < Rows; ++r) {
        ATTEND_UNROLL_FULLY
        for (int i = 0; i < Packets; ++i) pstoreu(acc + r * lda + i * lanes, c[r][i]);
    }
}

/// A table of f(integral_constant<int, n>) for n = 1 .. sizeof...(N).
template <int... N, class F>
constexpr auto by_row_count(std::integer_sequence<int, N...>, F f) {
    return std::array<decltype(f(std::integral_constant<int, 1>{})), sizeof...(N)>{
        f(std::integral_constant<int, N + 1>{})...};
}

/// The kernels above for a row group of 1 to micro_tile rows, so its size is a constant inside them.
template <class Acc, class Epilogue>
auto score_panel_for(index_t rows) {
    constexpr auto table = by_row_count(std::make_integer_sequence<int, static_cast<int>(micro_tile<Acc>::rows)>{},
                                        [](auto n) { return &score_panel<decltype(n)::value, Acc, Epilogue>; });
    return table[static_cast<std::size_t>(rows - 1)];
}
template <int Packets, class Acc>
auto accumulate_values_for(index_t rows) {
    constexpr auto table = by_row_count(std::make_integer_sequence<int, static_cast<int>(micro_tile<Acc>::rows)>{},
                                        [](auto n) { return &accumulate_values<decltype(n)::value, Packets, Acc>; });
    return table[static_cast<std::size_t>(rows - 1)];
}

}  // namespace micro

/// scores[rows, nk] (rows at `lds`) = q[rows, head_dim] (rows at `ldq`) times the keys packed by pack_key_panels,
/// each packet passed through `epilogue` (a function of one packet) before it is stored. A partial last panel
/// goes through a panel-sized buffer, so nothing is written past column nk.
template <class Acc, class Epilogue = micro::keep_products>
void scores_from_panels(const Acc* q, index_t ldq, index_t rows, index_t head_dim, const Acc* panels, index_t nk,
                        Acc* scores, index_t lds, const Epilogue& epilogue = {}) {
    using mt = micro_tile<Acc>;
    alignas(64) Acc edge[mt::rows * mt::cols];
    for (index_t p0 = 0; p0 < nk; p0 += mt::cols) {  // a panel stays in L1 while every row group uses it
        const Acc* panel = panels + p0 * head_dim;
        const index_t n = std::min(mt::cols, nk - p0);
        for_each_row_group(rows, mt::rows, [&](index_t r0, index_t m) {
            Acc* out = n == mt::cols ? scores + r0 * lds + p0 : edge;
            const index_t ldo = n == mt::cols ? lds : mt::cols;
            micro::score_panel_for<Acc, Epilogue>(m)(q + r0 * ldq, ldq, head_dim, panel, out, ldo, epilogue);
            if (n < mt::cols)
                for (index_t r = 0; r < m; ++r)
                    std::copy(edge + r * mt::cols, edge + r * mt::cols + n, scores + (r0 + r) * lds + p0);
        });
    }
}

/// V's whole column blocks of micro_tile::cols values, each block's rows one after another: block b at
/// panels + b * nk * cols, [nk, cols]. The last dv % cols columns are not packed: accumulate_from_values reads
/// them in place.
template <class Acc>
void pack_value_panels(const Acc* v, index_t ldv, index_t nk, index_t dv, Acc* panels) {
    using namespace Eigen::internal;
    using packet = typename micro_tile<Acc>::packet;
    constexpr index_t lanes = micro_tile<Acc>::lanes, nr = micro_tile<Acc>::cols;
    for (index_t e0 = 0; e0 + nr <= dv; e0 += nr) {
        Acc* block = panels + e0 * nk;
        for (index_t j = 0; j < nk; ++j)
            for (index_t i = 0; i < nr; i += lanes) pstoreu(block + j * nr + i, ploadu<packet>(v + j * ldv + e0 + i));
    }
}

/// acc[rows, dv] (rows at `lda`) += p[rows, nk] times v[nk, dv] (rows at `ldv`), p[r, j] at p + r * ldp + j * pcs
/// (pcs = 1 for P in rows; ldp = 1, pcs = its row stride for the transpose of a row-major tile, the backward's
/// Pᵀ dO and dSᵀ Q). V's whole column
/// blocks read from `panels` (pack_value_panels' layout, blocks `panel_stride` elements apart), its last columns
/// from v. Keys go by in slices whose V part stays in L1 while every row group reads it: 16 KiB of one packed
/// block; for the columns read in place, rows spanning at most 16 KiB (rows a power of two apart use few of L1's
/// sets, and a longer slice would evict itself).
template <class Acc>
void accumulate_from_values(const Acc* p, index_t ldp, index_t pcs, index_t rows, index_t nk, const Acc* v, index_t ldv,
                            index_t dv, const Acc* panels, index_t panel_stride, Acc* acc, index_t lda) {
    using mt = micro_tile<Acc>;
    const index_t wide = dv / mt::cols * mt::cols, narrow = wide + (dv - wide) / mt::lanes * mt::lanes;
    const index_t packed_slice = 16384 / static_cast<index_t>(sizeof(Acc) * mt::cols);
    for (index_t j0 = 0; j0 < nk; j0 += packed_slice) {
        const index_t nj = std::min(packed_slice, nk - j0);
        for (index_t e = 0; e < wide; e += mt::cols)
            for_each_row_group(rows, mt::rows, [&](index_t r0, index_t m) {
                micro::accumulate_values_for<2, Acc>(m)(p + r0 * ldp + j0 * pcs, ldp, pcs, nj,
                                                        panels + (e / mt::cols) * panel_stride + j0 * mt::cols,
                                                        mt::cols, acc + r0 * lda + e, lda);
            });
    }
    if (wide == dv) return;
    const index_t slice = std::max<index_t>(8, 16384 / (static_cast<index_t>(sizeof(Acc)) * std::max<index_t>(ldv, 1)));
    for (index_t j0 = 0; j0 < nk; j0 += slice) {
        const index_t nj = std::min(slice, nk - j0);
        const Acc* pj = p + j0 * pcs;
        const Acc* vj = v + j0 * ldv;
        for (index_t e = wide; e < narrow; e += mt::lanes)
            for_each_row_group(rows, mt::rows, [&](index_t r0, index_t m) {
                micro::accumulate_values_for<1, Acc>(m)(pj + r0 * ldp, ldp, pcs, nj, vj + e, ldv, acc + r0 * lda + e,
                                                        lda);
            });
        for (index_t r = 0; r < rows; ++r)  // the last value columns, fewer than a packet
            for (index_t e = narrow; e < dv; ++e) {
                Acc sum = acc[r * lda + e];
                for (index_t j = 0; j < nj; ++j) sum += pj[r * ldp + j * pcs] * vj[j * ldv + e];
                acc[r * lda + e] = sum;
            }
    }
}

}  // namespace attend::detail
