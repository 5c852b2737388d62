// SPDX-License-Identifier: MIT
#pragma once
/// The products of a few query rows (a decode's query heads of one kv head; a slab of at most gemv_rows rows) with
/// keys and values read where they are stored: each key or value row is widened to the accumulation type in
/// registers as it is read (float, double, fp16, bf16 or q8_0 blocks), with no staging copy, and check_finite's scan
/// of the same rows runs on the same registers. Decoding reads every K and V row once and does a few multiply-adds
/// per value, so a separate widening pass, a GEMV over the copy and a scan of it cost more than the reads did.
///   scores[r, j] = sum over x of q[r, x] k[j, x]: per packet lane over ascending packets, then the lanes added
///                  (Eigen's predux tree, run for many keys at once), then the last head_dim % lanes dimensions in
///                  order; a few keys side by side, each its own sum;
///   acc[r, e]   += sum over j of p[r, j] v[j, e]: over ascending keys.
/// Either is the same sequence of operations for every storage type holding the same values (widening is exact),
/// so a 16-bit or an int8 cache gives the bits of a float cache holding its values, and a row gets the same bits
/// whatever rows share its call.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <type_traits>
#include <utility>

#include <Eigen/Core>

#if defined(EIGEN_VECTORIZE_SSE2) || defined(EIGEN_VECTORIZE_AVX) || defined(EIGEN_VECTORIZE_AVX512)
#include <immintrin.h>
#endif

#include "../tensor.hpp"
#include "micro_kernel.hpp"
#include "paged_view.hpp"
#include "quantized_rows.hpp"
#include "widen.hpp"

namespace attend::detail {

template <class Acc>
using row_packet = typename Eigen::internal::packet_traits<Acc>::type;
template <class Acc>
inline constexpr index_t row_lanes = Eigen::internal::packet_traits<Acc>::size;
/// The stored type of the rows row_at(j) points to (a value type or a quantized block).
template <class RowAt>
using stored_row_t = std::remove_const_t<std::remove_pointer_t<decltype(std::declval<const RowAt&>()(index_t{0}))>>;

/// Element x of a stored row (of values or of quantized blocks), widened exactly.
template <class Acc, class S>
Acc widened_at(const S* row, index_t x) {
    if constexpr (is_quantized_block_v<S>) {
        const S& b = row[x / S::size];
        float scale;
        widen(&b.scale, 1, &scale);
        return static_cast<Acc>(scale) * static_cast<Acc>(block_integer(b, x % S::size));
    } else {
        return static_cast<Acc>(row[x]);
    }
}

/// Elements [x, x + lanes) of a stored row as one packet of Acc, widened exactly: a load and a conversion in
/// registers where the target has one (bf16: a shift; fp16: F16C; int8: a sign extension and a scale), else
/// through widen.hpp's loops and a small buffer.
template <class Acc, class S>
row_packet<Acc> load_widened(const S* row, index_t x) {
    using namespace Eigen::internal;
    using packet = row_packet<Acc>;
    constexpr index_t lanes = row_lanes<Acc>;
    if constexpr (std::is_same_v<S, Acc>) {
        return ploadu<packet>(row + x);
    } else {
        if constexpr (std::is_same_v<Acc, float> && std::is_same_v<S, Eigen::bfloat16>) {
#if defined(EIGEN_VECTORIZE_AVX512)
            if constexpr (lanes == 16) {
                const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + x));
                return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
            }
#elif defined(EIGEN_VECTORIZE_AVX2)
            if constexpr (lanes == 8) {
                const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + x));
                return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
            }
#elif defined(EIGEN_VECTORIZE_SSE2) && !defined(EIGEN_VECTORIZE_AVX)
            if constexpr (lanes == 4) {  // bf16 in the upper half of each float: interleave with zeros
                const __m128i h = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + x));
                return _mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), h));
            }
#endif
        }
        if constexpr (std::is_same_v<Acc, float> && std::is_same_v<S, Eigen::half>) {
#if defined(EIGEN_VECTORIZE_AVX512)
            if constexpr (lanes == 16)
                return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + x)));
#elif defined(EIGEN_VECTORIZE_AVX) && defined(__F16C__)
            if constexpr (lanes == 8)
                return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + x)));
#endif
        }
        alignas(64) Acc buffer[lanes];
        widen(row + x, lanes, buffer);
        return pload<packet>(buffer);
    }
}

/// A q8_0 block's fp16 scale in every lane: widened in a vector register from its bits where the target has the
/// conversion (two instructions, no scalar conversion and store).
template <class Acc>
row_packet<Acc> broadcast_scale(Eigen::half scale) {
    if constexpr (std::is_same_v<Acc, float>) {
#if defined(EIGEN_VECTORIZE_AVX512)
        if constexpr (row_lanes<Acc> == 16)
            return _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(bits_of(scale))));
#elif defined(EIGEN_VECTORIZE_AVX) && defined(__F16C__)
        if constexpr (row_lanes<Acc> == 8) return _mm256_cvtph_ps(_mm_set1_epi16(static_cast<short>(bits_of(scale))));
#endif
    }
    float widened;
    widen(&scale, 1, &widened);
    return Eigen::internal::pset1<row_packet<Acc>>(static_cast<Acc>(widened));
}

/// lanes int8 values of a q8_0 block from q widened, given the block's scale in every lane (broadcast_scale): the
/// integers times the scale, exact (an integer of 8 bits times a scale of 11 is a float without rounding).
template <class Acc>
row_packet<Acc> widened_q8(const std::int8_t* q, const row_packet<Acc>& scale) {
    using namespace Eigen::internal;
    using packet = row_packet<Acc>;
    constexpr index_t lanes = row_lanes<Acc>;
    static_assert(q8_0_block::size % lanes == 0, "a packet never straddles two q8_0 blocks");
    if constexpr (std::is_same_v<Acc, float>) {
#if defined(EIGEN_VECTORIZE_AVX512)
        if constexpr (lanes == 16)
            return _mm512_mul_ps(
                scale, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)))));
#elif defined(EIGEN_VECTORIZE_AVX2)
        if constexpr (lanes == 8)
            return _mm256_mul_ps(
                scale, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)))));
#endif
    }
    alignas(64) Acc buffer[lanes];
    for (index_t j = 0; j < lanes; ++j) buffer[j] = static_cast<Acc>(q[j]);
    return pmul(scale, pload<packet>(buffer));
}

/// A q4_0 block's nibble bytes as widened_q4 reads them. On AVX-512 floats a packet is half a block, and both
/// halves (the low nibbles, then the high ones) come from the same 16 bytes: zero-extended to 32-bit lanes once per
/// block and kept in a register. Elsewhere each packet loads its own bytes from the block.
template <class Acc>
struct q4_bytes {
    const q4_0_block* block = nullptr;
    void load(const q4_0_block& b) { block = &b; }
};
#if defined(EIGEN_VECTORIZE_AVX512)
template <>
struct q4_bytes<float> {
    __m512i lanes{};
    void load(const q4_0_block& b) {
        lanes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.nibbles)));
    }
};
#endif

/// lanes values of a q4_0 block from value `first` on (a multiple of lanes), given its bytes (q4_bytes) and its
/// scale d and -8 d in every lane: the bytes' low or high four bits n (values 0 to 15 or 16 to 31) as 32-bit
/// integers, then d n - 8 d in one multiply-add, exact (d n and d (n - 8) are floats; a subtraction and a multiply
/// had been one more instruction per packet).
template <class Acc>
row_packet<Acc> widened_q4(const q4_bytes<Acc>& bytes, index_t first, const row_packet<Acc>& scale,
                           const row_packet<Acc>& offset) {
    using namespace Eigen::internal;
    using packet = row_packet<Acc>;
    constexpr index_t lanes = row_lanes<Acc>, half_block = q4_0_block::size / 2;
    static_assert(half_block % lanes == 0 || lanes > half_block, "a packet never straddles two nibble halves");
#if defined(EIGEN_VECTORIZE_AVX512)
    if constexpr (std::is_same_v<Acc, float> && lanes == 16) {
        const __m512i q = first >= half_block ? _mm512_srli_epi32(bytes.lanes, 4)
                                              : _mm512_and_si512(bytes.lanes, _mm512_set1_epi32(15));
        return _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), scale, offset);
    } else
#elif defined(EIGEN_VECTORIZE_AVX2)
    if constexpr (std::is_same_v<Acc, float> && lanes == 8) {
        const auto* from = reinterpret_cast<const __m128i*>(bytes.block->nibbles + first % half_block);
        __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(from));
        q = first >= half_block ? _mm256_srli_epi32(q, 4) : _mm256_and_si256(q, _mm256_set1_epi32(15));
        return pmadd(_mm256_cvtepi32_ps(q), scale, offset);
    } else
#endif
    {
        alignas(64) Acc buffer[lanes];
        for (index_t j = 0; j < lanes; ++j) buffer[j] = static_cast<Acc>(block_integer(*bytes.block, first + j) + 8);
        return pmadd(pload<packet>(buffer), scale, offset);
    }
}

/// sum over x < n of a[x] b[x] in Acc, two stored rows widened in registers: two packets of multiply-adds side by
/// side, added and then across lanes (predux), the last n % lanes products after in order. The same operations for
/// every storage type holding the same values (widening is exact). The backward's delta = rowsum(dO * O), once per
/// query row and key tile: an in-order sum through the 16-bit types' conversions one at a time had been 9 % of a
/// bf16 backward (Zen 5).
template <class Acc, class S>
Acc dot_of_rows(const S* a, const S* b, index_t n) {
    using namespace Eigen::internal;
    using packet = row_packet<Acc>;
    constexpr index_t lanes = row_lanes<Acc>;
    packet first = pset1<packet>(Acc(0)), second = first;
    index_t x = 0;
    for (; x + 2 * lanes <= n; x += 2 * lanes) {
        first = pmadd(load_widened<Acc>(a, x), load_widened<Acc>(b, x), first);
        second = pmadd(load_widened<Acc>(a, x + lanes), load_widened<Acc>(b, x + lanes), second);
    }
    if (x + lanes <= n) {
        first = pmadd(load_widened<Acc>(a, x), load_widened<Acc>(b, x), first);
        x += lanes;
    }
    Acc sum = predux(padd(first, second));
    for (; x < n; ++x) sum += widened_at<Acc>(a, x) * widened_at<Acc>(b, x);
    return sum;
}

/// A stored row as a kernel reads it: packets and single elements widened to Acc, from the columns
/// [first, first + count) the kernel said it reads.
template <class Acc, class S>
struct widening_row {
    const S* row = nullptr;
    void start(const S* r, index_t /*first*/, index_t /*count*/) { row = r; }
    row_packet<Acc> packet(index_t x) const { return load_widened<Acc>(row, x); }
    Acc element(index_t x) const { return widened_at<Acc>(row, x); }
};

/// A row of quantized blocks (q8_0, q4_0): each block's scale is widened once, by the first packet asked for in it,
/// and kept for the packets after it in the same block (the kernels ask for a row's packets in ascending order), as
/// are a q4_0 block's bytes where both of its packets read the same ones (q4_bytes: decode_q4 0.96 to 0.985 of the
/// time, Zen 4). A scale widened per packet had cost a q8_0 decode 3 to 5 % (Zen 5, in cache); all of a row's
/// scales cached as it started (a scalar conversion and a store per block, a reload per packet) had made the value
/// kernel a tenth slower.
template <class Acc, class Block>
struct widening_block_row {
    const Block* row = nullptr;
    const Block* block = nullptr;  ///< the block whose scale `scale` holds
    row_packet<Acc> scale{};
    row_packet<Acc> offset{};  ///< q4_0: -8 times the scale
    q4_bytes<Acc> nibbles{};   ///< q4_0: the block's bytes
    void start(const Block* r, index_t /*first*/, index_t /*count*/) {
        row = r;
        block = nullptr;
    }
    row_packet<Acc> packet(index_t x) {
        const Block* b = row + x / Block::size;
        if (b != block) {
            scale = broadcast_scale<Acc>(b->scale);
            if constexpr (std::is_same_v<Block, q4_0_block>) {
                offset = Eigen::internal::pmul(scale, Eigen::internal::pset1<row_packet<Acc>>(Acc(-8)));
                nibbles.load(*b);
            }
            block = b;
        }
        if constexpr (std::is_same_v<Block, q8_0_block>) return widened_q8<Acc>(b->values + x % Block::size, scale);
        else return widened_q4<Acc>(nibbles, x % Block::size, scale, offset);
    }
    Acc element(index_t x) const { return widened_at<Acc>(row, x); }
};
template <class Acc>
struct widening_row<Acc, q8_0_block> : widening_block_row<Acc, q8_0_block> {};
template <class Acc>
struct widening_row<Acc, q4_0_block> : widening_block_row<Acc, q4_0_block> {};

/// ATTEND_IN_REGISTERS(ATTEND_REGISTER(x), ...) keeps loaded packets in registers: a packet that several
/// multiply-adds read is otherwise folded into each of them as a memory operand, one load per use, and loads, not
/// multiply-adds, then bound the kernel. An empty asm statement that claims to change them: no instruction. (A
/// macro, written where the packets are declared: behind a function's reference the compiler keeps a dead copy of
/// them in memory.)
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && defined(EIGEN_VECTORIZE_SSE2)
#define ATTEND_IN_REGISTERS(...) __asm__("" : __VA_ARGS__)
#if defined(EIGEN_VECTORIZE_AVX512)
#define ATTEND_REGISTER(x) "+v"(x)  // any of the 32
#else
#define ATTEND_REGISTER(x) "+x"(x)
#endif
#else
#define ATTEND_IN_REGISTERS(...) ((void)0)
#endif

/// One level of sums_of_packets: out[p] = add(x, y) of packets 2p and 2p + 1 (an odd count pairs its last packet
/// with itself; those lanes are never read).
template <int N, class P, class Add>
EIGEN_ALWAYS_INLINE void add_pairs(const P* in, P* out, const Add& add) {
    ATTEND_UNROLL_FULLY
    for (int p = 0; p < (N + 1) / 2; ++p) out[p] = add(in[2 * p], in[std::min(2 * p + 1, N - 1)]);
}

#if defined(EIGEN_VECTORIZE_AVX512) && defined(EIGEN_VECTORIZE_AVX512DQ)
/// sums_of_packets' tree on AVX-512 floats, into w[N / 16 rounded up]: lane 4k + m of w[z] is packet
/// 16z + 4m + k's sum.
template <int N>
EIGEN_ALWAYS_INLINE void lane_sums_tree(const __m512 (&a)[N], __m512 (&w)[(N + 15) / 16]) {
    constexpr int m1 = (N + 1) / 2, m2 = (m1 + 1) / 2, m3 = (m2 + 1) / 2;
    __m512 c[m1], e[m2], t[m3];
    add_pairs<N>(a, c, [](__m512 x, __m512 y) {  // halves: [x: q0+q2, x: q1+q3, y: q0+q2, y: q1+q3]
        return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
    });
    add_pairs<m1>(c, e, [](__m512 x, __m512 y) {  // quarters: quarter k holds packet 4p + k's partial sums
        return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
    });
    add_pairs<m2>(e, t, [](__m512 x, __m512 y) {  // pairs of lanes: [x0 + x2, x1 + x3, y0 + y2, y1 + y3]
        return _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x44), _mm512_shuffle_ps(x, y, 0xEE));
    });
    add_pairs<m3>(t, w, [](__m512 x, __m512 y) {  // lanes: lane 4k + m of w[z] is packet 16z + 4m + k's sum
        return _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x88), _mm512_shuffle_ps(x, y, 0xDD));
    });
}

/// Rows x Keys sums (Rows * Keys <= 16 packets a[r * Keys + i]) stored as out[r * ld + i], the bits of
/// sums_of_packets: the same tree, its lanes put in row order by one permutation and each row's Keys sums written
/// by one masked store, where moving 16 sums one by one took about 30 shuffles and stores. Returns that packet
/// (lanes past Rows x Keys repeat sums of it).
template <int Rows, int Keys>
EIGEN_ALWAYS_INLINE __m512 store_sums_by_rows(const __m512 (&a)[Rows * Keys], float* out, index_t ld) {
    static_assert(Rows * Keys <= 16, "one packet of sums");
    __m512 w[1];
    lane_sums_tree<Rows * Keys>(a, w);
    // lane n = r * Keys + i takes packet n's sum, at lane 4 (n % 4) + n / 4 of w
    const __m512 sums =
        _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), w[0]);
    ATTEND_UNROLL_FULLY
    for (int r = 0; r < Rows; ++r)  // lanes r * Keys .. + Keys - 1 of sums, at out + r * ld; ld >= Keys
        _mm512_mask_storeu_ps(out + r * (ld - Keys), static_cast<__mmask16>(((1u << Keys) - 1) << (r * Keys)), sums);
    return sums;
}
#endif

/// out[n] = predux(a[n]) for N packets, with the bits of Eigen's predux: the same tree of additions (lane l plus
/// lane l + lanes/2, then + lanes/4, ...), only run for up to 16 packets at once, a packet's halves, quarters and
/// pairs of lanes added side by side with another packet's. Where Eigen's own tree is known (AVX-512 with DQ, AVX),
/// that costs about 3 instructions per sum instead of 7; elsewhere it is predux. Always inlined: GCC left one
/// instance (q8_0 rows without the scan) out of line, and its packets then went through memory.
template <int N, class Packet, class Acc>
EIGEN_ALWAYS_INLINE void sums_of_packets(const Packet (&a)[N], Acc* out) {
    constexpr int m1 = (N + 1) / 2, m2 = (m1 + 1) / 2, m3 = (m2 + 1) / 2, m4 = (m3 + 1) / 2;
#if defined(EIGEN_VECTORIZE_AVX512) && defined(EIGEN_VECTORIZE_AVX512DQ)
    if constexpr (std::is_same_v<Acc, float> && Eigen::internal::unpacket_traits<Packet>::size == 16) {
        __m512 w[m4];
        lane_sums_tree<N>(a, w);
        alignas(64) float lanes[m4 * 16];
        std::memcpy(lanes, w, sizeof w);
        ATTEND_UNROLL_FULLY
        for (int n = 0; n < N; ++n) out[n] = lanes[16 * (n / 16) + 4 * (n % 4) + n % 16 / 4];
        return;
    }
#endif
#if defined(EIGEN_VECTORIZE_AVX) && !defined(EIGEN_VECTORIZE_AVX512)
    if constexpr (std::is_same_v<Acc, float> && Eigen::internal::unpacket_traits<Packet>::size == 8) {
        __m256 e[m1], t[m2], w[m3];
        add_pairs<N>(a, e, [](__m256 x, __m256 y) {  // halves: half k holds packet 2p + k's partial sums
            return _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
        });
        add_pairs<m1>(e, t, [](__m256 x, __m256 y) {
            return _mm256_add_ps(_mm256_shuffle_ps(x, y, 0x44), _mm256_shuffle_ps(x, y, 0xEE));
        });
        add_pairs<m2>(t, w, [](__m256 x, __m256 y) {  // lane 4k + m of w[z] is packet 8z + 2m + k's sum
            return _mm256_add_ps(_mm256_shuffle_ps(x, y, 0x88), _mm256_shuffle_ps(x, y, 0xDD));
        });
        alignas(32) float lanes[m3 * 8];
        std::memcpy(lanes, w, sizeof w);
        ATTEND_UNROLL_FULLY
        for (int n = 0; n < N; ++n) out[n] = lanes[8 * (n / 8) + 4 * (n % 2) + n % 8 / 2];
        return;
    }
#endif
    (void)m4;
    ATTEND_UNROLL_FULLY
    for (int n = 0; n < N; ++n) out[n] = Eigen::internal::predux(a[n]);
}

/// What check_finite needs of the rows a kernel read, gathered on the widened packets: the largest magnitude, and
/// whether any value is NaN or inf. In general a max of |x| and a probe that is 0 while every value is finite and
/// NaN once one is not (x * 0 is NaN exactly for NaN and +-inf).
template <class Acc>
struct row_scan {
    static constexpr bool pairs = false;  ///< whether note_larger_of exists (row_scan<float> on AVX-512 DQ)
    row_packet<Acc> max_abs = Eigen::internal::pset1<row_packet<Acc>>(Acc(0));
    row_packet<Acc> probe = Eigen::internal::pset1<row_packet<Acc>>(Acc(0));
    Acc tail_max_abs = 0, tail_probe = 0;

    void note(const row_packet<Acc>& x, bool magnitude) {
        using namespace Eigen::internal;
        if (magnitude) max_abs = pmax(max_abs, pabs(x));
        probe = pmadd(x, pset1<row_packet<Acc>>(Acc(0)), probe);
    }
    void note(Acc x, bool magnitude) {
        if (magnitude) tail_max_abs = std::max(tail_max_abs, std::abs(x));
        tail_probe += x * Acc(0);
    }
    void merge(const row_scan& o) {
        using namespace Eigen::internal;
        max_abs = pmax(max_abs, o.max_abs);
        probe = padd(probe, o.probe);
        tail_max_abs = std::max(tail_max_abs, o.tail_max_abs);
        tail_probe += o.tail_probe;
    }
    bool non_finite() const { return !std::isfinite(Eigen::internal::predux(probe) + tail_probe); }
    Acc largest() const { return std::max(Eigen::internal::predux_max(max_abs), tail_max_abs); }
};

#if defined(EIGEN_VECTORIZE_AVX512) || defined(EIGEN_VECTORIZE_AVX2) || \
    (defined(EIGEN_VECTORIZE_SSE4_1) && !defined(EIGEN_VECTORIZE_AVX))
/// For float where the target has an unsigned 32-bit integer max: one integer max of |x|'s bits per packet (the
/// bits' integer order is the magnitudes' order, and bits at or above +inf's mean a NaN or an inf), half the work
/// of the general scan on a one-instruction dependency chain.
template <>
struct row_scan<float> {
#if defined(EIGEN_VECTORIZE_AVX512)
    using bits_packet = __m512i;
    static bits_packet magnitude(const __m512& x) {
        return _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff));
    }
    static bits_packet larger(const bits_packet& a, const bits_packet& b) { return _mm512_max_epu32(a, b); }
#elif defined(EIGEN_VECTORIZE_AVX2)
    using bits_packet = __m256i;
    static bits_packet magnitude(const __m256& x) {
        return _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7fffffff));
    }
    static bits_packet larger(const bits_packet& a, const bits_packet& b) { return _mm256_max_epu32(a, b); }
#else
    using bits_packet = __m128i;
    static bits_packet magnitude(const __m128& x) {
        return _mm_and_si128(_mm_castps_si128(x), _mm_set1_epi32(0x7fffffff));
    }
    static bits_packet larger(const bits_packet& a, const bits_packet& b) { return _mm_max_epu32(a, b); }
#endif
    static std::uint32_t largest_lane(const bits_packet& a) {  // once per merge into the findings: no hurry
        std::uint32_t lanes[sizeof(bits_packet) / 4];
        std::memcpy(lanes, &a, sizeof a);
        return *std::max_element(std::begin(lanes), std::end(lanes));
    }
    bits_packet bits = magnitude(Eigen::internal::pset1<row_packet<float>>(0.0f));
    std::uint32_t tail_bits = 0;

    void note(const row_packet<float>& x, bool /*magnitude: always gathered, as cheap as the check*/) {
        bits = larger(bits, magnitude(x));
    }
#if defined(EIGEN_VECTORIZE_AVX512) && defined(EIGEN_VECTORIZE_AVX512DQ)
    /// The larger |x| of two packets' lanes by one range instruction, folded in by the integer max: half the
    /// instructions of two notes. A NaN loses to the other lane's value there (range returns the operand that is
    /// not NaN), so only for keys whose scores are noted too (score_keys_at): with q finite, a NaN or inf key makes
    /// its scores NaN or inf.
    static constexpr bool pairs = true;
    void note_larger_of(const __m512& a, const __m512& b) {
        bits = larger(bits, _mm512_castps_si512(_mm512_range_ps(a, b, 0x0B)));  // max |a|, |b|; sign cleared
    }
#else
    static constexpr bool pairs = false;
#endif
    void note(float x, bool) {
        std::uint32_t b;
        std::memcpy(&b, &x, sizeof b);
        tail_bits = std::max(tail_bits, b & 0x7fffffffu);
    }
    void merge(const row_scan& o) {
        bits = larger(bits, o.bits);
        tail_bits = std::max(tail_bits, o.tail_bits);
    }
    std::uint32_t largest_bits() const { return std::max(largest_lane(bits), tail_bits); }
    bool non_finite() const { return largest_bits() >= 0x7f800000u; }
    float largest() const {
        const std::uint32_t b = largest_bits();
        float x;
        std::memcpy(&x, &b, sizeof x);
        return x;
    }
};
#endif

/// Notes columns [first, first + count) of n stored rows (row j at row_of(j)) in `scan`, as the row kernels' own
/// pass does, for rows read for the scan alone or packed by another kernel, and rows whose products came out NaN
/// or inf (the kernels' own notes do not tell a bad value from an overflow): no widened copy. `first` is a whole
/// number of packets. `magnitude`: keys (their largest |k| too).
template <class Acc, class RowOf>
void scan_columns(index_t n, index_t first, index_t count, const RowOf& row_of, bool magnitude, row_scan<Acc>& scan) {
    constexpr index_t lanes = row_lanes<Acc>;
    const index_t whole = first + count / lanes * lanes, end = first + count;
    row_scan<Acc> seen;
    widening_row<Acc, stored_row_t<RowOf>> row;
    for (index_t j = 0; j < n; ++j) {
        row.start(row_of(j), first, count);
        for (index_t x = first; x < whole; x += lanes) seen.note(row.packet(x), magnitude);
        for (index_t x = whole; x < end; ++x) seen.note(row.element(x), magnitude);
    }
    scan.merge(seen);
}

/// scan_columns of whole rows of `dim` values.
template <class Acc, class RowOf>
void scan_rows(index_t n, index_t dim, const RowOf& row_of, bool magnitude, row_scan<Acc>& scan) {
    scan_columns(n, 0, dim, row_of, magnitude, scan);
}

/// What the key kernel notes for check_finite on a row's stored values themselves, before they are widened: nothing
/// in general (it notes the widened packets). For fp16 keys on AVX-512: the largest |k|'s bits, by an unsigned
/// 16-bit max 32 values at a time (the bits order the magnitudes, and bits at or above inf's are NaN or inf), where
/// the widened packets took as many instructions per 16; folded into a row_scan<float> once, as that largest value
/// widened, which is NaN or inf exactly when a key was. bf16 keys, whose widening is a shift, are noted as float
/// keys are, two widened packets at a time (row_scan::note_larger_of): a bf16 decode took 0.95 to 0.99 / 0.91 to
/// 0.93 of the time of a second read of each row on its bits at 1 / 2 threads (Zen 5, alternated); fp16 keys noted
/// that way took 1.07 of the bits' time.
template <class Acc, class S>
struct stored_scan {
    static constexpr bool on_bits = false;
    void note_row(const S*, index_t) {}
    void fold_into(row_scan<Acc>&) const {}
};
#if defined(EIGEN_VECTORIZE_AVX512) && defined(__AVX512BW__)
template <>
struct stored_scan<float, Eigen::half> {
    static constexpr bool on_bits = true;
    __m512i largest = _mm512_setzero_si512();

    void note_row(const Eigen::half* row, index_t n) {
        const __m512i magnitude = _mm512_set1_epi16(0x7fff);
        index_t x = 0;
        for (; x + 32 <= n; x += 32)
            largest = _mm512_max_epu16(largest, _mm512_and_si512(_mm512_loadu_si512(row + x), magnitude));
        if (x < n) {  // the last n - x < 32 values; the lanes past them load as 0
            const auto tail = static_cast<__mmask32>((std::uint64_t{1} << (n - x)) - 1);
            largest = _mm512_max_epu16(largest, _mm512_and_si512(_mm512_maskz_loadu_epi16(tail, row + x), magnitude));
        }
    }
    void fold_into(row_scan<float>& seen) const {
        alignas(64) std::uint16_t lanes[32];
        _mm512_store_si512(lanes, largest);
        const std::uint16_t top = *std::max_element(std::begin(lanes), std::end(lanes));
        seen.note(static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(top)), true);
    }
};
#endif

/// Whether the key kernel notes keys of storage S two packets at a time (row_scan::note_larger_of), and so needs
/// their scores noted to see a NaN.
template <class Acc, class S>
inline constexpr bool keys_in_pairs = !stored_scan<Acc, S>::on_bits && row_scan<Acc>::pairs;

namespace rows {

/// Accumulator registers the value kernel may hold: three quarters of the target's vector registers, leaving
/// room for a loaded row and a broadcast.
inline constexpr int register_budget = EIGEN_ARCH_DEFAULT_NUMBER_OF_REGISTERS * 3 / 4;

/// The largest k with 2^k <= n, for n >= 1.
constexpr int floor_log2(int n) { return n > 1 ? 1 + floor_log2(n / 2) : 0; }

/// Bytes of a stored row of `dim` values.
template <class S>
constexpr index_t row_bytes(index_t dim) {
    return row_units<S>(dim) * static_cast<index_t>(sizeof(S));
}

/// The rows a row kernel reads after its own: `rows` rows from `first`, `stride` bytes apart. A tile's keys go on
/// to its values, its values to the next tile's keys; the kernel's prefetch runs on into them as its own rows run
/// out, so the reads of the next pass are in flight when it starts. Decode from memory, 1 thread, versions
/// alternated on Zen 5: fp32 0.97 and bf16 0.94 of the time of passes that started cold; from L3 (1024 keys) 1.03.
struct row_run {
    static constexpr index_t most = 64;  ///< the farthest the prefetch asks past a kernel's rows (row_prefetch)
    const char* first = nullptr;
    index_t stride = 0;
    index_t rows = 0;
};

/// How far ahead the row kernels ask the memory system for stored rows of type S, and where to (a hint; no effect
/// on any result). Float and double rows carry the least work per byte, so their decode is bound by the read, and
/// L1's few miss buffers hold too little of it in flight: they are asked into L1 about 4 KiB ahead and into L2
/// about 8 KiB ahead. fp32 decode, 1 thread, versions alternated: on Zen 4, L2 alone took 0.67 of the time of L1
/// alone; on Zen 5, 1.15 of it, and both 0.98 of it. A decode from L3 (1024 keys) pays for the second request: 1.07
/// of the time of L2 alone on Zen 5. 16-bit and int8 rows are bound by their widening: asked into L1 alone (into L2
/// as well, 10 to 20 % slower on Zen 5; into L2 alone, 4 to 20 % slower on Zen 4). 16-bit rows about 8 KiB ahead:
/// their rows go by twice as fast as float rows of the same bytes, and 4 KiB ahead was too short a lead for the
/// memory's latency (Zen 5, versions alternated: bf16 and fp16 decode took 0.87 of 4 KiB's time at 1 thread, bf16
/// 0.92 at 2; 12 and 16 KiB ahead 0.93 and 0.95). q8_0 rows 4 KiB ahead (8 KiB: 1.02 to 1.05 of the time).
template <class S>
class row_prefetch {
public:
    /// For rows of `bytes` bytes.
    explicit row_prefetch(index_t bytes)
        : bytes_(bytes),
          near_(rows_in(sixteen_bit ? 8192 : 4096, row_run::most / 2)),
          far_(also_into_l2 ? std::max(rows_in(8192, row_run::most), near_ + 1) : 0) {}

    /// Asks for the rows `near` and `far` rows past row j (row_at(i) is row i), those at or past `end` in `then`:
    /// float and double rows there only into L2 (into L1 as well, alternated against this: the contiguous fp32
    /// decode took 0.97 of the time, but a paged one of interleaved 16-row blocks 1.08 to 1.10).
    template <class RowAt>
    EIGEN_ALWAYS_INLINE void ask_past(const RowAt& row_at, index_t j, index_t end, const row_run& then) const {
        ask_row<3>(row_at, j + near_, end, also_into_l2 ? row_run{} : then);
        if constexpr (also_into_l2) ask_row<2>(row_at, j + far_, end, then);
    }

private:
    static constexpr bool also_into_l2 = std::is_same_v<S, float> || std::is_same_v<S, double>;
    static constexpr bool sixteen_bit = std::is_same_v<S, Eigen::half> || std::is_same_v<S, Eigen::bfloat16>;
    index_t bytes_, near_, far_;

    index_t rows_in(index_t span, index_t most) const {
        return std::clamp<index_t>(span / std::max<index_t>(bytes_, 1), 1, most);
    }

    template <int Locality, class RowAt>
    EIGEN_ALWAYS_INLINE void ask_row(const RowAt& row_at, index_t i, index_t end, const row_run& then) const {
        if (i < end) ask<Locality>(row_at(i), bytes_);
        else if (i - end < then.rows) ask<Locality>(then.first + (i - end) * then.stride, bytes_);
    }

    /// The cache lines of a row of `bytes` bytes, into L1 (Locality 3, prefetcht0) or L2 (2, prefetcht1). Inlined
    /// always, like ask_past: GCC takes a function whose only effect is a prefetch for one without effects, and a
    /// call to one that is not inlined before its interprocedural passes is removed, with the prefetch.
    template <int Locality>
    EIGEN_ALWAYS_INLINE static void ask(const void* row, index_t bytes) {
#if defined(__GNUC__)
        for (index_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(row) + b, 0, Locality);
#else
        (void)row;
        (void)bytes;
#endif
    }
};

/// Keys the score kernel takes at once for Rows rows: each key's sum is a chain of head_dim / lanes dependent
/// multiply-adds, so a lone key leaves the core waiting on their latency; Keys chains side by side (Rows x Keys
/// accumulators, within the register budget) keep the multiply units busy, and each q packet loaded serves them all.
template <int Rows>
inline constexpr int score_keys = std::clamp((register_budget - 2) / (Rows + 1), 1, 4);

/// scores[r, j0 + i] for i < Keys, Rows rows; see scores. Not forced inline: forced, the fp32 decode from memory
/// ran about a quarter slower on an Emerald Rapids Xeon (alternating runs), and no storage type gained.
template <int Rows, int Keys, bool Scan, class Acc, class KeyRow, class Stored>
EIGEN_STRONG_INLINE void score_keys_at(const Acc* q, index_t ldq, index_t dim, index_t j0, index_t nk,
                                       const KeyRow& key_row, Acc* out, index_t lds, row_scan<Acc>& seen,
                                       row_scan<Acc>& scores_seen, stored_scan<Acc, Stored>& on_bits,
                                       const row_prefetch<Stored>& prefetch, const row_run& then) {
    using namespace Eigen::internal;
    using packet = row_packet<Acc>;
    constexpr index_t lanes = row_lanes<Acc>;
    static_assert(Keys >= 1 && Keys <= 4, "ATTEND_IN_REGISTERS below is spelled out for 1 to 4 keys");
    const index_t whole = dim / lanes * lanes;
    using stored = Stored;
    constexpr bool note_packets = Scan && !stored_scan<Acc, Stored>::on_bits;
    constexpr bool note_pairs = Scan && keys_in_pairs<Acc, Stored>;  // NaN then told by the scores
    widening_row<Acc, stored> k[Keys];
    ATTEND_UNROLL_FULLY
    for (int i = 0; i < Keys; ++i) {
        k[i].start(key_row(j0 + i), 0, dim);
        if constexpr (Scan && !note_packets) on_bits.note_row(key_row(j0 + i), dim);
        prefetch.ask_past(key_row, j0 + i, nk, then);
    }
    packet acc[Rows * Keys];  // row r, key i at r * Keys + i
    ATTEND_UNROLL_FULLY
    for (int n = 0; n < Rows * Keys; ++n) acc[n] = pset1<packet>(Acc(0));
    for (index_t x = 0; x < whole; x += lanes) {
        packet kx[Keys];
        ATTEND_UNROLL_FULLY
        for (int i = 0; i < Keys; ++i) kx[i] = k[i].packet(x);
        if constexpr (std::is_same_v<stored, Acc>) {  // the scan and every row read them
            if constexpr (Keys == 1) ATTEND_IN_REGISTERS(ATTEND_REGISTER(kx[0]));
            if constexpr (Keys == 2) ATTEND_IN_REGISTERS(ATTEND_REGISTER(kx[0]), ATTEND_REGISTER(kx[1]));
            if constexpr (Keys == 3)
                ATTEND_IN_REGISTERS(ATTEND_REGISTER(kx[0]), ATTEND_REGISTER(kx[1]), ATTEND_REGISTER(kx[2]));
            if constexpr (Keys == 4)
                ATTEND_IN_REGISTERS(ATTEND_REGISTER(kx[0]), ATTEND_REGISTER(kx[1]), ATTEND_REGISTER(kx[2]),
                                    ATTEND_REGISTER(kx[3]));
        }
        if constexpr (note_pairs) {
            ATTEND_UNROLL_FULLY
            for (int i = 0; i < Keys; i += 2) seen.note_larger_of(kx[i], kx[std::min(i + 1, Keys - 1)]);
        } else if constexpr (note_packets) {
            ATTEND_UNROLL_FULLY
            for (int i = 0; i < Keys; ++i) seen.note(kx[i], true);
        }
        ATTEND_UNROLL_FULLY
        for (int r = 0; r < Rows; ++r) {
            packet qx = ploadu<packet>(q + r * ldq + x);
            ATTEND_IN_REGISTERS(ATTEND_REGISTER(qx));
            ATTEND_UNROLL_FULLY
            for (int i = 0; i < Keys; ++i) acc[r * Keys + i] = pmadd(qx, kx[i], acc[r * Keys + i]);
        }
    }
#if defined(EIGEN_VECTORIZE_AVX512) && defined(EIGEN_VECTORIZE_AVX512DQ)
    if constexpr (std::is_same_v<Acc, float> && Rows * Keys <= 16)
        if (whole == dim) {  // no column left over: the sums are the scores
            const __m512 sums = store_sums_by_rows<Rows, Keys>(acc, out + j0, lds);
            if constexpr (note_pairs) scores_seen.note(sums, false);
            return;
        }
#endif
    Acc sums[Rows * Keys];
    sums_of_packets(acc, sums);
    ATTEND_UNROLL_FULLY
    for (int i = 0; i < Keys; ++i) {
        Acc sum[Rows];
        ATTEND_UNROLL_FULLY
        for (int r = 0; r < Rows; ++r) sum[r] = sums[r * Keys + i];
        for (index_t x = whole; x < dim; ++x) {
            const Acc kx = k[i].element(x);
            if constexpr (note_packets) seen.note(kx, true);
            for (int r = 0; r < Rows; ++r) sum[r] += q[r * ldq + x] * kx;
        }
        for (int r = 0; r < Rows; ++r) {
            out[r * lds + j0 + i] = sum[r];
            if constexpr (note_pairs) scores_seen.note(sum[r], false);
        }
    }
}

/// scores[r, j] for Rows rows against nk keys, key j's row at key_row(j), score_keys<Rows> keys at a time; with
/// Scan, also note the keys in `scan` (gathered in registers, merged once). The prefetch runs on into `then`.
template <int Rows, bool Scan, class Acc, class KeyRow>
void scores(const Acc* q, index_t ldq, index_t dim, index_t nk, const KeyRow& key_row, Acc* out, index_t lds,
            row_scan<Acc>* scan, const row_run& then) {
    constexpr int keys = score_keys<Rows>;
    row_scan<Acc> seen, scores_seen;
    using stored = stored_row_t<KeyRow>;
    stored_scan<Acc, stored> on_bits;
    const row_prefetch<stored> prefetch(row_bytes<stored>(dim));
    index_t j = 0;
    for (; j + keys <= nk; j += keys)
        score_keys_at<Rows, keys, Scan>(q, ldq, dim, j, nk, key_row, out, lds, seen, scores_seen, on_bits, prefetch,
                                        then);
    for (; j < nk; ++j)
        score_keys_at<Rows, 1, Scan>(q, ldq, dim, j, nk, key_row, out, lds, seen, scores_seen, on_bits, prefetch, then);
    if constexpr (Scan) {
        on_bits.fold_into(seen);
        // Keys noted in pairs miss a NaN; a NaN or inf key makes its scores NaN or inf (q is finite), and so do
        // finite keys whose scores overflow: the keys' own scan tells the two apart.
        if constexpr (keys_in_pairs<Acc, stored>)
            if (scores_seen.non_finite()) scan_rows(nk, dim, key_row, true, seen);
        scan->merge(seen);
    }
}

/// Whether the value kernel holds a group of Packets packets of bf16 values' columns as even and odd columns
/// (bf16_column_pairs): AVX-512 floats and an even number of packets.
#if defined(EIGEN_VECTORIZE_AVX512)
inline constexpr bool avx512_rows = true;
#else
inline constexpr bool avx512_rows = false;
#endif
template <class Acc, class S, int Packets>
constexpr bool bf16_column_pairs_for() {
    return avx512_rows && std::is_same_v<Acc, float> && std::is_same_v<S, Eigen::bfloat16> && Packets % 2 == 0;
}

#if defined(EIGEN_VECTORIZE_AVX512)
/// The value kernel's accumulators for bf16 values, by pairs of packets: packets 2k and 2k + 1 hold the even and
/// the odd columns of columns [32 k, 32 k + 32) of the group. One load of 32 stored values gives both, the even
/// ones widened by a shift and the odd ones by a mask, where widening each 16 takes a zero-extension and a shift,
/// both on the two vector ports that also do the multiply-adds (bf16 decode 0.965 / 0.927 of the time at 1 / 2
/// threads, Emerald Rapids). Each column's sum is the same multiply-adds in the same order, held in another lane;
/// the accumulators are put in that order as they are loaded and back as they are stored, once per group and slice.
struct bf16_column_pairs {
    /// Columns [at, at + 32) of float sums as their even and odd columns.
    static void load(const float* at, __m512& even, __m512& odd) {
        const __m512 lo = _mm512_loadu_ps(at), hi = _mm512_loadu_ps(at + 16);
        even = _mm512_permutex2var_ps(lo, columns(0), hi);
        odd = _mm512_permutex2var_ps(lo, columns(1), hi);
    }
    /// The inverse of load.
    static void store(float* at, const __m512& even, const __m512& odd) {
        _mm512_storeu_ps(at, _mm512_permutex2var_ps(even, interleaved(0), odd));
        _mm512_storeu_ps(at + 16, _mm512_permutex2var_ps(even, interleaved(1), odd));
    }
    /// 32 stored bf16 values at `row` widened: the even ones (the low halves of 32-bit words, shifted up) and the
    /// odd ones (the high halves, the low ones cleared). Exact, as every widening of bf16.
    static void widen(const Eigen::bfloat16* row, __m512& even, __m512& odd) {
        const __m512i bits = _mm512_loadu_si512(row);
        even = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
        odd = _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
    }

private:
    /// Lane l takes column 2 l + parity of the 32.
    static __m512i columns(int parity) {
        return _mm512_add_epi32(_mm512_slli_epi32(lane_numbers(), 1), _mm512_set1_epi32(parity));
    }
    /// Lane l of half h takes column 16 h + l back: from the odd packet (lanes 16 and up) when it is odd.
    static __m512i interleaved(int half) {
        const __m512i column = _mm512_add_epi32(lane_numbers(), _mm512_set1_epi32(16 * half));
        return _mm512_add_epi32(_mm512_srli_epi32(column, 1),
                                _mm512_slli_epi32(_mm512_and_si512(column, _mm512_set1_epi32(1)), 4));
    }
    static __m512i lane_numbers() { return _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0); }
};
#endif

/// A row's Packets accumulators of the value kernel loaded from its columns at `row` (Load) or stored back there;
/// with ColumnPairs, in the order of bf16_column_pairs.
template <bool Load, bool ColumnPairs, int Packets, class Acc>
EIGEN_ALWAYS_INLINE void move_accumulators(Acc* row, row_packet<Acc> (&c)[Packets]) {
    constexpr index_t lanes = row_lanes<Acc>;
#if defined(EIGEN_VECTORIZE_AVX512)
    if constexpr (ColumnPairs) {
        ATTEND_UNROLL_FULLY
        for (int i = 0; i < Packets; i += 2) {
            if constexpr (Load) bf16_column_pairs::load(row + i * lanes, c[i], c[i + 1]);
            else bf16_column_pairs::store(row + i * lanes, c[i], c[i + 1]);
        }
        return;
    }
#endif
    ATTEND_UNROLL_FULLY
    for (int i = 0; i < Packets; ++i) {
        if constexpr (Load) c[i] = Eigen::internal::ploadu<row_packet<Acc>>(row + i * lanes);
        else Eigen::internal::pstoreu(row + i * lanes, c[i]);
    }
}
/// Columns [e0, e0 + Packets lanes) of a stored value row widened, in the accumulators' order.
template <bool ColumnPairs, int Packets, class Acc, class S>
EIGEN_ALWAYS_INLINE void widen_values(const S* row, index_t e0, row_packet<Acc> (&vx)[Packets]) {
    constexpr index_t lanes = row_lanes<Acc>;
#if defined(EIGEN_VECTORIZE_AVX512)
    if constexpr (ColumnPairs) {
        ATTEND_UNROLL_FULLY
        for (int i = 0; i < Packets; i += 2) bf16_column_pairs::widen(row + e0 + i * lanes, vx[i], vx[i + 1]);
        return;
    }
#endif
    widening_row<Acc, S> v;
    v.start(row, e0, Packets * lanes);
    ATTEND_UNROLL_FULLY
    for (int i = 0; i < Packets; ++i) vx[i] = v.packet(e0 + i * lanes);
}

/// acc[r, e] += sum over j < nk of p[r, j] (at p + r * ldp + j) v[j, e], value j's row at value_row(j), for the
/// Packets packets of columns from e0; with Scan, also note in `scan` whether those values hold a NaN or an inf.
/// Rows up to `readable` exist (value_row(j) for j < readable); past them the prefetch runs on into `then`.
///
/// The values are told from the sums they reach, not noted one packet at a time (two instructions a packet): p v
/// is NaN or +-inf wherever v is (0 x inf is NaN), and a sum that met one stays NaN or +-inf, so finite sums clear
/// every value at once. Sums that are not finite (a bad value, or finite products that overflowed) send the values
/// through scan_columns, which tells the two apart. (The sums are noted here, in registers: handed to a function by
/// reference, they had been kept in memory through the loop.)
template <int Rows, int Packets, bool Scan, class Acc, class ValueRow>
void accumulate_columns(const Acc* p, index_t ldp, index_t nk, index_t readable, const ValueRow& value_row, index_t e0,
                        index_t dv, Acc* acc, index_t lda, row_scan<Acc>* scan, const row_run& then) {
    using namespace Eigen::internal;
    using packet = row_packet<Acc>;
    constexpr index_t lanes = row_lanes<Acc>;
    using stored = stored_row_t<ValueRow>;
    constexpr bool column_pairs = bf16_column_pairs_for<Acc, stored, Packets>();
    packet c[Rows][Packets];
    ATTEND_UNROLL_FULLY
    for (int r = 0; r < Rows; ++r) move_accumulators<true, column_pairs, Packets, Acc>(acc + r * lda + e0, c[r]);
    const row_prefetch<stored> prefetch(row_bytes<stored>(dv));
    for (index_t j = 0; j < nk; ++j) {
        // The first column group reads V; its prefetch runs on into the next slice (rows up to `readable`).
        if (e0 == 0) prefetch.ask_past(value_row, j, readable, then);
        packet vx[Packets];
        widen_values<column_pairs, Packets, Acc>(value_row(j), e0, vx);
        ATTEND_UNROLL_FULLY
        for (int r = 0; r < Rows; ++r) {
            const packet a = pset1<packet>(p[r * ldp + j]);
            ATTEND_UNROLL_FULLY
            for (int i = 0; i < Packets; ++i) c[r][i] = pmadd(a, vx[i], c[r][i]);
        }
    }
    ATTEND_UNROLL_FULLY
    for (int r = 0; r < Rows; ++r) move_accumulators<false, column_pairs, Packets, Acc>(acc + r * lda + e0, c[r]);
    if constexpr (Scan) {
        row_scan<Acc> sums;
        ATTEND_UNROLL_FULLY
        for (int r = 0; r < Rows; ++r) {
            ATTEND_UNROLL_FULLY
            for (int i = 0; i < Packets; ++i) sums.note(c[r][i], false);
        }
        if (sums.non_finite()) scan_columns(nk, e0, Packets * lanes, value_row, false, *scan);
    }
}

/// Value rows from a slice's first key on.
template <class ValueRow>
struct rows_from {
    const ValueRow* value_row;
    index_t first;
    auto operator()(index_t j) const { return (*value_row)(first + j); }
};

/// The column-group widths, in packets, that accumulate instantiates for Rows rows: the powers of two below the
/// widest group the register budget allows, and that widest. A kernel per width up to the widest was two fifths of
/// all the kernels' code; these give the groups of before for head dims that are a power of two times the packet.
template <int Rows>
struct group_widths {
    static constexpr int widest = std::max(1, register_budget / Rows);
    static constexpr int count = floor_log2(widest) + ((widest & (widest - 1)) != 0 ? 2 : 1);
    static constexpr int at(int n) { return n + 1 < count ? 1 << n : widest; }
    /// The index of the widest instantiated width that is at most `packets` (at least 1).
    static int at_most(index_t packets) {
        int n = count - 1;
        while (n > 0 && at(n) > packets) --n;
        return n;
    }
};

/// acc[Rows, dv] += p[Rows, nk] V[nk, dv]: keys in slices of about 16 KiB of stored V (in L1 while each column
/// group reads them), columns in as few groups as the register budget allows for Rows rows, of about equal widths
/// (each rounded down to an instantiated width), the last dv % lanes columns one by one. A column's sum is the same
/// whatever group or slice it is in: the groups decide only how many columns share a pass over the keys, the slices
/// how many keys go by between a group's loads and stores of its accumulators. Slices counted in V's stored bytes,
/// not in its widened floats, are 64 keys of bf16 or fp16 at head_dim 128 instead of 32 (and 120 of q8_0): the bf16
/// decode from memory took 0.94 of the time at 1 thread and 0.95 at 2, fp16, q8_0 and q4_0 0.96 (Zen 4, versions
/// alternated); 32 KiB was no faster for 16-bit values and slower for float ones.
template <int Rows, bool Scan, class Acc, class ValueRow>
void accumulate(const Acc* p, index_t ldp, index_t nk, index_t dv, const ValueRow& value_row, Acc* acc, index_t lda,
                row_scan<Acc>* scan, const row_run& then) {
    using widths = group_widths<Rows>;
    constexpr index_t lanes = row_lanes<Acc>;
    constexpr auto by_width = micro::by_row_count(std::make_integer_sequence<int, widths::count>{}, [](auto n) {
        return &accumulate_columns<Rows, widths::at(decltype(n)::value - 1), Scan, Acc, rows_from<ValueRow>>;
    });
    const index_t packets = dv / lanes, whole = packets * lanes;
    const index_t groups = (packets + widths::widest - 1) / widths::widest;
    const index_t even = groups > 0 ? (packets + groups - 1) / groups : 0;
    using stored = stored_row_t<ValueRow>;
    const index_t slice = std::max<index_t>(8, 16384 / std::max<index_t>(row_bytes<stored>(dv), 1));
    for (index_t j0 = 0; j0 < nk; j0 += slice) {
        const index_t nj = std::min(slice, nk - j0);
        const rows_from<ValueRow> sliced{&value_row, j0};
        for (index_t i = 0; i < packets;) {
            const int n = widths::at_most(std::min(even, packets - i));
            by_width[static_cast<std::size_t>(n)](p + j0, ldp, nj, nk - j0, sliced, i * lanes, dv, acc, lda, scan,
                                                  then);
            i += widths::at(n);
        }
        for (index_t e = whole; e < dv; ++e)
            for (index_t j = 0; j < nj; ++j) {
                const Acc ve = widened_at<Acc>(value_row(j0 + j), e);
                if constexpr (Scan) scan->note(ve, false);
                for (int r = 0; r < Rows; ++r) acc[r * lda + e] += p[r * ldp + j0 + j] * ve;
            }
    }
}

}  // namespace rows

using rows::row_run;

/// Rows [first, ...) of one (batch, kv head) of a stored view: row j is view->row(batch, head, first + j). What the
/// row kernels read, named by the view's type alone, so every runner over the same keys or values (float or
/// 16-bit queries) shares one instance of each kernel.
template <class View>
struct rows_of {
    const View* view;
    index_t batch, head, first;
    auto operator()(index_t j) const { return view->row(batch, head, first + j); }
};

/// rows_of a view whose rows lie one stride apart (strided and quantized views): the first row's address and the
/// stride, taken once. Through view->row(batch, head, first + j) each row the kernels read and each row they
/// prefetched cost three multiplies and the view's fields reloaded (the kernels keep their general registers for
/// the rows of p and q): with the stride, decodes from L3 (1024 keys) took 0.90 of the time, fp32 at 1 and 2
/// threads, bf16 and q8_0 at 1 (Zen 5, alternated).
template <class T>
struct linear_rows {
    template <class View>
    linear_rows(const View* view, index_t batch, index_t head, index_t first)
        : row0(view->row(batch, head, first)), stride(row_stride(*view)) {}
    T* operator()(index_t j) const { return row0 + j * stride; }

private:
    T* row0;
    index_t stride;
};
template <class T>
struct rows_of<strided_view<T>> : linear_rows<T> {
    using linear_rows<T>::linear_rows;
};
template <class Block>
struct rows_of<quantized_view<Block>> : linear_rows<const Block> {
    using linear_rows<const Block>::linear_rows;
};

/// The row kernels for 1 to row_kernel_rows rows, the count a constant inside them; `scan` null for no scan.
inline constexpr index_t row_kernel_rows = 8;

/// The instance of a row kernel for `rows` rows, with or without the scan: Kernel::get<Rows, Scan>() names it.
template <class Kernel>
auto row_kernel_for(index_t rows, bool scan) {
    constexpr auto plain = micro::by_row_count(std::make_integer_sequence<int, row_kernel_rows>{}, [](auto n) {
        return Kernel::template get<decltype(n)::value, false>();
    });
    constexpr auto scanning = micro::by_row_count(std::make_integer_sequence<int, row_kernel_rows>{}, [](auto n) {
        return Kernel::template get<decltype(n)::value, true>();
    });
    return (scan ? scanning : plain)[static_cast<std::size_t>(rows - 1)];
}
template <class Acc, class KeyRow>
struct score_kernel {
    template <int Rows, bool Scan>
    static constexpr auto get() {
        return &rows::scores<Rows, Scan, Acc, KeyRow>;
    }
};
template <class Acc, class ValueRow>
struct accumulate_kernel {
    template <int Rows, bool Scan>
    static constexpr auto get() {
        return &rows::accumulate<Rows, Scan, Acc, ValueRow>;
    }
};

/// rows::scores for `rows` rows; `then`: the rows read next (row_run).
template <class Acc, class KeyRow>
void scores_of_rows(index_t rows, const Acc* q, index_t ldq, index_t dim, index_t nk, const KeyRow& key_row, Acc* out,
                    index_t lds, row_scan<Acc>* scan, const row_run& then = {}) {
    row_kernel_for<score_kernel<Acc, KeyRow>>(rows, scan != nullptr)(q, ldq, dim, nk, key_row, out, lds, scan, then);
}
/// rows::accumulate for `rows` rows; `then`: the rows read next (row_run).
template <class Acc, class ValueRow>
void accumulate_rows(index_t rows, const Acc* p, index_t ldp, index_t nk, index_t dv, const ValueRow& value_row,
                     Acc* acc, index_t lda, row_scan<Acc>* scan, const row_run& then = {}) {
    row_kernel_for<accumulate_kernel<Acc, ValueRow>>(rows, scan != nullptr)(p, ldp, nk, dv, value_row, acc, lda, scan,
                                                                            then);
}

}  // namespace attend::detail

#undef ATTEND_IN_REGISTERS
#undef ATTEND_REGISTER
