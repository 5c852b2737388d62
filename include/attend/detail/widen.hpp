// SPDX-License-Identifier: MIT
#pragma once
/// Widening a run of stored values to the accumulation type, exactly, in loops the compiler vectorizes, and
/// narrowing results back to the storage type, rounded once. Eigen 3.4 converts half and bfloat16 one element at
/// a time inside expressions (its cast is not vectorized there), which made a decode over a 16-bit cache slower
/// than over a float one; these are what the kernels and the input scans use instead.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include <Eigen/Core>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "../tensor.hpp"

namespace attend::detail {

/// dst[j] = src[j] for j < n, converted (float to double, or a copy).
template <class S, class A>
void widen(const S* src, index_t n, A* dst) {
    for (index_t j = 0; j < n; ++j) dst[j] = static_cast<A>(src[j]);
}

/// The bits of a 16-, 32- or 64-bit value as an unsigned integer of its width. With the sign cleared, their integer
/// order is the magnitudes' order (for floating-point types), and bits at or above +inf's are +-inf or NaN.
template <class T>
auto bits_of(T x) {
    static_assert(sizeof(T) == 2 || sizeof(T) == 4 || sizeof(T) == 8,
                  "attend: bits_of takes a 16-, 32- or 64-bit type");
    using bits = std::conditional_t<sizeof(T) == 8, std::uint64_t,
                                    std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint16_t>>;
    bits b;
    std::memcpy(&b, static_cast<const void*>(&x), sizeof b);
    return b;
}

/// bfloat16 is the upper half of a float: shift the bits up.
inline void widen(const Eigen::bfloat16* src, index_t n, float* dst) {
    for (index_t j = 0; j < n; ++j) {
        const std::uint32_t bits = static_cast<std::uint32_t>(bits_of(src[j])) << 16;
        std::memcpy(dst + j, &bits, 4);
    }
}

/// fp16 to float: F16C eight at a time where the target has it; otherwise the exponent is rebiased in integer
/// arithmetic (infinities and NaN keep an all-ones exponent, subnormals are renormalized through one float
/// subtraction), branch-free so the loop vectorizes.
inline void widen(const Eigen::half* src, index_t n, float* dst) {
    index_t j = 0;
#if defined(__F16C__)
    for (; j + 8 <= n; j += 8) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j));
        _mm256_storeu_ps(dst + j, _mm256_cvtph_ps(h));
    }
    for (; j < n; ++j) dst[j] = _cvtsh_ss(bits_of(src[j]));  // the tail (a q8_0 block's scale: one value)
#endif
    constexpr std::uint32_t shifted_exponent = 0x7c00u << 13;  // fp16's exponent field, where float keeps it
    constexpr float magic = 0x1p-14f;                          // 2^-14: fp16's smallest normal
    for (; j < n; ++j) {
        const std::uint32_t h = bits_of(src[j]);
        std::uint32_t u = (h & 0x7fffu) << 13;  // exponent and mantissa in float's place
        const std::uint32_t exponent = u & shifted_exponent;
        u += (127u - 15u) << 23;                                      // rebias
        u += exponent == shifted_exponent ? (128u - 16u) << 23 : 0u;  // inf and NaN: all ones
        float f;
        const std::uint32_t sub = u + (1u << 23);  // zero and subnormals: as 2^-14 (1 + m) - 2^-14
        std::memcpy(&f, &sub, 4);
        f -= magic;
        float normal;
        std::memcpy(&normal, &u, 4);
        float result = exponent == 0 ? f : normal;
        std::uint32_t r;
        std::memcpy(&r, &result, 4);
        r |= (h & 0x8000u) << 16;  // the sign
        std::memcpy(dst + j, &r, 4);
    }
}

/// dst[j] = src[j] rounded to S once (to nearest even), for j < n: the outputs' way back to the storage type.
template <class A, class S>
void narrow(const A* src, index_t n, S* dst) {
    for (index_t j = 0; j < n; ++j) dst[j] = static_cast<S>(src[j]);
}

/// float to fp16, to nearest even: F16C eight at a time where the target has it, else Eigen's conversion. Eigen 3.4
/// takes F16C for its own conversion only under clang (under GCC its compiler test is false), so a GCC build had
/// rounded every output value in integer arithmetic, one at a time: 4 % of an fp16 prefill's time (Zen 5). The same
/// bits as Eigen's rounding for every value but NaN, which stays NaN (F16C keeps the payload's upper bits, where
/// Eigen's integer path writes 0x7e00).
inline void narrow(const float* src, index_t n, Eigen::half* dst) {
    index_t j = 0;
#if defined(__F16C__)
    for (; j + 8 <= n; j += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j), _mm256_cvtps_ph(_mm256_loadu_ps(src + j), 0));
    for (; j < n; ++j) {  // 0: to nearest even
        const auto bits = static_cast<std::uint16_t>(_mm_cvtsi128_si32(_mm_cvtps_ph(_mm_set_ss(src[j]), 0)));
        std::memcpy(static_cast<void*>(dst + j), &bits, 2);
    }
#endif
    for (; j < n; ++j) dst[j] = static_cast<Eigen::half>(src[j]);
}

/// float to bfloat16, to nearest even, NaN as Eigen's conversion makes it (0x7fc0 with the sign): Eigen's own
/// rounding, branch-free so the loop vectorizes (Eigen's call per value does not).
inline void narrow(const float* src, index_t n, Eigen::bfloat16* dst) {
    for (index_t j = 0; j < n; ++j) {
        std::uint32_t u;
        std::memcpy(&u, src + j, 4);
        const std::uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
        const std::uint32_t quiet_nan = (u >> 16 & 0x8000u) | 0x7fc0u;
        const auto bits = static_cast<std::uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
        std::memcpy(static_cast<void*>(dst + j), &bits, 2);
    }
}

/// The largest bits of |x| over n values (bits_of with the sign cleared): an unsigned max the compiler vectorizes.
template <class T>
auto largest_magnitude_bits(const T* x, index_t n) {
    using bits = decltype(bits_of(T{}));
    constexpr bits magnitude = std::numeric_limits<bits>::max() >> 1;  // all but the sign bit
    bits largest = 0;
    for (index_t j = 0; j < n; ++j) largest = std::max(largest, static_cast<bits>(bits_of(x[j]) & magnitude));
    return largest;
}

/// Whether any of n 16-bit values is NaN or +-inf: an all-ones exponent, so magnitude bits at or above it.
template <class T>
bool any_non_finite_16(const T* x, index_t n) {
    const std::uint16_t exponent = std::is_same_v<T, Eigen::half> ? 0x7c00 : 0x7f80;
    return largest_magnitude_bits(x, n) >= exponent;
}

}  // namespace attend::detail
