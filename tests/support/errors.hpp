// SPDX-License-Identifier: MIT
#pragma once
/// The one check of an error path: f must throw exactly E, with the stable id `id`, and the message must end
/// with that id in brackets (the heading of its docs/errors.md entry). Returns the message so a test can look for shapes or values in it.

#include <string>
#include <typeinfo>

#include <gtest/gtest.h>

#include <attend/error.hpp>

namespace attend_test {

template <class E, class F>
std::string expect_error(F&& f, const std::string& id) {
    try {
        f();
        ADD_FAILURE() << "expected " << typeid(E).name() << " [" << id << "], nothing was thrown";
    } catch (const attend::error& e) {
        EXPECT_EQ(typeid(e), typeid(E)) << e.what();
        EXPECT_EQ(e.id(), id) << e.what();
        const std::string what = e.what(), tail = " [" + id + "]";
        EXPECT_TRUE(what.size() > tail.size() && what.compare(what.size() - tail.size(), tail.size(), tail) == 0)
            << "the message should end with its id: " << what;
        EXPECT_EQ(what, e.message() + tail);
        return e.what();
    }
    return {};
}

}  // namespace attend_test
