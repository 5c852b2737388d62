// SPDX-License-Identifier: MIT
#pragma once
/// A strict reader of JSON text (RFC 8259) into a small tree, for the headers of files attend reads
/// (interop/safetensors.hpp). Small on purpose: those headers are short and untrusted, so every malformed byte
/// is a format_error naming its offset, nesting is bounded, and attend keeps Eigen as its only dependency.
/// Numbers are kept as their literal text; the caller converts the ones it expects (json_to_u64).

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "../error.hpp"

namespace attend::detail {

/// A parsed JSON value. Objects keep their members in file order as parallel keys / values.
struct json_value {
    enum class kind { null, boolean, number, string, array, object };
    kind type = kind::null;
    std::string text;               ///< a string's contents (unescaped, UTF-8), a number's literal, "true"/"false"
    std::vector<json_value> items;  ///< array elements, or object member values
    std::vector<std::string> keys;  ///< object member names, parallel to items
};

/// Recursive-descent reader; `what` names the text in messages (e.g. "safetensors header of model.safetensors").
class json_reader {
public:
    json_reader(std::string_view text, std::string what) : text_(text), what_(std::move(what)) {}

    /// The one value of the text, surrounded by nothing but whitespace. Throws format_error
    /// attend.format.header_json naming the byte offset of the first error.
    json_value parse() {
        skip_space();
        json_value v = value(0);
        skip_space();
        if (at_ != text_.size()) fail("unexpected text after the top-level value");
        return v;
    }

private:
    static constexpr int max_depth = 64;

    [[noreturn]] void fail(const std::string& why) const {
        throw format_error("attend.format.header_json", concat(what_, ": invalid JSON at byte ", at_, ": ", why));
    }

    bool done() const { return at_ >= text_.size(); }
    char peek() const { return done() ? '\0' : text_[at_]; }

    void skip_space() {
        while (!done() && (text_[at_] == ' ' || text_[at_] == '\t' || text_[at_] == '\n' || text_[at_] == '\r')) ++at_;
    }

    void expect(char c) {
        if (peek() != c || done()) fail(concat("expected '", c, "'"));
        ++at_;
    }

    void literal(std::string_view word) {
        if (text_.substr(at_, word.size()) != word) fail(concat("expected ", word));
        at_ += word.size();
    }

    json_value value(int depth) {
        if (depth > max_depth) fail(concat("nesting deeper than ", max_depth, " levels"));
        json_value v;
        switch (peek()) {
            case '{': object(v, depth); break;
            case '[': array(v, depth); break;
            case '"':
                v.type = json_value::kind::string;
                v.text = string();
                break;
            case 't':
                literal("true");
                v.type = json_value::kind::boolean;
                v.text = "true";
                break;
            case 'f':
                literal("false");
                v.type = json_value::kind::boolean;
                v.text = "false";
                break;
            case 'n': literal("null"); break;
            default:
                if (peek() == '-' || (peek() >= '0' && peek() <= '9')) {
                    v.type = json_value::kind::number;
                    v.text = number();
                } else {
                    fail(done() ? "unexpected end of the text" : "expected a value");
                }
        }
        return v;
    }

    void object(json_value& v, int depth) {
        v.type = json_value::kind::object;
        elements('{', '}', [&] {
            if (peek() != '"' || done()) fail("expected a member name in quotes");
            v.keys.push_back(string());
            skip_space();
            expect(':');
            skip_space();
            v.items.push_back(value(depth + 1));
        });
    }

    void array(json_value& v, int depth) {
        v.type = json_value::kind::array;
        elements('[', ']', [&] { v.items.push_back(value(depth + 1)); });
    }

    /// `open`, then zero or more elements read by read_one separated by commas, then `close`.
    template <class ReadOne>
    void elements(char open, char close, ReadOne&& read_one) {
        expect(open);
        skip_space();
        if (peek() == close && !done()) {
            ++at_;
            return;
        }
        for (;;) {
            skip_space();
            read_one();
            skip_space();
            if (peek() == ',' && !done()) {
                ++at_;
                continue;
            }
            expect(close);
            return;
        }
    }

    std::string number() {
        const std::size_t begin = at_;
        const auto digits = [&] {
            const std::size_t from = at_;
            while (!done() && text_[at_] >= '0' && text_[at_] <= '9') ++at_;
            return at_ - from;
        };
        if (peek() == '-') ++at_;
        if (peek() == '0' && !done()) {
            ++at_;
        } else if (digits() == 0) {
            fail("expected digits");
        }
        if (peek() == '.' && !done()) {
            ++at_;
            if (digits() == 0) fail("expected digits after '.'");
        }
        if ((peek() == 'e' || peek() == 'E') && !done()) {
            ++at_;
            if ((peek() == '+' || peek() == '-') && !done()) ++at_;
            if (digits() == 0) fail("expected digits in the exponent");
        }
        return std::string(text_.substr(begin, at_ - begin));
    }

    unsigned hex4() {
        unsigned code = 0;
        for (int n = 0; n < 4; ++n, ++at_) {
            const char c = peek();
            if (done()) fail("unterminated \\u escape");
            code <<= 4;
            if (c >= '0' && c <= '9') code |= static_cast<unsigned>(c - '0');
            else if (c >= 'a' && c <= 'f') code |= static_cast<unsigned>(c - 'a' + 10);
            else if (c >= 'A' && c <= 'F') code |= static_cast<unsigned>(c - 'A' + 10);
            else fail("expected four hex digits after \\u");
        }
        return code;
    }

    static void append_utf8(std::string& out, unsigned code) {
        const auto byte = [&](unsigned b) { out.push_back(static_cast<char>(static_cast<unsigned char>(b))); };
        if (code < 0x80) {
            byte(code);
        } else if (code < 0x800) {
            byte(0xC0 | (code >> 6));
            byte(0x80 | (code & 0x3F));
        } else if (code < 0x10000) {
            byte(0xE0 | (code >> 12));
            byte(0x80 | ((code >> 6) & 0x3F));
            byte(0x80 | (code & 0x3F));
        } else {
            byte(0xF0 | (code >> 18));
            byte(0x80 | ((code >> 12) & 0x3F));
            byte(0x80 | ((code >> 6) & 0x3F));
            byte(0x80 | (code & 0x3F));
        }
    }

    std::string string() {
        expect('"');
        std::string out;
        for (;;) {
            if (done()) fail("unterminated string");
            const char c = text_[at_];
            if (c == '"') {
                ++at_;
                return out;
            }
            if (static_cast<unsigned char>(c) < 0x20) fail("control character in a string");
            if (c != '\\') {
                out.push_back(c);
                ++at_;
                continue;
            }
            ++at_;
            const char e = peek();
            if (done()) fail("unterminated escape");
            ++at_;
            switch (e) {
                case '"': out.push_back('"'); break;
                case '\\': out.push_back('\\'); break;
                case '/': out.push_back('/'); break;
                case 'b': out.push_back('\b'); break;
                case 'f': out.push_back('\f'); break;
                case 'n': out.push_back('\n'); break;
                case 'r': out.push_back('\r'); break;
                case 't': out.push_back('\t'); break;
                case 'u': {
                    unsigned code = hex4();
                    if (code >= 0xD800 && code <= 0xDBFF) {  // a high surrogate needs its low half
                        if (text_.substr(at_, 2) != "\\u") fail("high surrogate without a low surrogate");
                        at_ += 2;
                        const unsigned low = hex4();
                        if (low < 0xDC00 || low > 0xDFFF) fail("high surrogate without a low surrogate");
                        code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00);
                    } else if (code >= 0xDC00 && code <= 0xDFFF) {
                        fail("low surrogate without a high surrogate");
                    }
                    append_utf8(out, code);
                    break;
                }
                default: --at_; fail("unknown escape");
            }
        }
    }

    std::string_view text_;
    std::string what_;
    std::size_t at_ = 0;
};

/// A JSON number that must be a non-negative integer below 2^64 (no sign, fraction or exponent); false when it
/// is not one or does not fit.
inline bool json_to_u64(const json_value& v, std::uint64_t& out) {
    if (v.type != json_value::kind::number || v.text.empty()) return false;
    std::uint64_t n = 0;
    for (const char c : v.text) {
        if (c < '0' || c > '9') return false;
        const auto digit = static_cast<std::uint64_t>(c - '0');
        if (n > (std::numeric_limits<std::uint64_t>::max() - digit) / 10) return false;
        n = n * 10 + digit;
    }
    out = n;
    return true;
}

}  // namespace attend::detail
