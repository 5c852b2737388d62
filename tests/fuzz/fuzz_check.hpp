// SPDX-License-Identifier: MIT
#pragma once
/// How a fuzzer reports: a failed invariant prints what was checked and the case, then aborts, which libFuzzer
/// saves as a crash input and the corpus replay turns into a failed test. Errors of attend are expected outcomes
/// (bad sizes are part of the input space); anything else thrown escapes the fuzz target and is reported as well.

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <sstream>
#include <string>

#include <attend/error.hpp>

namespace attend_fuzz {

/// The case being run, printed with a failure: set by each fuzz target before it calls the library.
inline std::string& case_description() {
    static std::string text;
    return text;
}

[[noreturn]] inline void fail(const std::string& what) {
    std::fprintf(stderr, "fuzz invariant failed: %s\n  case: %s\n", what.c_str(), case_description().c_str());
    std::abort();
}

inline void require(bool condition, const std::string& what) {
    if (!condition) fail(what);
}

/// Runs f; returns the id of the attend::error it threw, or nothing. Every attend::error must carry a non-empty
/// id that its message starts with in brackets.
template <class F>
std::optional<std::string> error_id_of(F&& f) {
    try {
        f();
        return std::nullopt;
    } catch (const attend::error& e) {
        const std::string message = e.what();
        require(!e.id().empty() && message == e.message() + " [" + e.id() + "]",
                "attend::error without a well-formed id: " + message);
        return e.id();
    }
}

inline std::string spell(const std::optional<std::string>& id) { return id ? *id : std::string("no error"); }

}  // namespace attend_fuzz
