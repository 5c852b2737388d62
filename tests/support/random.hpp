// SPDX-License-Identifier: MIT
#pragma once
/// Seeded randomness for property tests: a platform-independent generator (splitmix64, so a failing seed
/// reproduces on every compiler and standard library), tensor fillers, and repeat(n), which scales how many
/// random configurations a property test runs by the environment variable ATTEND_TEST_REPEAT_SCALE.

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>

#include <attend/tensor.hpp>

namespace attend_test {

/// n scaled by ATTEND_TEST_REPEAT_SCALE (a double, default 1; e.g. 0.1 for a quick run, 10 for a soak), at
/// least 1.
inline int repeat(int n) {
    double scale = 1.0;
    if (const char* text = std::getenv("ATTEND_TEST_REPEAT_SCALE")) {
        char* end = nullptr;
        const double parsed = std::strtod(text, &end);
        if (end != text && std::isfinite(parsed) && parsed > 0) scale = parsed;
    }
    const double scaled = std::ceil(static_cast<double>(n) * scale);
    if (scaled < 1) return 1;
    if (scaled > 1e9) return 1000000000;
    return static_cast<int>(scaled);
}

/// splitmix64: small, fast, and the same sequence everywhere (std:: distributions are implementation-defined).
class rng {
public:
    explicit rng(std::uint64_t seed) : state_(seed) {}

    std::uint64_t next() {
        std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ULL);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
        return z ^ (z >> 31);
    }

    /// Uniform in [0, 1).
    double uniform() { return static_cast<double>(next() >> 11) * (1.0 / 9007199254740992.0); }

    /// Uniform in [lo, hi).
    double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }

    /// Uniform integer in [lo, hi] (inclusive).
    attend::index_t uniform_int(attend::index_t lo, attend::index_t hi) {
        const auto span = static_cast<std::uint64_t>(hi - lo) + 1;
        return lo + static_cast<attend::index_t>(next() % span);
    }

    /// Standard normal (Box-Muller).
    double normal() {
        const double u1 = (static_cast<double>(next() >> 11) + 1.0) * (1.0 / 9007199254740992.0);
        const double u2 = uniform();
        return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586476925286766559 * u2);
    }

    /// True with probability p.
    bool bernoulli(double p) { return uniform() < p; }

private:
    std::uint64_t state_;
};

/// Fills t with uniform values in [lo, hi) from `seed`.
template <class T, int Rank>
void fill_uniform(attend::tensor<T, Rank>& t, std::uint64_t seed, double lo = -1.0, double hi = 1.0) {
    rng g(seed);
    for (attend::index_t k = 0; k < t.size(); ++k) t.data()[k] = static_cast<T>(g.uniform(lo, hi));
}

/// Fills t with standard normal values from `seed`.
template <class T, int Rank>
void fill_normal(attend::tensor<T, Rank>& t, std::uint64_t seed) {
    rng g(seed);
    for (attend::index_t k = 0; k < t.size(); ++k) t.data()[k] = static_cast<T>(g.normal());
}

/// A tensor of the given dimensions filled uniformly in [-1, 1) from `seed`.
template <class T, class... Dims>
attend::tensor<T, static_cast<int>(sizeof...(Dims))> random_tensor(std::uint64_t seed, Dims... dims) {
    attend::tensor<T, static_cast<int>(sizeof...(Dims))> t(static_cast<attend::index_t>(dims)...);
    fill_uniform(t, seed);
    return t;
}

}  // namespace attend_test
