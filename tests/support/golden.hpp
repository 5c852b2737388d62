// SPDX-License-Identifier: MIT
// Loads the golden reference files that tests/data/generate_goldens.py writes with PyTorch.
//
// A golden tensor is {"shape": [d0, d1, ...], "data": [flat row-major values]}: numbers, 0/1 for
// booleans, and the strings "-inf" / "inf" for infinities (JSON has none). to_tensor<T, Rank>()
// turns one into an Eigen::Tensor<T, Rank, Eigen::RowMajor>, checking rank, shape and values, and
// throws std::runtime_error naming the tensor and both shapes when they do not match.
#pragma once

#include <array>
#include <cmath>
#include <cstddef>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>
#include <unsupported/Eigen/CXX11/Tensor>

#ifndef ATTEND_TEST_DATA_DIR
#error "golden.hpp needs ATTEND_TEST_DATA_DIR (absolute path of tests/data) as a compile definition"
#endif

namespace attend_test {

using json = nlohmann::json;

/// Row-major tensor, the layout of the golden data and of attend.
template <typename T, int Rank>
using golden_tensor = Eigen::Tensor<T, Rank, Eigen::RowMajor>;

namespace golden_detail {

inline std::string shape_string(const std::vector<Eigen::Index>& shape) {
    std::ostringstream os;
    os << '[';
    for (std::size_t i = 0; i < shape.size(); ++i) os << (i ? "," : "") << shape[i];
    os << ']';
    return os.str();
}

[[noreturn]] inline void fail(const std::string& what, const std::string& message) {
    throw std::runtime_error("golden '" + what + "': " + message);
}

/// A JSON number or boolean, or "-inf" / "inf" / "nan"; false if v is none of these.
inline bool parse_number(const json& v, double& out) {
    if (v.is_number()) {
        out = v.get<double>();
        return true;
    }
    if (v.is_boolean()) {
        out = v.get<bool>() ? 1.0 : 0.0;
        return true;
    }
    if (v.is_string()) {
        const std::string& s = v.get_ref<const std::string&>();
        if (s == "-inf") out = -std::numeric_limits<double>::infinity();
        else if (s == "inf" || s == "+inf") out = std::numeric_limits<double>::infinity();
        else if (s == "nan") out = std::numeric_limits<double>::quiet_NaN();
        else return false;
        return true;
    }
    return false;
}

}  // namespace golden_detail

/// Absolute path of a file in tests/data.
inline std::string golden_path(const std::string& file) { return std::string(ATTEND_TEST_DATA_DIR) + "/" + file; }

/// Parses tests/data/<file>; throws std::runtime_error if it is missing or not valid JSON.
inline json load_golden(const std::string& file) {
    const std::string path = golden_path(file);
    std::ifstream in(path);
    if (!in) {
        throw std::runtime_error("golden file not found: " + path +
                                 " (regenerate with: /usr/bin/python3 tests/data/generate_goldens.py)");
    }
    try {
        return json::parse(in);
    } catch (const json::exception& e) {
        throw std::runtime_error("golden file " + path + " is not valid JSON: " + e.what());
    }
}

/// The case called `name` in doc["cases"]; throws if there is none.
inline const json& find_case(const json& doc, const std::string& name) {
    if (!doc.is_object() || !doc.contains("cases") || !doc.at("cases").is_array()) {
        throw std::runtime_error("golden document has no \"cases\" array (looking for case '" + name + "')");
    }
    for (const json& c : doc.at("cases")) {
        if (c.is_object() && c.contains("name") && c.at("name") == name) return c;
    }
    throw std::runtime_error("golden case '" + name + "' not found");
}

/// parent[key], throwing a clear error if the key is missing.
inline const json& member(const json& parent, const std::string& key) {
    if (!parent.is_object() || !parent.contains(key)) {
        throw std::runtime_error("golden object has no key '" + key + "'");
    }
    return parent.at(key);
}

/// One golden scalar as double: a JSON number (or boolean), or "-inf" / "inf" / "nan".
inline double to_number(const json& v, const std::string& what = "value") {
    double x = 0.0;
    if (golden_detail::parse_number(v, x)) return x;
    if (v.is_string()) {
        golden_detail::fail(what, "unknown string value \"" + v.get<std::string>() +
                                      "\" (expected a number, \"-inf\" or \"inf\")");
    }
    golden_detail::fail(what, "expected a number, got " + std::string(v.type_name()));
}

/// A number or null (e.g. "scale": null meaning the default).
inline std::optional<double> to_optional_number(const json& v, const std::string& what = "value") {
    if (v.is_null()) return std::nullopt;
    return to_number(v, what);
}

/// The "shape" of a golden tensor.
inline std::vector<Eigen::Index> shape_of(const json& t, const std::string& what = "tensor") {
    if (!t.is_object() || !t.contains("shape") || !t.contains("data")) {
        golden_detail::fail(what, "not a tensor object {\"shape\": [...], \"data\": [...]}");
    }
    const json& shape = t.at("shape");
    if (!shape.is_array()) golden_detail::fail(what, "\"shape\" is not an array");
    std::vector<Eigen::Index> out;
    for (const json& d : shape) {
        if (!d.is_number_integer() || d.get<long long>() < 0) {
            golden_detail::fail(what, "\"shape\" entries must be non-negative integers");
        }
        out.push_back(static_cast<Eigen::Index>(d.get<long long>()));
    }
    return out;
}

/// Converts a golden tensor to Eigen::Tensor<T, Rank, RowMajor>. T may be a floating type
/// (accepts "-inf"/"inf"), bool (values must be 0/1 or true/false) or an integer type (values
/// must be integral). Throws std::runtime_error on a rank, size or value mismatch.
template <typename T, int Rank>
golden_tensor<T, Rank> to_tensor(const json& t, const std::string& what = "tensor") {
    static_assert(Rank >= 1, "to_tensor: rank must be at least 1");
    static_assert(std::is_arithmetic<T>::value, "to_tensor: element type must be arithmetic or bool");
    const std::vector<Eigen::Index> shape = shape_of(t, what);
    if (static_cast<int>(shape.size()) != Rank) {
        golden_detail::fail(what, "expected rank " + std::to_string(Rank) + ", got rank " +
                                      std::to_string(shape.size()) + " (shape " + golden_detail::shape_string(shape) +
                                      ")");
    }
    const json& data = t.at("data");
    if (!data.is_array()) golden_detail::fail(what, "\"data\" is not an array");
    std::size_t count = 1;
    for (Eigen::Index d : shape) count *= static_cast<std::size_t>(d);
    if (data.size() != count) {
        golden_detail::fail(what, "shape " + golden_detail::shape_string(shape) + " needs " + std::to_string(count) +
                                      " values, data has " + std::to_string(data.size()));
    }
    std::array<Eigen::Index, Rank> dims{};
    for (int i = 0; i < Rank; ++i) dims[static_cast<std::size_t>(i)] = shape[static_cast<std::size_t>(i)];
    golden_tensor<T, Rank> out(dims);
    const auto where = [&what](std::size_t i) { return what + "[" + std::to_string(i) + "]"; };
    T* dst = out.data();  // row-major storage: flat index order == golden "data" order
    for (std::size_t i = 0; i < count; ++i) {
        double x = 0.0;
        if (!golden_detail::parse_number(data[i], x)) x = to_number(data[i], where(i));  // throws
        if constexpr (std::is_same<T, bool>::value) {
            if (x != 0.0 && x != 1.0) golden_detail::fail(where(i), "boolean value must be 0 or 1");
            dst[i] = (x == 1.0);
        } else if constexpr (std::is_integral<T>::value) {
            if (!std::isfinite(x) || std::floor(x) != x) golden_detail::fail(where(i), "value is not an integer");
            dst[i] = static_cast<T>(x);
        } else {
            dst[i] = static_cast<T>(x);
        }
    }
    return out;
}

/// As to_tensor, and also checks the shape equals `expected`.
template <typename T, int Rank>
golden_tensor<T, Rank> to_tensor(const json& t, const std::array<Eigen::Index, Rank>& expected,
                                 const std::string& what = "tensor") {
    golden_tensor<T, Rank> out = to_tensor<T, Rank>(t, what);
    for (int i = 0; i < Rank; ++i) {
        if (out.dimension(i) != expected[static_cast<std::size_t>(i)]) {
            const std::vector<Eigen::Index> want(expected.begin(), expected.end());
            std::vector<Eigen::Index> got;
            for (int j = 0; j < Rank; ++j) got.push_back(out.dimension(j));
            golden_detail::fail(what, "expected shape " + golden_detail::shape_string(want) + ", got " +
                                          golden_detail::shape_string(got));
        }
    }
    return out;
}

/// parent[key] as a tensor; errors name the key.
template <typename T, int Rank>
golden_tensor<T, Rank> tensor_at(const json& parent, const std::string& key) {
    return to_tensor<T, Rank>(member(parent, key), key);
}

template <int Rank>
golden_tensor<double, Rank> to_double(const json& t, const std::string& what = "tensor") {
    return to_tensor<double, Rank>(t, what);
}

template <int Rank>
golden_tensor<float, Rank> to_float(const json& t, const std::string& what = "tensor") {
    return to_tensor<float, Rank>(t, what);
}

template <int Rank>
golden_tensor<bool, Rank> to_bool(const json& t, const std::string& what = "tensor") {
    return to_tensor<bool, Rank>(t, what);
}

}  // namespace attend_test
