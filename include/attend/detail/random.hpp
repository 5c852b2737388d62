// SPDX-License-Identifier: MIT
#pragma once
/// The library's one source of randomness: counter-based generators built on SplitMix64's finalizer. A number is
/// a pure function of a seed and its coordinates (never of a hidden state), so dropout masks, initial weights and
/// learned position tables are the same on every compiler and standard library, for any thread count and in any
/// fill order, and backward can replay a forward's dropout.

#include <cmath>
#include <cstdint>

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

/// The top 53 bits of x as a double in [0, 1).
inline double unit_interval(std::uint64_t x) { return static_cast<double>(x >> 11) * 0x1.0p-53; }

/// A uniform double in [0, 1) at `coordinates` of the stream (seed, salt): the seed mixed with the salt, then with
/// each coordinate in turn. Different salts keep the streams of different uses (dropout, weights) apart.
template <class... Coordinates>
double counter_uniform(std::uint64_t seed, std::uint64_t salt, Coordinates... coordinates) {
    std::uint64_t x = mix64(seed ^ salt);
    ((x = mix64(x ^ static_cast<std::uint64_t>(coordinates))), ...);
    return unit_interval(x);
}

/// Element `k` of a standard-normal stream of `seed` (Box-Muller over SplitMix64 outputs 2k and 2k + 1).
inline double counter_normal(std::uint64_t seed, std::uint64_t k) {
    constexpr double two_pi = 6.283185307179586476925286766559;
    const auto splitmix = [seed](std::uint64_t n) { return mix64(seed + (n + 1) * 0x9E3779B97F4A7C15ULL); };
    const double u1 = unit_interval(splitmix(2 * k)) + 0x1.0p-53;  // (0, 1]: the log is finite
    const double u2 = unit_interval(splitmix(2 * k + 1));          // [0, 1)
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(two_pi * u2);
}

}  // namespace attend::detail
