// SPDX-License-Identifier: MIT
#pragma once
/// Reading `.safetensors` files, the format HuggingFace and PyTorch users save weights in, and loading a saved
/// nn.MultiheadAttention state_dict from one. The format: 8 bytes, the header's length N as a little-endian
/// unsigned 64-bit integer; N bytes of JSON, `{"<name>": {"dtype": "F32", "shape": [3, 4], "data_offsets":
/// [begin, end]}, ..., "__metadata__": {"<key>": "<value>"}}`; then the data, each tensor row-major and
/// little-endian at [begin, end) relative to the end of the header, the tensors back to back with no gap.
/// The file is untrusted input: every size and offset is checked (in 64-bit arithmetic that cannot wrap) against
/// the shape, the dtype and the file's real size before anything is read, and each violation is a format_error
/// with its own id. Tensors are read on demand, so opening a large checkpoint reads only its header.
/// Optional: attend.hpp does not include this header.

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../detail/json_reader.hpp"
#include "../detail/memory.hpp"
#include "../error.hpp"
#include "../mha.hpp"
#include "../tensor.hpp"
#include "torch.hpp"

namespace attend {

/// One tensor of a safetensors file as its header describes it.
struct safetensors_entry {
    std::string name;            ///< as in the header, e.g. "out_proj.weight"
    std::string dtype;           ///< "F32", "F64", "BF16", ... as written in the file
    std::vector<index_t> shape;  ///< row-major dims; empty for a scalar
    std::uint64_t begin = 0;     ///< first byte in the data section
    std::uint64_t end = 0;       ///< one past the last byte
};

namespace detail {

/// Bytes per element of the safetensors dtypes; 0 for a name the format does not define.
inline std::uint64_t safetensors_dtype_bytes(std::string_view dtype) {
    static constexpr std::pair<std::string_view, std::uint64_t> sizes[] = {
        {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"I16", 2}, {"U16", 2}, {"F16", 2},
        {"BF16", 2}, {"I32", 4}, {"U32", 4}, {"F32", 4},     {"F64", 8},     {"I64", 8}, {"U64", 8}};
    for (const auto& [name, bytes] : sizes)
        if (name == dtype) return bytes;
    return 0;
}

inline std::uint64_t read_u64_le(const unsigned char* b) {
    std::uint64_t n = 0;
    for (int k = 7; k >= 0; --k) n = (n << 8) | b[k];
    return n;
}

/// Element `n` of little-endian F16, BF16, F32 or F64 data (`bytes` wide; `brain` tells BF16 from F16) as T,
/// whatever the host's byte order: widened exactly to float or double, then converted to T (rounded to nearest
/// even when T is narrower, as torch's .to(dtype) does; F64 into a 16-bit T rounds through float).
template <class T>
T read_element(const unsigned char* data, std::uint64_t bytes, bool brain, std::uint64_t n) {
    const unsigned char* b = data + n * bytes;
    std::uint64_t bits = 0;
    for (std::uint64_t k = bytes; k-- > 0;) bits = (bits << 8) | b[k];
    if (bytes == 2) {
        const auto narrow = static_cast<std::uint16_t>(bits);
        const float f = brain ? static_cast<float>(Eigen::numext::bit_cast<Eigen::bfloat16>(narrow))
                              : static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(narrow));
        return static_cast<T>(f);
    }
    if (bytes == 4) {
        const auto narrow = static_cast<std::uint32_t>(bits);
        float f;
        std::memcpy(&f, &narrow, sizeof f);
        return static_cast<T>(f);
    }
    double d;
    std::memcpy(&d, &bits, sizeof d);
    return static_cast<T>(static_cast<accumulator_t<T>>(d));
}

}  // namespace detail

/// A `.safetensors` file whose header has been read and checked. Throws format_error on construction:
/// `attend.format.io` (cannot open or read), `attend.format.header_size` (shorter than 8 bytes, or a header
/// length beyond the file or above 100 MB, the format's limit), `attend.format.header_json` (not JSON),
/// `attend.format.header_entry` (JSON, but not an object of tensor entries with a string dtype, a shape of
/// non-negative integers and two integer data_offsets; a duplicate name; `__metadata__` not strings),
/// `attend.format.dtype` (a dtype the format does not define), `attend.format.data_offsets` (a range whose
/// length is not the shape's element count times the dtype's size, or ranges that do not tile the data section
/// back to back from 0 to its end).
class safetensors_file {
public:
    /// Reads and checks the header of the file at `path`; the tensors are read by read().
    explicit safetensors_file(std::string path) : path_(std::move(path)) {
        std::ifstream in(path_, std::ios::binary | std::ios::ate);
        if (!in) fail_io("cannot open the file");
        const std::streamoff size = in.tellg();
        if (size < 0) fail_io("cannot determine the file's size");
        file_size_ = static_cast<std::uint64_t>(size);
        if (file_size_ < 8)
            throw format_error("attend.format.header_size",
                               detail::concat(where(), ": ", file_size_,
                                              " bytes is shorter than the 8-byte header length"));
        in.seekg(0);
        std::array<unsigned char, 8> prefix{};
        if (!in.read(reinterpret_cast<char*>(prefix.data()), 8)) fail_io("cannot read the header length");
        const std::uint64_t header_len = detail::read_u64_le(prefix.data());
        if (header_len > max_header_bytes || header_len > file_size_ - 8)
            throw format_error("attend.format.header_size",
                               detail::concat(where(), ": header length ", header_len, " exceeds ",
                                              header_len > max_header_bytes ? "the format's limit of "
                                                                            : "the bytes after it, ",
                                              header_len > max_header_bytes ? max_header_bytes : file_size_ - 8,
                                              " (a truncated file, or not a safetensors file)"));
        std::string header(static_cast<std::size_t>(header_len), '\0');
        if (!in.read(header.data(), static_cast<std::streamsize>(header_len))) fail_io("cannot read the header");
        data_start_ = 8 + header_len;
        parse_header(header);
    }

    /// The path the file was opened from.
    const std::string& path() const { return path_; }
    /// Every tensor, in the order of their data (begin offsets ascending).
    const std::vector<safetensors_entry>& entries() const { return entries_; }
    /// The `__metadata__` strings of the header (empty when there are none).
    const std::map<std::string, std::string>& metadata() const { return metadata_; }
    /// True when the file holds a tensor named `name`.
    bool contains(const std::string& name) const { return find(name) != nullptr; }

    /// The entry of tensor `name`; format_error `attend.format.missing_tensor` listing the names when absent.
    const safetensors_entry& entry(const std::string& name) const {
        if (const auto* e = find(name)) return *e;
        std::string names;
        for (const auto& e : entries_) names += (names.empty() ? "" : ", ") + e.name;
        throw format_error("attend.format.missing_tensor",
                           detail::concat(where(), " has no tensor \"", name,
                                          "\" (it holds: ", names.empty() ? "nothing" : names, ')'));
    }

    /// Tensor `name` as a row-major `tensor<T, Rank>` of its shape, T float, double, Eigen::half or
    /// Eigen::bfloat16, converted from the file's F16, BF16, F32 or F64: exactly when T holds every value of the
    /// dtype, else rounded to nearest even as torch's .to(dtype) does (F64 into float as .float(); F64 into 16 bits
    /// through float). Throws format_error `attend.format.missing_tensor`, `attend.format.tensor_rank` (its shape
    /// has another rank), `attend.format.dtype` (a dtype other than those four), `attend.format.io` (the file
    /// shrank or cannot be read since it was opened), resource_error `attend.resource.allocation`.
    template <class T, int Rank>
    tensor<T, Rank> read(const std::string& name) const {
        static_assert(is_storage_type_v<T>,
                      "attend: safetensors_file::read gives float, double, Eigen::half or Eigen::bfloat16 tensors");
        const safetensors_entry& e = entry(name);
        if (e.shape.size() != static_cast<std::size_t>(Rank))
            throw format_error("attend.format.tensor_rank",
                               detail::concat(where(), ": tensor \"", name, "\" ", detail::format_shape(e.shape),
                                              " has rank ", e.shape.size(), ", read as rank ", Rank));
        const bool brain = e.dtype == "BF16";
        if (!(brain || e.dtype == "F16" || e.dtype == "F32" || e.dtype == "F64"))
            throw format_error("attend.format.dtype",
                               detail::concat(where(), ": tensor \"", name, "\" has dtype ", e.dtype,
                                              "; attend reads F16, BF16, F32 and F64 (convert the tensor before "
                                              "saving it)"));
        const std::uint64_t bytes = detail::safetensors_dtype_bytes(e.dtype);
        std::array<index_t, static_cast<std::size_t>(Rank)> dims{};
        for (std::size_t a = 0; a < dims.size(); ++a) dims[a] = e.shape[a];  // (no copy call: Rank may be 0)
        tensor<T, Rank> t;
        const char* hint = "The tensor is as large as the file says; read it on a machine with more memory";
        detail::resize_guarded(t, dims, name.c_str(), hint);
        std::vector<unsigned char> raw;
        detail::allocating([&] { raw.resize(static_cast<std::size_t>(e.end - e.begin)); },
                           [&] { return detail::concat("the file bytes of \"", name, "\": ", e.end - e.begin); }, hint);
        std::ifstream in(path_, std::ios::binary);
        if (!in) fail_io("cannot reopen the file to read a tensor");
        in.seekg(static_cast<std::streamoff>(data_start_ + e.begin));
        if (!in.read(reinterpret_cast<char*>(raw.data()), static_cast<std::streamsize>(raw.size())))
            fail_io(detail::concat("cannot read the ", raw.size(), " bytes of tensor \"", name,
                                   "\" (was the file changed since it was opened?)"));
        for (index_t n = 0; n < t.size(); ++n)
            t.data()[n] = detail::read_element<T>(raw.data(), bytes, brain, static_cast<std::uint64_t>(n));
        return t;
    }

private:
    static constexpr std::uint64_t max_header_bytes = 100'000'000;

    std::string where() const { return detail::concat("safetensors file ", path_); }

    [[noreturn]] void fail_io(const std::string& why) const {
        throw format_error("attend.format.io", detail::concat(where(), ": ", why));
    }

    [[noreturn]] void fail_entry(const std::string& why) const {
        throw format_error("attend.format.header_entry", detail::concat(where(), ": ", why));
    }

    const safetensors_entry* find(const std::string& name) const {
        for (const auto& e : entries_)
            if (e.name == name) return &e;
        return nullptr;
    }

    static const detail::json_value* member(const detail::json_value& object, std::string_view key) {
        for (std::size_t n = 0; n < object.keys.size(); ++n)
            if (object.keys[n] == key) return &object.items[n];
        return nullptr;
    }

    void parse_header(const std::string& header) {
        using kind = detail::json_value::kind;
        const detail::json_value root = detail::json_reader(header, where() + " header").parse();
        if (root.type != kind::object) fail_entry("the header is not a JSON object");
        for (std::size_t n = 0; n < root.keys.size(); ++n) {
            const std::string& name = root.keys[n];
            const detail::json_value& v = root.items[n];
            if (name == "__metadata__") {
                if (v.type != kind::object) fail_entry("__metadata__ is not an object");
                for (std::size_t m = 0; m < v.keys.size(); ++m) {
                    if (v.items[m].type != kind::string)
                        fail_entry(detail::concat("__metadata__ value \"", v.keys[m], "\" is not a string"));
                    if (!metadata_.emplace(v.keys[m], v.items[m].text).second)
                        fail_entry(detail::concat("__metadata__ key \"", v.keys[m], "\" appears twice"));
                }
                continue;
            }
            if (contains(name)) fail_entry(detail::concat("tensor \"", name, "\" appears twice"));
            entries_.push_back(parse_entry(name, v));
        }
        check_offsets();
    }

    safetensors_entry parse_entry(const std::string& name, const detail::json_value& v) const {
        using kind = detail::json_value::kind;
        const auto bad = [&](const std::string& why) { fail_entry(detail::concat("tensor \"", name, "\": ", why)); };
        if (v.type != kind::object) bad("the entry is not an object");
        if (v.keys.size() != 3) bad("the entry must have exactly dtype, shape and data_offsets");
        const detail::json_value* dtype = member(v, "dtype");
        const detail::json_value* shape = member(v, "shape");
        const detail::json_value* offsets = member(v, "data_offsets");
        if (!dtype || dtype->type != kind::string) bad("dtype is missing or not a string");
        if (!shape || shape->type != kind::array) bad("shape is missing or not an array");
        if (!offsets || offsets->type != kind::array || offsets->items.size() != 2)
            bad("data_offsets is missing or not [begin, end]");
        safetensors_entry e;
        e.name = name;
        e.dtype = dtype->text;
        const std::uint64_t element_bytes = detail::safetensors_dtype_bytes(e.dtype);
        if (element_bytes == 0)
            throw format_error("attend.format.dtype",
                               detail::concat(where(), ": tensor \"", name, "\" has dtype \"", e.dtype,
                                              "\", which the safetensors format does not define"));
        // The byte count shape x element size, in 64-bit arithmetic checked at every step.
        std::uint64_t count = element_bytes;
        for (const auto& d : shape->items) {
            std::uint64_t n = 0;
            if (!detail::json_to_u64(d, n) || n > static_cast<std::uint64_t>(std::numeric_limits<index_t>::max()))
                bad(detail::concat("shape entry ", d.text, " is not an integer in [0, 2^63)"));
            if (n != 0 && count > std::numeric_limits<std::uint64_t>::max() / n)
                throw format_error("attend.format.data_offsets",
                                   detail::concat(where(), ": tensor \"", name,
                                                  "\": the byte count of its shape overflows 64 bits"));
            count *= n;
            e.shape.push_back(static_cast<index_t>(n));
        }
        if (!detail::json_to_u64(offsets->items[0], e.begin) || !detail::json_to_u64(offsets->items[1], e.end))
            bad("data_offsets are not two non-negative integers");
        if (e.begin > e.end || e.end - e.begin != count)
            throw format_error("attend.format.data_offsets",
                               detail::concat(where(), ": tensor \"", name, "\" ", e.dtype, ' ',
                                              detail::format_shape(e.shape), " needs ", count,
                                              " bytes, its data_offsets [", e.begin, ", ", e.end, "] give ",
                                              e.begin > e.end ? std::string("a negative range")
                                                              : detail::concat(e.end - e.begin, " bytes")));
        return e;
    }

    /// The ranges, sorted, must tile [0, data size) with neither gap nor overlap (what the format's reference
    /// implementation checks): no byte is read for two tensors, and the file is exactly as long as the header says.
    void check_offsets() {
        std::sort(entries_.begin(), entries_.end(),
                  [](const safetensors_entry& a, const safetensors_entry& b) { return a.begin < b.begin; });
        const std::uint64_t data_size = file_size_ - data_start_;
        std::uint64_t expected = 0;
        for (const auto& e : entries_) {
            if (e.begin != expected)
                throw format_error("attend.format.data_offsets",
                                   detail::concat(where(), ": tensor \"", e.name, "\" starts at byte ", e.begin,
                                                  " of the data, expected ", expected,
                                                  " (tensors must follow each other with no gap or overlap)"));
            expected = e.end;
        }
        if (expected != data_size)
            throw format_error("attend.format.data_offsets",
                               detail::concat(where(), ": the tensors end at byte ", expected,
                                              " of the data, but the "
                                              "file holds ",
                                              data_size, " bytes of data"));
    }

    std::string path_;
    std::uint64_t file_size_ = 0;
    std::uint64_t data_start_ = 0;
    std::vector<safetensors_entry> entries_;
    std::map<std::string, std::string> metadata_;
};

/// The parameters of an nn.MultiheadAttention saved by `safetensors.torch.save_file(mha.state_dict(), path)`
/// (or of one inside a larger model: `prefix` is its state_dict prefix, e.g. "layers.0.self_attn."), under
/// PyTorch's names, ready for mha_from_torch. Throws what safetensors_file::read throws, and format_error
/// `attend.format.torch_unsupported` for parameters attend has no place for (bias_k / bias_v of add_bias_kv=True).
template <class T>
torch_mha_parameters<T> read_torch_mha_parameters(const safetensors_file& file, const std::string& prefix = "") {
    for (const char* name : {"bias_k", "bias_v"})
        if (file.contains(prefix + name))
            throw format_error("attend.format.torch_unsupported",
                               detail::concat("safetensors file ", file.path(), " holds ", prefix, name,
                                              ": nn.MultiheadAttention(add_bias_kv=True) has no equivalent in attend"));
    torch_mha_parameters<T> p;
    const auto read2 = [&](const char* name, tensor<T, 2>& to) {
        if (file.contains(prefix + name)) to = file.read<T, 2>(prefix + name);
    };
    const auto read1 = [&](const char* name, tensor<T, 1>& to) {
        if (file.contains(prefix + name)) to = file.read<T, 1>(prefix + name);
    };
    read2("in_proj_weight", p.in_proj_weight);
    read2("q_proj_weight", p.q_proj_weight);
    read2("k_proj_weight", p.k_proj_weight);
    read2("v_proj_weight", p.v_proj_weight);
    read1("in_proj_bias", p.in_proj_bias);
    p.out_proj_weight = file.read<T, 2>(prefix + "out_proj.weight");  // always there: missing_tensor otherwise
    read1("out_proj.bias", p.out_proj_bias);
    return p;
}

/// A multi_head_attention holding the nn.MultiheadAttention saved in the safetensors file at `path`. `config`
/// says what nn.MultiheadAttention(embed_dim, num_heads, kdim=, vdim=, bias=) was built with (a state_dict does
/// not record num_heads); every tensor is checked against it. Throws what safetensors_file,
/// read_torch_mha_parameters and mha_from_torch throw (shape_error attend.shape.torch_weight for a tensor that
/// does not fit the config).
template <class T>
multi_head_attention<T> load_torch_mha(const std::string& path, const mha_config& config,
                                       const std::string& prefix = "") {
    const safetensors_file file(path);
    return mha_from_torch(config, read_torch_mha_parameters<T>(file, prefix));
}

}  // namespace attend
