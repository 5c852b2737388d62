// SPDX-License-Identifier: MIT
#pragma once
/// The one error hierarchy of attend. Every message ends with a stable id in brackets, the heading of its entry in
/// docs/errors.md, e.g.
/// `query head_dim 64 != key head_dim 32 (query [2,8,128,64], key [2,8,256,32]) [attend.shape.key_dim]`.
/// Every check runs before any output is written, so a throw leaves the caller's buffers as they were.

#include <cassert>
#include <limits>
#include <new>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
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

/// Base of every error attend throws; `id()` is the stable identifier without brackets, `message()` the text,
/// `what()` both: `text [id]`. Each kind also derives from the standard exception a C++ program catches for it: bad input is a
/// std::invalid_argument, memory that could not be had a std::bad_alloc. So `catch (const attend::error&)` handles
/// every failure of a call, and `catch (const std::bad_alloc&)` or `catch (const std::exception&)` work as usual.
class error {
public:
    virtual ~error() = default;
    /// The stable id, e.g. attend.shape.key_dim (see docs/errors.md).
    const std::string& id() const noexcept { return id_; }
    /// What went wrong, without the id.
    const std::string& message() const noexcept { return message_; }
    /// `message [id]`.
    virtual const char* what() const noexcept = 0;

protected:
    /// The base of a kind with this id and message; only the kinds construct it.
    error(std::string id, std::string message) : id_(std::move(id)), message_(std::move(message)) {}
    /// Copied with the exception that holds it.
    error(const error&) = default;
    /// Assigned with the exception that holds it.
    error& operator=(const error&) = default;

private:
    std::string id_;
    std::string message_;
};

namespace detail {
/// An attend::error that is also the standard exception `Standard` (std::invalid_argument or std::bad_alloc).
template <class Standard>
class standard_error : public Standard, public error {
public:
    /// An error whose what() is `message [id]`.
    standard_error(std::string id, const std::string& message)
        : Standard(make_standard()), error(id, message), what_(message + " [" + id + "]") {}
    const char* what() const noexcept override { return what_.c_str(); }

private:
    static Standard make_standard() {
        if constexpr (std::is_constructible_v<Standard, const char*>) return Standard("attend error");
        else return Standard();
    }
    std::string what_;
};
}  // namespace detail

/// Tensors whose shapes do not fit together (ids `attend.shape.*`).
class shape_error : public detail::standard_error<std::invalid_argument> {
public:
    using standard_error::standard_error;
};

/// Masks that do not broadcast, are inconsistent, or leave a query with no allowed key (`attend.mask.*`).
class mask_error : public detail::standard_error<std::invalid_argument> {
public:
    using standard_error::standard_error;
};

/// Bad numbers: non-finite inputs, scales, probabilities, sizes (`attend.value.*`).
class value_error : public detail::standard_error<std::invalid_argument> {
public:
    using standard_error::standard_error;
};

/// Positions outside what an embedding or cache can represent (`attend.position.*`).
class position_error : public detail::standard_error<std::invalid_argument> {
public:
    using standard_error::standard_error;
};

/// Memory a valid call needs could not be allocated: a result, a workspace or the scratch of a thread. Thrown
/// before any output is written; the message names what was being allocated and its bytes (`attend.resource.*`).
/// A std::bad_alloc, so code that handles out-of-memory the usual way handles this too.
class resource_error : public detail::standard_error<std::bad_alloc> {
public:
    using standard_error::standard_error;
};

/// A file attend reads (interop/safetensors.hpp) that cannot be read or does not follow its format. Thrown
/// before any tensor of the file is handed out (`attend.format.*`).
class format_error : public detail::standard_error<std::invalid_argument> {
public:
    using standard_error::standard_error;
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
