// SPDX-License-Identifier: MIT
// Tests of attend/interop/safetensors.hpp: nn.MultiheadAttention state dicts saved by
// tests/data/generate_safetensors.py load and reproduce PyTorch's outputs; well-formed files read back exactly
// (escaped names, metadata, scalars, empty tensors, F32 <-> F64); and every malformed file, written here byte by
// byte, is a format_error with its own id before any tensor is handed out.
#include <attend/interop/safetensors.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iostream>
#include <limits>
#include <string>
#include <vector>

#include "support/errors.hpp"
#include "support/golden.hpp"
#include "support/scratch_files.hpp"

namespace {

using attend::index_t;
using attend::tensor;
using attend_test::expect_error;
using attend_test::json;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

std::string data_file(const std::string& name) { return std::string(ATTEND_TEST_DATA_DIR) + "/" + name; }

std::string temp_file(const std::string& name) { return attend_test::scratch_files::path("safetensors_" + name); }

void append_u64(std::string& out, std::uint64_t n) {
    for (int k = 0; k < 8; ++k) out.push_back(static_cast<char>((n >> (8 * k)) & 0xFF));
}

/// Little-endian bytes of doubles (F64) or floats (F32), whatever the host's byte order.
std::string f64_bytes(const std::vector<double>& values) {
    std::string out;
    for (const double v : values) {
        std::uint64_t bits;
        std::memcpy(&bits, &v, sizeof bits);
        append_u64(out, bits);
    }
    return out;
}

std::string f32_bytes(const std::vector<float>& values) {
    std::string out;
    for (const float v : values) {
        std::uint32_t bits;
        std::memcpy(&bits, &v, sizeof bits);
        for (int k = 0; k < 4; ++k) out.push_back(static_cast<char>((bits >> (8 * k)) & 0xFF));
    }
    return out;
}

/// Writes a safetensors file: the header length (the header's own unless `claimed_length` is given), the header,
/// the data. Returns the path.
std::string write_file(const std::string& name, const std::string& header, const std::string& data,
                       std::uint64_t claimed_length = std::numeric_limits<std::uint64_t>::max()) {
    std::string bytes;
    append_u64(bytes, claimed_length == std::numeric_limits<std::uint64_t>::max() ? header.size() : claimed_length);
    bytes += header;
    bytes += data;
    const std::string path = temp_file(name);
    std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return path;
}

std::string write_raw(const std::string& name, const std::string& bytes) {
    const std::string path = temp_file(name);
    std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return path;
}

/// A format_error with `id` from opening the file of header `header` and data `data`; returns the message.
std::string open_error(const std::string& name, const std::string& header, const std::string& data,
                       const std::string& id) {
    const std::string path = write_file(name, header, data);
    return expect_error<attend::format_error>([&] { attend::safetensors_file file(path); }, id);
}

// ---------------------------------------------------------------------------------------------------------
// nn.MultiheadAttention state dicts saved by PyTorch's layout (tests/data/mha_safetensors.json)

template <class T>
void check_golden_case(const json& c, double tolerance) {
    const std::string file = c.at("file").get<std::string>();
    SCOPED_TRACE(file);
    const json& cfg = c.at("config");
    const auto config = attend::mha_config{}
                            .with_model_dim(cfg.at("embed_dim").get<index_t>())
                            .with_heads(cfg.at("num_heads").get<index_t>())
                            .with_key_dim(cfg.at("kdim").get<index_t>())
                            .with_value_dim(cfg.at("vdim").get<index_t>())
                            .with_bias(cfg.at("bias").get<bool>());
    const auto m = attend::load_torch_mha<T>(data_file(file), config, c.at("prefix").get<std::string>());
    const json& in = c.at("inputs");
    const auto query = attend_test::to_tensor<T, 3>(in.at("query"), "query");
    const auto key = attend_test::to_tensor<T, 3>(in.at("key"), "key");
    const auto value = attend_test::to_tensor<T, 3>(in.at("value"), "value");
    const json& masks = c.at("masks");
    attend::mha_options options;
    options.attention.need_weights = true;
    options.key_padding =
        attend::forbidden_mask::key_padding(attend_test::to_bool<2>(masks.at("key_padding_mask"), "key_padding"));
    const auto r = m.forward(query, key, value,
                             attend::forbidden_mask::query_key_grid(attend_test::to_bool<2>(masks.at("attn_mask"))),
                             options);
    const json& outputs = c.at("outputs");
    const auto out = attend_test::to_double<3>(outputs.at("out"), "out");
    const auto weights = attend_test::to_double<3>(outputs.at("weights_averaged"), "weights_averaged");
    double e_out = 0, e_w = 0;
    ASSERT_EQ(r.out.size(), out.size());
    ASSERT_EQ(r.averaged_weights().size(), weights.size());
    for (index_t n = 0; n < out.size(); ++n)
        e_out = std::max(e_out, std::abs(static_cast<double>(r.out.data()[n]) - out.data()[n]));
    for (index_t n = 0; n < weights.size(); ++n)
        e_w = std::max(e_w, std::abs(static_cast<double>(r.averaged_weights().data()[n]) - weights.data()[n]));
    std::cout << "  [" << file << ", " << (sizeof(T) == 8 ? "double" : "float") << "] max abs error: out " << e_out
              << ", averaged weights " << e_w << '\n';
    EXPECT_LE(e_out, tolerance);
    EXPECT_LE(e_w, tolerance);
}

TEST(SafetensorsGolden, LoadsSavedMultiheadAttentionAndReproducesPyTorch) {
    const json doc = attend_test::load_golden("mha_safetensors.json");
    ASSERT_EQ(doc.at("cases").size(), 2u);
    for (const json& c : doc.at("cases")) {
        // Both files hold the weights as PyTorch computed with them (F32 ones rounded first), so double is exact
        // to rounding; float adds its own rounding of the inputs and the arithmetic.
        check_golden_case<double>(c, 1e-12);
        check_golden_case<float>(c, 1e-5);
    }
}

TEST(SafetensorsGolden, FileContentsPrefixAndMetadata) {
    const attend::safetensors_file f(data_file("mha_kdim_f32.safetensors"));
    EXPECT_EQ(f.metadata().at("format"), "pt");
    EXPECT_TRUE(f.contains("encoder.attn.q_proj_weight"));
    EXPECT_FALSE(f.contains("encoder.attn.in_proj_weight"));  // kdim != embed_dim: separate projections
    const auto& e = f.entry("encoder.attn.k_proj_weight");
    EXPECT_EQ(e.dtype, "F32");
    EXPECT_EQ(e.shape, (std::vector<index_t>{6, 5}));
    const auto norm = f.read<double, 1>("encoder.norm.weight");  // an unrelated tensor next to the module
    EXPECT_EQ(norm.dimension(0), 4);
    // Entries come in data order and tile the data section.
    std::uint64_t at = 0;
    for (const auto& entry : f.entries()) {
        EXPECT_EQ(entry.begin, at) << entry.name;
        at = entry.end;
    }
    // The wrong prefix finds nothing: the error lists what the file holds.
    const auto msg = expect_error<attend::format_error>(
        [&] { (void)attend::read_torch_mha_parameters<double>(f, "decoder.attn."); }, "attend.format.missing_tensor");
    EXPECT_TRUE(contains(msg, "decoder.attn.out_proj.weight") && contains(msg, "encoder.attn.out_proj.weight")) << msg;
}

TEST(SafetensorsGolden, ConfigThatDoesNotFitTheFileIsTorchWeight) {
    // The packed file is E=8 with 2 heads; a config with other widths names the parameter and both shapes.
    const auto msg = expect_error<attend::shape_error>(
        [] {
            (void)attend::load_torch_mha<double>(data_file("mha_packed.safetensors"),
                                                 attend::mha_config{}.with_model_dim(6).with_heads(2));
        },
        "attend.shape.torch_weight");
    EXPECT_TRUE(contains(msg, "in_proj_weight [24,8]") && contains(msg, "[18,6]")) << msg;
    // Heads are not in a state dict: any count dividing E loads; kv_heads != heads cannot use in_proj_weight.
    EXPECT_NO_THROW((void)attend::load_torch_mha<double>(data_file("mha_packed.safetensors"),
                                                         attend::mha_config{}.with_model_dim(8).with_heads(4)));
    expect_error<attend::shape_error>(
        [] {
            (void)attend::load_torch_mha<double>(data_file("mha_packed.safetensors"),
                                                 attend::mha_config{}.with_model_dim(8).with_heads(2).with_kv_heads(1));
        },
        "attend.shape.torch_weight");
}

// ---------------------------------------------------------------------------------------------------------
// Well-formed files written here

TEST(SafetensorsRead, ValuesShapesNamesAndConversions) {
    const std::vector<double> a{1.5, -2.25, 1e-300, 3.0e300, -0.0, 7.0};
    const std::vector<float> b{0.1f, -3.5f, 1e-30f};
    // Names with escapes (a quote, e-acute, an emoji as a surrogate pair), whitespace everywhere, metadata, a
    // scalar and an empty tensor.
    const std::string header =
        " { \"a\\\"\\u00e9\\ud83d\\ude00\" : {\"dtype\":\"F64\", \"shape\":[2, 3], \"data_offsets\":[0,48]},\n"
        "\t\"b\": {\"shape\": [3], \"dtype\": \"F32\", \"data_offsets\": [48, 60]},"
        " \"s\": {\"dtype\": \"F64\", \"shape\": [], \"data_offsets\": [60, 68]},"
        " \"empty\": {\"dtype\": \"F32\", \"shape\": [0, 4], \"data_offsets\": [68, 68]},"
        " \"__metadata__\": {\"format\": \"pt\", \"note\": \"line\\nbreak\"} }    ";
    const std::string path = write_file("good", header, f64_bytes(a) + f32_bytes(b) + f64_bytes({-9.5}));
    const attend::safetensors_file f(path);
    ASSERT_EQ(f.entries().size(), 4u);
    const std::string name = "a\"\xC3\xA9\xF0\x9F\x98\x80";
    ASSERT_TRUE(f.contains(name));
    EXPECT_EQ(f.metadata().at("note"), "line\nbreak");

    const auto ta = f.read<double, 2>(name);
    ASSERT_EQ(ta.dimension(0), 2);
    ASSERT_EQ(ta.dimension(1), 3);
    for (index_t n = 0; n < 6; ++n) EXPECT_EQ(std::memcmp(&ta.data()[n], &a[static_cast<std::size_t>(n)], 8), 0) << n;
    const auto ta_float = f.read<float, 2>(name);  // F64 into float rounds as a cast does
    for (index_t n = 0; n < 6; ++n) EXPECT_EQ(ta_float.data()[n], static_cast<float>(a[static_cast<std::size_t>(n)]));
    const auto tb = f.read<double, 1>("b");  // F32 into double is exact
    for (index_t n = 0; n < 3; ++n) EXPECT_EQ(tb(n), static_cast<double>(b[static_cast<std::size_t>(n)]));
    EXPECT_EQ((f.read<double, 0>("s")()), -9.5);
    const auto te = f.read<float, 2>("empty");
    EXPECT_EQ(te.dimension(0), 0);
    EXPECT_EQ(te.dimension(1), 4);
}

// ---------------------------------------------------------------------------------------------------------
// Malformed files: one id per kind of damage

TEST(SafetensorsErrors, UnreadableFileIsIo) {
    expect_error<attend::format_error>([] { attend::safetensors_file f(temp_file("does_not_exist")); },
                                       "attend.format.io");
    // A file that shrinks after its header was read fails when a tensor is read, not with garbage.
    const std::string path =
        write_file("shrinks", R"({"x":{"dtype":"F64","shape":[2],"data_offsets":[0,16]}})", f64_bytes({1, 2}));
    const attend::safetensors_file f(path);
    std::string header = R"({"x":{"dtype":"F64","shape":[2],"data_offsets":[0,16]}})";
    std::string bytes;
    append_u64(bytes, header.size());
    write_raw("shrinks", bytes + header + "\x01\x02");
    const auto msg = expect_error<attend::format_error>([&] { (void)f.read<double, 1>("x"); }, "attend.format.io");
    EXPECT_TRUE(contains(msg, "16 bytes of tensor \"x\"")) << msg;
}

TEST(SafetensorsErrors, HeaderLengthBeyondTheFileIsHeaderSize) {
    auto msg = expect_error<attend::format_error>(
        [] { attend::safetensors_file f(write_raw("tiny", std::string("\x10\x00\x00", 3))); },
        "attend.format.header_size");
    EXPECT_TRUE(contains(msg, "3 bytes")) << msg;
    msg = expect_error<attend::format_error>(
        [] { attend::safetensors_file f(write_file("long_claim", "{}", "", 1000)); }, "attend.format.header_size");
    EXPECT_TRUE(contains(msg, "header length 1000 exceeds the bytes after it, 2")) << msg;
    msg = expect_error<attend::format_error>(
        [] { attend::safetensors_file f(write_file("huge_claim", "{}", "", 0xFFFFFFFFFFFFFFF0ULL)); },
        "attend.format.header_size");
    EXPECT_TRUE(contains(msg, "limit of 100000000")) << msg;
}

TEST(SafetensorsErrors, TextThatIsNotJsonIsHeaderJson) {
    const std::vector<std::pair<std::string, std::string>> cases = {
        {"{", "expected a member name"},
        {"{\"a\": }", "expected a value"},
        {"{\"a\": 1,}", "expected a member name"},
        {"{\"a\": [1, 2}", "expected ']'"},
        {"{\"a\": \"no end}", "unterminated string"},
        {"{\"a\": \"bad \\x escape\"}", "unknown escape"},
        {"{\"a\": \"\\ud83d alone\"}", "high surrogate without a low surrogate"},
        {"{\"a\": \"\\ude00\"}", "low surrogate without a high surrogate"},
        {"{\"a\": \"tab\tinside\"}", "control character"},
        {"{\"a\": 01}", "expected '}'"},
        {"{\"a\": 1.}", "expected digits after '.'"},
        {"{\"a\": tru}", "expected true"},
        {"{} {}", "unexpected text after the top-level value"},
        {std::string(100, '[') + std::string(100, ']'), "nesting deeper than 64 levels"},
    };
    for (std::size_t n = 0; n < cases.size(); ++n) {
        SCOPED_TRACE(cases[n].first);
        const auto msg = open_error("json" + std::to_string(n), cases[n].first, "", "attend.format.header_json");
        EXPECT_TRUE(contains(msg, cases[n].second)) << msg;
        EXPECT_TRUE(contains(msg, "at byte")) << msg;
    }
}

TEST(SafetensorsErrors, JsonThatIsNotAHeaderIsHeaderEntry) {
    const std::vector<std::pair<std::string, std::string>> cases = {
        {"[1, 2]", "not a JSON object"},
        {R"({"x": 3})", "the entry is not an object"},
        {R"({"x": {"dtype": "F64", "shape": [1]}})", "exactly dtype, shape and data_offsets"},
        {R"({"x": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8], "extra": 1}})",
         "exactly dtype, shape and data_offsets"},
        {R"({"x": {"dtype": 64, "shape": [1], "data_offsets": [0, 8]}})", "dtype is missing or not a string"},
        {R"({"x": {"dtype": "F64", "shape": 1, "data_offsets": [0, 8]}})", "shape is missing or not an array"},
        {R"({"x": {"dtype": "F64", "shape": [-1], "data_offsets": [0, 8]}})", "shape entry -1"},
        {R"({"x": {"dtype": "F64", "shape": [1.5], "data_offsets": [0, 8]}})", "shape entry 1.5"},
        {R"({"x": {"dtype": "F64", "shape": [9223372036854775808], "data_offsets": [0, 8]}})",
         "shape entry 9223372036854775808"},
        {R"({"x": {"dtype": "F64", "shape": [1], "data_offsets": [0]}})", "not [begin, end]"},
        {R"({"x": {"dtype": "F64", "shape": [1], "data_offsets": [0, "8"]}})", "not two non-negative integers"},
        {R"({"x": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]},
             "x": {"dtype": "F64", "shape": [1], "data_offsets": [8, 16]}})",
         "\"x\" appears twice"},
        {R"({"__metadata__": [1]})", "__metadata__ is not an object"},
        {R"({"__metadata__": {"k": 1}})", "__metadata__ value \"k\" is not a string"},
    };
    for (std::size_t n = 0; n < cases.size(); ++n) {
        SCOPED_TRACE(cases[n].first);
        const auto msg =
            open_error("entry" + std::to_string(n), cases[n].first, f64_bytes({1, 2}), "attend.format.header_entry");
        EXPECT_TRUE(contains(msg, cases[n].second)) << msg;
    }
}

TEST(SafetensorsErrors, DtypesTheFormatDoesNotDefineOrAttendDoesNotReadAreDtype) {
    auto msg = open_error("dtype_unknown", R"({"x": {"dtype": "F17", "shape": [1], "data_offsets": [0, 8]}})",
                          f64_bytes({1}), "attend.format.dtype");
    EXPECT_TRUE(contains(msg, "\"F17\"")) << msg;
    // I32 and U8 are valid files, but not tensors attend reads (F16, BF16, F32, F64 are).
    const std::string path = write_file(
        "dtype_other",
        R"({"u": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}, "i": {"dtype": "I32", "shape": [1], "data_offsets": [4, 8]}})",
        std::string(8, '\0'));
    const attend::safetensors_file f(path);
    msg = expect_error<attend::format_error>([&] { (void)f.read<float, 1>("u"); }, "attend.format.dtype");
    EXPECT_TRUE(contains(msg, "U8") && contains(msg, "F16, BF16, F32 and F64")) << msg;
    expect_error<attend::format_error>([&] { (void)f.read<double, 1>("i"); }, "attend.format.dtype");
    expect_error<attend::format_error>([&] { (void)f.read<Eigen::bfloat16, 1>("i"); }, "attend.format.dtype");
}

TEST(SafetensorsErrors, RangesThatDoNotFitShapesOrTileTheDataAreDataOffsets) {
    const std::vector<std::tuple<std::string, std::string, std::string>> cases = {
        // header, data, what the message says
        {R"({"x": {"dtype": "F64", "shape": [2], "data_offsets": [0, 8]}})", f64_bytes({1}), "needs 16 bytes"},
        {R"({"x": {"dtype": "F64", "shape": [1], "data_offsets": [8, 0]}})", f64_bytes({1}), "a negative range"},
        {R"({"x": {"dtype": "F64", "shape": [1], "data_offsets": [8, 16]}})", f64_bytes({1, 2}),
         "starts at byte 8 of the data, expected 0"},  // a gap before the first tensor
        {R"({"x": {"dtype": "F64", "shape": [2], "data_offsets": [0, 16]},
             "y": {"dtype": "F64", "shape": [1], "data_offsets": [8, 16]}})",
         f64_bytes({1, 2}), "expected 16"},  // overlap
        {R"({"x": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}})", f64_bytes({1, 2}),
         "the file holds 16 bytes of data"},  // trailing bytes
        {R"({"x": {"dtype": "F64", "shape": [2], "data_offsets": [0, 16]}})", f64_bytes({1}),
         "the file holds 8 bytes of data"},  // truncated data
        {R"({"x": {"dtype": "F64", "shape": [4294967296, 4294967296], "data_offsets": [0, 8]}})", f64_bytes({1}),
         "overflows 64 bits"},
        {R"({"x": {"dtype": "F64", "shape": [1], "data_offsets": [0, 18446744073709551615]}})", f64_bytes({1}),
         "needs 8 bytes"},
    };
    for (std::size_t n = 0; n < cases.size(); ++n) {
        const auto& [header, data, says] = cases[n];
        SCOPED_TRACE(header);
        const auto msg = open_error("offsets" + std::to_string(n), header, data, "attend.format.data_offsets");
        EXPECT_TRUE(contains(msg, says)) << msg;
    }
}

TEST(SafetensorsErrors, MissingNamesAndWrongRanksAreNamed) {
    const std::string path =
        write_file("names", R"({"w": {"dtype": "F64", "shape": [1, 2], "data_offsets": [0, 16]}})", f64_bytes({1, 2}));
    const attend::safetensors_file f(path);
    auto msg =
        expect_error<attend::format_error>([&] { (void)f.read<double, 2>("v"); }, "attend.format.missing_tensor");
    EXPECT_TRUE(contains(msg, "\"v\"") && contains(msg, "it holds: w")) << msg;
    msg = expect_error<attend::format_error>([&] { (void)f.read<double, 3>("w"); }, "attend.format.tensor_rank");
    EXPECT_TRUE(contains(msg, "[1,2] has rank 2, read as rank 3")) << msg;
}

TEST(SafetensorsErrors, AddBiasKvStateDictIsTorchUnsupported) {
    const std::string path =
        write_file("bias_kv",
                   R"({"in_proj_weight": {"dtype": "F64", "shape": [3, 1], "data_offsets": [0, 24]},
            "bias_k": {"dtype": "F64", "shape": [1, 1, 1], "data_offsets": [24, 32]},
            "out_proj.weight": {"dtype": "F64", "shape": [1, 1], "data_offsets": [32, 40]}})",
                   f64_bytes({1, 2, 3, 4, 5}));
    const auto msg = expect_error<attend::format_error>(
        [&] { (void)attend::load_torch_mha<double>(path, attend::mha_config{}.with_model_dim(1).with_heads(1)); },
        "attend.format.torch_unsupported");
    EXPECT_TRUE(contains(msg, "add_bias_kv=True")) << msg;
}

}  // namespace
