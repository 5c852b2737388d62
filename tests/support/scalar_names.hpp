// SPDX-License-Identifier: MIT
#pragma once
/// Typed tests over float and double whose names say the type: Suite/float.Name, Suite/double.Name.

#include <string>
#include <type_traits>

#include <gtest/gtest.h>

namespace attend_test {

using scalar_types = ::testing::Types<float, double>;

struct scalar_names {
    template <class T>
    static std::string GetName(int) {
        return std::is_same_v<T, float> ? "float" : "double";
    }
};

}  // namespace attend_test
