// SPDX-License-Identifier: MIT
// What a mask allows and where attention goes, as a picture: two sequences (12 real tokens, and 9 real tokens
// padded to 12) under causal && sliding_window(4, 0, top_left) && key_padding && query_padding. Writes
// attention_heatmap.png: one row per sequence, the mask on the left (dark = may attend, light = forbidden, gray =
// padded query), the weights of head 0 on the right (white 0 to dark blue 1, on a square-root scale so small
// weights stay visible). Prints the same as text, and checks that docs/attention_heatmap.png (shown in the README)
// is this image, byte for byte.
//
// The PNG writer is the smallest complete one: 8-bit RGB, each row filtered with PNG's "Up" filter (a row equal to
// the one above becomes zeros), compressed with deflate's fixed Huffman code and back-references to the previous
// pixel, the previous byte or the row above; CRC-32 per chunk and Adler-32 over the data. No library needed.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include <attend/attend.hpp>

namespace {

using attend::index_t;
using byte_string = std::vector<std::uint8_t>;

// ---------------------------------------------------------------------------------------------------------
// PNG

std::uint32_t crc32(const std::uint8_t* data, std::size_t size, std::uint32_t crc = 0) {
    crc = ~crc;
    for (std::size_t n = 0; n < size; ++n) {
        crc ^= data[n];
        for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
    }
    return ~crc;
}

std::uint32_t adler32(const byte_string& data) {
    std::uint32_t a = 1, b = 0;
    for (const std::uint8_t x : data) {
        a = (a + x) % 65521;
        b = (b + a) % 65521;
    }
    return (b << 16) | a;
}

/// Deflate bits, least significant first; Huffman codes go most significant bit first.
class bit_writer {
public:
    void bits(std::uint32_t value, int count) {
        for (int k = 0; k < count; ++k) push((value >> k) & 1u);
    }
    void code(std::uint32_t value, int count) {
        for (int k = count - 1; k >= 0; --k) push((value >> k) & 1u);
    }
    byte_string finish() {
        if (used_ != 0) out_.push_back(current_);
        return out_;
    }

private:
    void push(std::uint32_t bit) {
        current_ = static_cast<std::uint8_t>(current_ | (bit << used_));
        if (++used_ == 8) {
            out_.push_back(current_);
            current_ = 0;
            used_ = 0;
        }
    }
    byte_string out_;
    std::uint8_t current_ = 0;
    int used_ = 0;
};

/// A literal or the end-of-block symbol (256) in deflate's fixed Huffman code.
void fixed_literal(bit_writer& w, unsigned symbol) {
    if (symbol < 144) w.code(0x30 + symbol, 8);
    else if (symbol < 256) w.code(0x190 + symbol - 144, 9);
    else if (symbol < 280) w.code(symbol - 256, 7);
    else w.code(0xC0 + symbol - 280, 8);
}

/// A back-reference of `length` (3..258) bytes at `distance` (1..32768).
void fixed_match(bit_writer& w, unsigned length, unsigned distance) {
    static constexpr std::array<unsigned, 29> length_base = {3,  4,  5,  6,   7,   8,   9,   10,  11, 13,
                                                             15, 17, 19, 23,  27,  31,  35,  43,  51, 59,
                                                             67, 83, 99, 115, 131, 163, 195, 227, 258};
    static constexpr std::array<int, 29> length_extra = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2,
                                                         2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 0};
    static constexpr std::array<unsigned, 30> distance_base = {1,    2,    3,    4,     5,     7,    9,    13,
                                                               17,   25,   33,   49,    65,    97,   129,  193,
                                                               257,  385,  513,  769,   1025,  1537, 2049, 3073,
                                                               4097, 6145, 8193, 12289, 16385, 24577};
    unsigned l = 28;
    while (length_base[l] > length) --l;
    fixed_literal(w, 257 + l);
    w.bits(length - length_base[l], length_extra[l]);
    unsigned d = 29;
    while (distance_base[d] > distance) --d;
    w.code(d, 5);
    w.bits(distance - distance_base[d], static_cast<int>(d < 4 ? 0 : d / 2 - 1));
}

/// zlib stream of `data`: one fixed-Huffman deflate block whose matches look back `distances` bytes.
byte_string zlib_compress(const byte_string& data, const std::array<unsigned, 3>& distances) {
    bit_writer w;
    w.bits(1, 1);  // BFINAL
    w.bits(1, 2);  // BTYPE 01: fixed Huffman codes
    std::size_t at = 0;
    while (at < data.size()) {
        unsigned best = 0, best_distance = 0;
        for (const unsigned d : distances) {
            if (d > at) continue;
            unsigned length = 0;
            while (length < 258 && at + length < data.size() && data[at + length] == data[at + length - d]) ++length;
            if (length > best) {
                best = length;
                best_distance = d;
            }
        }
        if (best >= 3) {
            fixed_match(w, best, best_distance);
            at += best;
        } else {
            fixed_literal(w, data[at++]);
        }
    }
    fixed_literal(w, 256);
    byte_string out{0x78, 0x01};  // deflate, 32 KiB window, no dictionary; (0x78 * 256 + 0x01) % 31 == 0
    const byte_string deflated = w.finish();
    out.insert(out.end(), deflated.begin(), deflated.end());
    const std::uint32_t check = adler32(data);
    for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<std::uint8_t>(check >> shift));
    return out;
}

void put_u32(byte_string& out, std::uint32_t v) {
    for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<std::uint8_t>(v >> shift));
}

void put_chunk(byte_string& out, const char* type, const byte_string& data) {
    put_u32(out, static_cast<std::uint32_t>(data.size()));
    const std::size_t start = out.size();
    out.insert(out.end(), type, type + 4);
    out.insert(out.end(), data.begin(), data.end());
    put_u32(out, crc32(out.data() + start, out.size() - start));
}

/// An RGB image, row-major, 3 bytes per pixel.
struct image {
    index_t width, height;
    byte_string rgb;

    image(index_t w, index_t h) : width(w), height(h), rgb(static_cast<std::size_t>(w * h * 3), 255) {}
    void fill(index_t x0, index_t y0, index_t w, index_t h, std::array<std::uint8_t, 3> color) {
        for (index_t y = y0; y < y0 + h; ++y)
            for (index_t x = x0; x < x0 + w; ++x)
                for (std::size_t c = 0; c < 3; ++c) rgb[static_cast<std::size_t>((y * width + x) * 3) + c] = color[c];
    }
};

byte_string png(const image& img) {
    const auto row_bytes = static_cast<std::size_t>(img.width * 3);
    byte_string filtered;  // each row: filter type 2 ("Up"), then the byte-wise difference to the row above
    for (index_t y = 0; y < img.height; ++y) {
        filtered.push_back(2);
        for (std::size_t x = 0; x < row_bytes; ++x) {
            const std::uint8_t above = y == 0 ? 0 : img.rgb[static_cast<std::size_t>(y - 1) * row_bytes + x];
            filtered.push_back(static_cast<std::uint8_t>(img.rgb[static_cast<std::size_t>(y) * row_bytes + x] - above));
        }
    }
    byte_string out{0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
    byte_string header;
    put_u32(header, static_cast<std::uint32_t>(img.width));
    put_u32(header, static_cast<std::uint32_t>(img.height));
    header.insert(header.end(), {8, 2, 0, 0, 0});  // 8 bits, RGB, deflate, adaptive filters, no interlace
    put_chunk(out, "IHDR", header);
    put_chunk(out, "IDAT", zlib_compress(filtered, {3, 1, static_cast<unsigned>(row_bytes + 1)}));
    put_chunk(out, "IEND", {});
    return out;
}

// ---------------------------------------------------------------------------------------------------------
// The attention case

constexpr index_t batch = 2, len = 12, head_dim = 4, cell = 12, gap = 1, margin = 8, spacing = 16;
constexpr index_t panel = len * (cell + gap) + gap;

/// Deterministic inputs in [-1, 1): a linear congruential sequence.
attend::tensor<double, 4> inputs(std::uint32_t seed) {
    attend::tensor<double, 4> t(batch, 1, len, head_dim);
    std::uint32_t s = seed;
    for (index_t n = 0; n < t.size(); ++n) {
        s = s * 1664525u + 1013904223u;
        t.data()[n] = static_cast<double>(s >> 8) / static_cast<double>(1u << 23) - 1.0;
    }
    return t;
}

std::array<std::uint8_t, 3> blend(double t) {  // white (t = 0) to dark blue (t = 1)
    const std::array<double, 3> dark{8, 48, 107};
    std::array<std::uint8_t, 3> c{};
    for (std::size_t k = 0; k < 3; ++k) c[k] = static_cast<std::uint8_t>(std::lround(255.0 + (dark[k] - 255.0) * t));
    return c;
}

}  // namespace

int main() {
    using attend::index_t;
    const std::vector<index_t> lengths{12, 9};
    const auto mask = attend::causal(attend::alignment::top_left) &&
                      attend::sliding_window(4, 0, attend::alignment::top_left) && attend::key_padding(lengths) &&
                      attend::query_padding(lengths);
    const attend::score_shape shape{batch, 1, len, len};
    std::cout << "mask: causal && sliding_window(4, 0) && key_padding({12, 9}) && query_padding({12, 9})\n"
              << attend::to_string(mask, shape);

    const auto q = inputs(1), k = inputs(2), v = inputs(3);
    attend::sdpa_options options;
    options.need_weights = true;
    const auto r = attend::scaled_dot_product_attention(q, k, v, mask, options);
    const auto allowed = attend::materialize(mask, shape);

    image img(margin * 2 + panel * 2 + spacing, margin * 2 + panel * batch + spacing * (batch - 1));
    std::cout << "weights x 100 (. = forbidden):\n";
    for (index_t b = 0; b < batch; ++b) {
        std::cout << "batch " << b << ":\n";
        const index_t top = margin + b * (panel + spacing);
        const index_t left_mask = margin, left_weights = margin + panel + spacing;
        img.fill(left_mask, top, panel, panel, {200, 200, 200});  // grid lines
        img.fill(left_weights, top, panel, panel, {200, 200, 200});
        for (index_t i = 0; i < len; ++i) {
            const bool padded = i >= lengths[static_cast<std::size_t>(b)];
            std::cout << 'q' << std::setw(2) << std::left << i << std::right << ':';
            for (index_t j = 0; j < len; ++j) {
                const double w = r.weights(b, 0, i, j);
                const bool may = allowed(b, 0, i, j);
                const index_t y = top + gap + i * (cell + gap), dx = gap + j * (cell + gap);
                const std::array<std::uint8_t, 3> gray{150, 150, 150}, light{238, 238, 238}, dark{8, 48, 107};
                img.fill(left_mask + dx, y, cell, cell, padded ? gray : may ? dark : light);
                img.fill(left_weights + dx, y, cell, cell, padded ? gray : blend(std::sqrt(w)));
                if (padded) continue;
                if (may) std::cout << std::setw(4) << std::lround(w * 100);
                else std::cout << "   .";
            }
            std::cout << (padded ? "  (padded)\n" : "\n");
        }
    }

    const byte_string file = png(img);
    std::ofstream("attention_heatmap.png", std::ios::binary)
        .write(reinterpret_cast<const char*>(file.data()), static_cast<std::streamsize>(file.size()));
    std::ostringstream crc;
    crc << std::hex << std::setw(8) << std::setfill('0') << crc32(file.data(), file.size());
    std::cout << "wrote attention_heatmap.png: " << img.width << " x " << img.height << " pixels, " << file.size()
              << " bytes, crc32 " << crc.str() << '\n';
#ifdef ATTEND_SOURCE_DIR
    std::ifstream committed(ATTEND_SOURCE_DIR "/docs/attention_heatmap.png", std::ios::binary);
    const byte_string docs((std::istreambuf_iterator<char>(committed)), std::istreambuf_iterator<char>());
    const bool same = docs == file;
    std::cout << "docs/attention_heatmap.png is this image: " << (same ? "yes" : "no") << '\n';
    if (!same) std::cerr << "refresh it: cp attention_heatmap.png " << ATTEND_SOURCE_DIR << "/docs/\n";
    return same ? 0 : 1;
#else
    return 0;
#endif
}
