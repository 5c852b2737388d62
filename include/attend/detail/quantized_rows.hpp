// SPDX-License-Identifier: MIT
#pragma once
/// Rows stored as blocks of 32 quantized values with one fp16 scale each, ggml's q8_0 (int8) and q4_0 (int4), and
/// how the kernels and the input scans read them: widened to float a run of rows at a time, never a whole tensor.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include <Eigen/Core>

#if defined(EIGEN_VECTORIZE_AVX512)
#include <immintrin.h>
#endif

#include "../error.hpp"
#include "../tensor.hpp"
#include "memory.hpp"
#include "widen.hpp"

namespace attend {

/// 32 values x ~ scale * values[j]: ggml's block_q8_0 (`ggml_half d; int8_t qs[32]`), byte for byte, so a
/// llama.cpp q8_0 K or V cache maps onto these blocks.
struct q8_0_block {
    static constexpr index_t size = 32;  ///< values per block
    Eigen::half scale;                   ///< d
    std::int8_t values[size];            ///< q, in [-127, 127]
};
static_assert(sizeof(q8_0_block) == 34, "attend: q8_0_block must have ggml's 34-byte layout");

/// 32 values x ~ scale * (q_j - 8), q_j in [0, 15]: ggml's block_q4_0 (`ggml_half d; uint8_t qs[16]`), byte for
/// byte: value j < 16 in the low four bits of nibbles[j], value j + 16 in its high four bits.
struct q4_0_block {
    static constexpr index_t size = 32;  ///< values per block
    Eigen::half scale;                   ///< d
    std::uint8_t nibbles[size / 2];      ///< qs
};
static_assert(sizeof(q4_0_block) == 18, "attend: q4_0_block must have ggml's 18-byte layout");

namespace detail {

/// True for the quantized block types: q8_0_block and q4_0_block.
template <class T>
inline constexpr bool is_quantized_block_v = std::is_same_v<T, q8_0_block> || std::is_same_v<T, q4_0_block>;

/// Value j of a block as its integer: x ~ scale * block_integer(b, j).
inline int block_integer(const q8_0_block& b, index_t j) { return b.values[j]; }
inline int block_integer(const q4_0_block& b, index_t j) {
    const int byte = b.nibbles[j % (q4_0_block::size / 2)];
    return (j < q4_0_block::size / 2 ? byte & 15 : byte >> 4) - 8;
}

/// What a block type stores and reads: the largest |value| it can hold (its largest |integer| in the quantizer's
/// range times fp16's largest scale), the largest |integer| a block read from anywhere can hold (a mapped llama.cpp
/// q8_0 block may hold -128), and its name in messages.
template <class Block>
struct block_format;
template <>
struct block_format<q8_0_block> {
    static constexpr double max_magnitude = 127.0 * 65504.0;
    static constexpr int largest_integer = 128;
    static constexpr const char* name = "int8 (q8_0)";
};
template <>
struct block_format<q4_0_block> {
    static constexpr double max_magnitude = 8.0 * 65504.0;
    static constexpr int largest_integer = 8;
    static constexpr const char* name = "int4 (q4_0)";
};

/// Keys or values `[batch, heads, len, dim]` stored as quantized blocks (q8_0 or q4_0): row (b, h, i) is dim / 32
/// blocks in a row, starting at block b * strides[0] + h * strides[1] + i * strides[2] (strides in blocks).
/// Read-only. A quantized cache's keys() and values() (q8_cache.hpp); in detail, so the kernels' overloads for it
/// are found by argument-dependent lookup.
template <class Block>
struct quantized_view {
    const Block* data = nullptr;
    std::array<index_t, 4> dims{};     ///< batch, heads, len, dim (values; dim is a multiple of 32)
    std::array<index_t, 3> strides{};  ///< blocks
    int rank = 4;

    /// The first block of row (b, h, i).
    const Block* row(index_t b, index_t h, index_t i) const {
        return data + b * strides[0] + h * strides[1] + i * strides[2];
    }
};
using q8_view = quantized_view<q8_0_block>;
using q4_view = quantized_view<q4_0_block>;

/// The scalar a view's rows are made of: float, double, a 16-bit type, or a quantized block.
template <class View>
using row_scalar_t = std::remove_const_t<std::remove_pointer_t<decltype(std::declval<const View&>().row(0, 0, 0))>>;

/// True for views whose rows are quantized blocks: a quantized cache's view, or a paged quantized pool's
/// paged_view.
template <class View>
constexpr bool quantized_rows_v = is_quantized_block_v<row_scalar_t<View>>;

/// Elements of T that hold a row of `dim` values: dim, or dim / 32 blocks.
template <class T>
constexpr index_t row_units(index_t dim) {
    if constexpr (is_quantized_block_v<T>) return dim / T::size;
    else return dim;
}

/// Rows of a quantized view always follow each other at one stride (paged_view.hpp's rows_following for the
/// others).
template <class Block>
index_t rows_following(const quantized_view<Block>&, index_t, index_t n) {
    return n;
}

/// The blocks from a row of a quantized view to the next (paged_view.hpp's row_stride for the others).
template <class Block>
index_t row_stride(const quantized_view<Block>& x) {
    return x.strides[2];
}

/// The `size` values of a block of a row as floats: in place for a float row, otherwise widened into `buffer`. (A
/// float row copied first had its 16-byte stores read back by 32-byte loads on AVX2, which a store cannot forward:
/// the q4_0 append in packets took 1.39 x as long as a value at a time there.)
template <class T>
const float* block_values(const T* x, index_t size, float* buffer) {
    if constexpr (std::is_same_v<T, float>) {
        return x;
    } else {
        widen(x, size, buffer);
        return buffer;
    }
}

/// A block's scale d = fp16(ratio), stored in `stored`; returns 1 / d as the quantizer multiplies by it (0 for
/// d = 0). Where ratio is an fp16 subnormal, rounding it to nearest can lose so much of it that the block's largest
/// magnitude amax passes `limit` |d| (the format's largest integer plus a half): d is then the next fp16 away from
/// zero, so the documented bound holds for every block. Only a subnormal can need it, and that is asked of the
/// ratio first, off the conversions' chain (asked of the scale alone, the q8_0 append took 1.07 of its time, Zen 4).
inline float stored_scale(float ratio, float amax, float limit, Eigen::half& stored) {
    narrow(&ratio, 1, &stored);
    float scale;
    widen(&stored, 1, &scale);
    if (std::abs(ratio) < 0x1p-14f && scale != 0 && amax > limit * std::abs(scale)) {
        stored = Eigen::half_impl::raw_uint16_to_half(static_cast<std::uint16_t>(bits_of(stored) + 1));
        widen(&stored, 1, &scale);
    }
    return scale != 0 ? 1.0f / scale : 0.0f;
}

/// q = round(y) half away from zero, clamped to [-127, 127], for a packet of y = x / d: y plus just under a half
/// of y's sign, then truncated by the integer conversion (Eigen's pround, which needs SSE4.1's truncation; the
/// conversion truncates everywhere). Clamping first is the same: the bounds are integers and rounding is monotone.
template <class Packet>
auto rounded_q8(const Packet& y) {
    using namespace Eigen::internal;
    const Packet clamped = pmin(pmax(y, pset1<Packet>(-127.0f)), pset1<Packet>(127.0f));
    const Packet just_under_half = pset1frombits<Packet>(0x3effffffu);  // 0.5 - 2^-25
    const Packet sign = pand(clamped, pset1frombits<Packet>(0x80000000u));
    return pcast<Packet, typename unpacket_traits<Packet>::integer_packet>(padd(clamped, por(sign, just_under_half)));
}

/// q = (int)(y + 8.5) clamped to [0, 15] for a packet of y = x / d (ggml's q4_0 rounding, halves up): clamped in
/// floats, then truncated by the integer conversion (the same integers as truncating first and clamping after).
template <class Packet>
auto rounded_q4(const Packet& y) {
    using namespace Eigen::internal;
    const Packet shifted = padd(y, pset1<Packet>(8.5f));
    return pcast<Packet, typename unpacket_traits<Packet>::integer_packet>(
        pmin(pmax(shifted, pset1<Packet>(0.0f)), pset1<Packet>(15.0f)));
}

/// q8_0 of one row of `dim` values (dim a multiple of 32) into dim / 32 blocks. Per block: d = fp16(amax / 127),
/// q = round(x / d) clamped to [-127, 127], computed with d as stored, so |x - d q| <= d / 2 for each value (plus
/// 2^-16 d: x / d is a float product, x times 1 / d). Where amax / 127 is an fp16 subnormal, rounding it to nearest
/// can lose up to a third of it, and amax / d passes 127.5: d is then the next fp16 up, so the bound holds for
/// every block (the differential fuzzer found a clamped value 1.05 d away). A block whose amax / 127 rounds to 0 in
/// fp16 (amax below 127 x 2^-25) is stored as zeros. The values must be finite and below 127 x 65504 in magnitude
/// (the caller checks). A block at a time in packets: the widened values, their largest magnitude, the products by
/// 1 / d and their rounding, the bytes narrowed in registers where the target can; a call of std::round per value had
/// made an append of 2048 positions (8 kv heads, head_dim 128) take 14 times as long as a float cache's (Zen 5). The
/// same bytes as a value at a time (q8_cache_test).
template <class T>
void quantize_q8_0(const T* x, index_t dim, q8_0_block* out) {
    using namespace Eigen::internal;
    using packet = typename packet_traits<float>::type;
    constexpr index_t lanes = packet_traits<float>::size, size = q8_0_block::size;
    constexpr bool in_packets = packet_traits<float>::Vectorizable && size % lanes == 0;
    alignas(64) float buffer[size];  // a block widened, for rows not of float
    for (index_t b = 0; b < dim / size; ++b) {
        const float* values = block_values(x + b * size, size, buffer);
        float amax = 0;
        if constexpr (in_packets) {
            packet largest = pset1<packet>(0.0f);
            for (index_t j = 0; j < size; j += lanes) largest = pmax(largest, pabs(ploadu<packet>(values + j)));
            amax = predux_max(largest);
        } else {
            for (index_t j = 0; j < size; ++j) amax = std::max(amax, std::abs(values[j]));
        }
        const float inverse = stored_scale(amax / 127.0f, amax, 127.5f, out[b].scale);
        std::int8_t* q = out[b].values;
        if constexpr (in_packets) {
            for (index_t j = 0; j < size; j += lanes) {
                const auto integers = rounded_q8(pmul(ploadu<packet>(values + j), pset1<packet>(inverse)));
#if defined(EIGEN_VECTORIZE_AVX512)
                if constexpr (lanes == 16) {
                    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + j), _mm512_cvtepi32_epi8(integers));
                    continue;
                }
#endif
                alignas(64) std::int32_t wide[lanes];
                pstore(wide, integers);
                for (index_t l = 0; l < lanes; ++l) q[j + l] = static_cast<std::int8_t>(wide[l]);
            }
        } else {
            for (index_t j = 0; j < size; ++j) {
                const float y = std::round(values[j] * inverse);  // half away from zero, as ggml
                q[j] = static_cast<std::int8_t>(std::clamp(y, -127.0f, 127.0f));
            }
        }
    }
}

/// q4_0 of one row of `dim` values (dim a multiple of 32) into dim / 32 blocks: ggml's rule, computed with d as
/// stored. Per block, m is the value of largest magnitude (the first of them), d = fp16(m / -8) and q = round(x / d
/// + 8) (halves up, ggml's (int)(x / d + 8.5)) clamped to [0, 15], so m is held as -8 d (d a normal fp16). Each
/// value is within |d| / 2 (plus 2^-19 |d|, the float rounding of x / d + 8.5) of what was given, except values of
/// the sign opposite to m beyond 7.5 |d|, which the format's [-8, 7] clamps to 7 d: within 1.5 |d| = 3 |m| / 16
/// (where m / -8 is an fp16 subnormal and rounds down so far that |m| > 8.5 |d|, d is the next fp16 up, as for
/// q8_0). A block whose m / -8 rounds to 0 in fp16 (|m| at most 2^-22) is stored as zeros. The values must be
/// finite and at most 8 x 65504 in magnitude (the caller checks). A block at a time in packets, as quantize_q8_0:
/// m from the largest and the smallest value, by packets; the integers by rounded_q4; the two halves' integers
/// joined into bytes in registers where the target can: an append 0.51 of its time a value at a time (2048
/// positions, Zen 4). The same bytes as a value at a time (q4_cache_test).
template <class T>
void quantize_q4_0(const T* x, index_t dim, q4_0_block* out) {
    using namespace Eigen::internal;
    using packet = typename packet_traits<float>::type;
    constexpr index_t lanes = packet_traits<float>::size, size = q4_0_block::size, half_block = size / 2;
    constexpr bool in_packets = packet_traits<float>::Vectorizable && half_block % lanes == 0;
    alignas(64) float buffer[size];  // a block widened, for rows not of float
    for (index_t b = 0; b < dim / size; ++b) {
        const float* values = block_values(x + b * size, size, buffer);
        float extreme = 0;  // m: the first value of largest magnitude; +0 for a block of zeros (d = -0, as ggml)
        if constexpr (in_packets) {
            // m from the largest and the smallest value: low where -low > high, else high, a select of packets (GCC
            // made a scalar one a branch, which mispredicted every other block; a search for m in every block had
            // made the append slower than a value at a time). Where both signs reach the largest magnitude, the
            // first of them (rare: a search); a block of zeros +0, whatever the signs of the zeros max and min saw.
            packet largest = ploadu<packet>(values), smallest = largest;
            for (index_t j = lanes; j < size; j += lanes) {
                largest = pmax(largest, ploadu<packet>(values + j));
                smallest = pmin(smallest, ploadu<packet>(values + j));
            }
            const float high = predux_max(largest), low = predux_min(smallest);
            const packet high_p = pset1<packet>(high), low_p = pset1<packet>(low);
            extreme = pfirst(pselect(pcmp_lt(high_p, pnegate(low_p)), low_p, high_p));
            if (high == -low) {
                extreme = 0;
                if (high > 0) {
                    index_t first = 0;
                    while (values[first] != high && values[first] != low) ++first;
                    extreme = values[first];
                }
            }
        } else {
            for (index_t j = 0; j < size; ++j)
                if (std::abs(values[j]) > std::abs(extreme)) extreme = values[j];
        }
        // scale 0: inverse 0, every integer 8, the value zero
        const float inverse = stored_scale(extreme / -8.0f, std::abs(extreme), 8.5f, out[b].scale);
        std::uint8_t* bytes = out[b].nibbles;
        if constexpr (in_packets) {
            const auto integers = [&](index_t j) {  // values [j, j + lanes) as integers in [0, 15]
                return rounded_q4(pmul(ploadu<packet>(values + j), pset1<packet>(inverse)));
            };
#if defined(EIGEN_VECTORIZE_AVX512)
            if constexpr (lanes == 16) {
                const __m512i joined = _mm512_or_si512(integers(0), _mm512_slli_epi32(integers(half_block), 4));
                _mm_storeu_si128(reinterpret_cast<__m128i*>(bytes), _mm512_cvtepi32_epi8(joined));
                continue;
            }
#endif
            alignas(64) std::int32_t wide[size];
            for (index_t j = 0; j < size; j += lanes) pstore(wide + j, integers(j));
            for (index_t j = 0; j < half_block; ++j)
                bytes[j] = static_cast<std::uint8_t>(wide[j] | (wide[j + half_block] << 4));
        } else {
            const auto integer = [&](float value) {
                return static_cast<std::uint8_t>(std::clamp(static_cast<int>(value * inverse + 8.5f), 0, 15));
            };
            for (index_t j = 0; j < half_block; ++j)
                bytes[j] = static_cast<std::uint8_t>(integer(values[j]) | (integer(values[j + half_block]) << 4));
        }
    }
}

/// A row quantized into blocks of type Block (quantize_q8_0 or quantize_q4_0).
template <class Block, class T>
void quantize_row(const T* x, index_t dim, Block* out) {
    if constexpr (std::is_same_v<Block, q8_0_block>) quantize_q8_0(x, dim, out);
    else quantize_q4_0(x, dim, out);
}

/// Rows [i, i + n) of (b, h) of quantized rows (a quantized_view or a paged quantized pool's view) widened to float,
/// dims[3] values per row, into dst: exactly (a scale of 11 significant bits times an integer of at most 8 bits is
/// a float without rounding).
template <class Acc, class View>
void widen_rows(const View& x, index_t b, index_t h, index_t i, index_t n, Acc* dst) {
    using Block = row_scalar_t<View>;
    static_assert(is_quantized_block_v<Block>, "widen_rows reads quantized rows");
    const index_t blocks = x.dims[3] / Block::size;
    for (index_t r = 0; r < n; ++r) {
        const Block* row = x.row(b, h, i + r);
        for (index_t k = 0; k < blocks; ++k) {
            float scale;
            widen(&row[k].scale, 1, &scale);
            const auto d = static_cast<Acc>(scale);
            Acc* out = dst + (r * blocks + k) * Block::size;
            for (index_t j = 0; j < Block::size; ++j) out[j] = d * static_cast<Acc>(block_integer(row[k], j));
        }
    }
}

template <class Block>
shape_words words_of(const quantized_view<Block>& v) {
    return {v.dims, 4, std::is_same_v<Block, q8_0_block> ? " (q8_0 blocks)" : " (q4_0 blocks)"};
}
template <class Block>
std::string spell_view(const quantized_view<Block>& v) {
    return words_of(v).text();
}

/// The view's size checks: a quantized view comes from a cache, which made it well formed.
template <class Block>
void check_view_sizes(const quantized_view<Block>&, const char*) {}

/// The memory a quantized view spans, for the aliasing check of the `_into` forms (strides are >= 0).
template <class Block>
named_range named(const char* name, const quantized_view<Block>& v) {
    index_t last = 0;  // the block after the last one
    for (std::size_t a = 0; a < 3; ++a) {
        if (v.dims[a] <= 0) return {name, words_of(v), {}};
        last += (v.dims[a] - 1) * v.strides[a];
    }
    return {name, words_of(v), range_of(v.data, last + v.dims[3] / Block::size)};
}

template <class Block>
struct tensor_traits<quantized_view<Block>> {
    static constexpr bool supported = true;
    static constexpr bool row_major = true;
    static constexpr int rank = 4;
    using scalar = Block;
};

/// A quantized view is read as it is.
template <class Block>
quantized_view<Block> checked_input(const quantized_view<Block>& x) {
    return x;
}

}  // namespace detail
}  // namespace attend
