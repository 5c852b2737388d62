// SPDX-License-Identifier: MIT
#pragma once
/// Decoding fuzz input: every decision of a fuzz case is read from the input bytes, so libFuzzer's mutations map to
/// nearby cases and a saved input replays the same case on every compiler. Past the end every read returns 0,
/// which keeps short inputs meaningful (the smallest, most ordinary case) instead of rejected.

#include <cstddef>
#include <cstdint>

#include <attend/tensor.hpp>

#include "support/random.hpp"

namespace attend_fuzz {

using attend::index_t;

class fuzz_input {
public:
    fuzz_input(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}

    std::uint8_t byte() { return pos_ < size_ ? data_[pos_++] : std::uint8_t{0}; }

    /// Eight bytes, little-endian: seeds of the value generators.
    std::uint64_t word() {
        std::uint64_t w = 0;
        for (int n = 0; n < 8; ++n) w |= static_cast<std::uint64_t>(byte()) << (8 * n);
        return w;
    }

    /// An integer in [lo, hi]; hi - lo < 65536.
    index_t in_range(index_t lo, index_t hi) {
        const auto span = static_cast<std::uint32_t>(hi - lo + 1);
        std::uint32_t raw = byte();
        if (span > 256) raw = raw << 8 | byte();
        return lo + static_cast<index_t>(raw % span);
    }

    /// True with probability about numerator / 256.
    bool chance(unsigned numerator) { return byte() < numerator; }

    /// One of n choices (n <= 256).
    int choose(int n) { return static_cast<int>(byte() % static_cast<unsigned>(n)); }

    bool exhausted() const { return pos_ >= size_; }

private:
    const std::uint8_t* data_;
    std::size_t size_;
    std::size_t pos_ = 0;
};

/// Bulk values (tensor elements) come from attend_test::rng seeded by a word of the input, so they cost no input
/// bytes each.
using value_stream = attend_test::rng;

}  // namespace attend_fuzz
