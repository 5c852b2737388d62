// SPDX-License-Identifier: MIT
/// safetensors reader fuzzer (interop/safetensors.hpp): any bytes as a .safetensors file.
///   - opening either succeeds or throws attend::format_error with a well-formed attend.format.* id, never another
///     exception, a crash or a read outside the file;
///   - when it succeeds, the entries come in data order and tile the data section exactly, every name is unique,
///     and each F16 / BF16 / F32 / F64 range is its shape's element count times 2 / 2 / 4 / 8 bytes;
///   - reading every entry of rank <= 4 as double and as float either gives a tensor of the entry's shape whose
///     values are the file's bytes (F64 bit for bit, the others widened exactly, F64 into float rounded) or throws
///     attend.format.dtype for a dtype other than those four (or attend.resource.allocation); a wrong rank is
///     attend.format.tensor_rank.

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <unistd.h>

#include <attend/interop/safetensors.hpp>

#include "fuzz_check.hpp"

namespace attend_fuzz {
namespace {

using attend::index_t;

std::uint64_t u64_le(const std::uint8_t* b) {
    std::uint64_t n = 0;
    for (int k = 7; k >= 0; --k) n = (n << 8) | b[k];
    return n;
}

/// Bytes per element of the dtypes attend reads; 0 for the others.
std::uint64_t readable_size(const std::string& dtype) {
    return dtype == "F16" || dtype == "BF16" ? 2 : dtype == "F32" ? 4 : dtype == "F64" ? 8 : 0;
}

/// The value the file holds for element n of an F16 / BF16 / F32 / F64 entry, from its bytes.
double file_value(const std::vector<std::uint8_t>& bytes, std::uint64_t at, const std::string& dtype, index_t n) {
    const std::uint64_t size = readable_size(dtype);
    std::uint64_t bits = 0;
    for (std::uint64_t k = size; k-- > 0;) bits = (bits << 8) | bytes[at + static_cast<std::uint64_t>(n) * size + k];
    if (size == 2) {
        const auto half_bits = static_cast<std::uint16_t>(bits);
        return dtype == "BF16"
                   ? static_cast<double>(static_cast<float>(Eigen::numext::bit_cast<Eigen::bfloat16>(half_bits)))
                   : static_cast<double>(static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(half_bits)));
    }
    if (size == 8) {
        double d;
        std::memcpy(&d, &bits, 8);
        return d;
    }
    const auto narrow = static_cast<std::uint32_t>(bits);
    float f;
    std::memcpy(&f, &narrow, 4);
    return static_cast<double>(f);
}

bool same_value(double a, double b) { return (std::isnan(a) && std::isnan(b)) || std::memcmp(&a, &b, 8) == 0; }

template <class T, int Rank>
void check_read(const attend::safetensors_file& file, const attend::safetensors_entry& e,
                const std::vector<std::uint8_t>& bytes, std::uint64_t data_start) {
    const bool readable = readable_size(e.dtype) != 0;
    attend::tensor<T, Rank> t;
    const auto id = error_id_of([&] { t = file.read<T, Rank>(e.name); });
    if (id) {
        require(*id == "attend.resource.allocation" || (!readable && *id == "attend.format.dtype"),
                "read of " + e.name + " (" + e.dtype + ") threw " + *id);
        return;
    }
    require(readable, "read of " + e.name + " with dtype " + e.dtype + " succeeded");
    for (std::size_t a = 0; a < std::size_t(Rank); ++a)
        require(t.dimensions()[a] == e.shape[a], "read of " + e.name + ": wrong shape");
    require(static_cast<std::uint64_t>(t.size()) * readable_size(e.dtype) == e.end - e.begin,
            "entry " + e.name + ": its range is not its shape times its dtype's size");
    for (index_t n = 0; n < t.size(); ++n) {
        const double expected = file_value(bytes, data_start + e.begin, e.dtype, n);
        const double got = static_cast<double>(t.data()[n]);
        const double want = static_cast<double>(static_cast<T>(expected));
        require(same_value(got, want), "read of " + e.name + ": element " + std::to_string(n) + " differs");
    }
    if (Rank < 4) {  // one rank too many is a typed error
        const auto wrong = error_id_of([&] { (void)file.read<T, Rank + 1>(e.name); });
        require(wrong && *wrong == "attend.format.tensor_rank", "read at the wrong rank gave " + spell(wrong));
    }
}

template <class T>
void check_read_any_rank(const attend::safetensors_file& file, const attend::safetensors_entry& e,
                         const std::vector<std::uint8_t>& bytes, std::uint64_t data_start) {
    switch (e.shape.size()) {
        case 0: check_read<T, 0>(file, e, bytes, data_start); break;
        case 1: check_read<T, 1>(file, e, bytes, data_start); break;
        case 2: check_read<T, 2>(file, e, bytes, data_start); break;
        case 3: check_read<T, 3>(file, e, bytes, data_start); break;
        case 4: check_read<T, 4>(file, e, bytes, data_start); break;
        default: break;
    }
}

void run_case(const std::uint8_t* data, std::size_t size) {
    const std::vector<std::uint8_t> bytes(data, data + size);
    const std::string path = (std::filesystem::temp_directory_path() /
                              ("attend_safetensors_fuzz_" + std::to_string(::getpid()) + ".safetensors"))
                                 .string();
    std::ofstream(path, std::ios::binary | std::ios::trunc)
        .write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
    struct remove_at_return {  // whichever way the case ends, it leaves no file behind
        const std::string& path;
        ~remove_at_return() { std::remove(path.c_str()); }
    } removes{path};
    case_description() = std::to_string(size) + " bytes";

    std::optional<attend::safetensors_file> file;
    const auto id = error_id_of([&] { file.emplace(path); });
    if (id) {
        require(id->rfind("attend.format.", 0) == 0, "opening threw " + *id);
        return;
    }
    require(size >= 8, "a file under 8 bytes opened");
    const std::uint64_t data_start = 8 + u64_le(data);
    require(data_start <= size, "the header runs past the file");
    std::uint64_t expected_begin = 0;
    std::set<std::string> names;
    for (const auto& e : file->entries()) {
        require(names.insert(e.name).second, "name " + e.name + " twice");
        require(e.begin == expected_begin && e.begin <= e.end, "entry " + e.name + " does not follow the previous");
        expected_begin = e.end;
        require(file->contains(e.name) && &file->entry(e.name) == &e, "entry " + e.name + " not found by name");
        check_read_any_rank<double>(*file, e, bytes, data_start);
        check_read_any_rank<float>(*file, e, bytes, data_start);
    }
    require(expected_begin == size - data_start, "the entries do not end at the end of the file");
}

}  // namespace
}  // namespace attend_fuzz

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    attend_fuzz::run_case(data, size);
    return 0;
}
