// SPDX-License-Identifier: MIT
#pragma once
/// The one error hierarchy of attend. Every message starts with a stable id in brackets, e.g.
/// `[attend.shape.key_dim] query head_dim 64 != key head_dim 32 (query [2,8,128,64], key [2,8,256,32])`.
/// Every check runs before any output is written, so a throw leaves the caller's buffers as they were.

#include <cassert>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <Eigen/Core>

#ifndef ATTEND_ASSERT
#ifdef NDEBUG
#define ATTEND_ASSERT(condition) ((void)0)
#else
/// Internal invariant; compiled out in release builds like eigen_assert.
#define ATTEND_ASSERT(condition) assert(condition)
#endif
#endif

namespace attend {

/// Base of every error attend throws; `id()` is the stable identifier without brackets.
class error : public std::invalid_argument {
public:
    /// An error whose what() is `[id] message`.
    error(std::string id, const std::string& message)
        : std::invalid_argument("[" + id + "] " + message), id_(std::move(id)) {}
    /// The stable id, e.g. attend.shape.key_dim (see docs/errors.md).
    const std::string& id() const noexcept { return id_; }

private:
    std::string id_;
};

/// Tensors whose shapes do not fit together (ids `attend.shape.*`).
class shape_error : public error {
public:
    using error::error;
};

/// Masks that do not broadcast, are inconsistent, or leave a query with no allowed key (`attend.mask.*`).
class mask_error : public error {
public:
    using error::error;
};

/// Bad numbers: non-finite inputs, scales, probabilities, sizes (`attend.value.*`).
class value_error : public error {
public:
    using error::error;
};

/// Positions outside what an embedding or cache can represent (`attend.position.*`).
class position_error : public error {
public:
    using error::error;
};

/// Memory a valid call needs could not be allocated: a result, a workspace or the scratch of a thread. Thrown
/// before any output is written; the message names what was being allocated and its bytes (`attend.resource.*`).
class resource_error : public error {
public:
    using error::error;
};

/// A file attend reads (interop/safetensors.hpp) that cannot be read or does not follow its format. Thrown
/// before any tensor of the file is handed out (`attend.format.*`).
class format_error : public error {
public:
    using error::error;
};

namespace detail {

/// `[2,8,128,64]`: how every message spells a shape.
template <class Dims>
std::string format_shape(const Dims& dims) {
    std::ostringstream s;
    s << '[';
    bool first = true;
    for (auto d : dims) {
        if (!first) s << ',';
        s << d;
        first = false;
    }
    s << ']';
    return s.str();
}

/// Streams any number of values into one string, for error messages.
template <class... Parts>
std::string concat(const Parts&... parts) {
    std::ostringstream s;
    s.precision(17);
    (s << ... << parts);
    return s.str();
}

/// The name of the floating scalar type with `digits` significand bits (std::numeric_limits<T>::digits tells the
/// four storage types apart).
constexpr const char* scalar_name(int digits) {
    return digits == 8 ? "bfloat16" : digits == 11 ? "half" : digits == 24 ? "float" : "double";
}

/// The name of a floating scalar type, for messages that say in which type a value failed.
template <class T>
constexpr const char* scalar_name() {
    return scalar_name(std::numeric_limits<T>::digits);
}

}  // namespace detail
}  // namespace attend
