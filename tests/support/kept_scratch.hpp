// SPDX-License-Identifier: MIT
#pragma once
/// Kernels' scratch that starts with whatever memory held: a check that no call reads scratch it did not write.

#include <cstddef>
#include <cstring>
#include <string>

#include <gtest/gtest.h>

#include <attend/attend.hpp>

#include "support/compare.hpp"

namespace attend_test {

/// The tiled kernel's workspaces are not zeroed when sized (unzeroed_vector): each buffer is written before it is
/// read. They are sized from the calling thread's kept scratch blocks, so blocks filled with NaN bytes between two
/// runs of `call` change no bit of its out or lse, wherever a read came before its write would carry the NaN.
template <class Call>
void expect_scratch_full_of_nan_changes_no_bit(const Call& call, const std::string& what) {
    (void)attend::release_scratch();
    const auto fresh = call();
    const attend::detail::scratch_blocks* kept = attend::detail::scratch_blocks::of_this_thread();
    ASSERT_NE(kept, nullptr);
    ASSERT_GT(kept->block_count(), 0u) << what;
    kept->for_each_kept([](void* data, std::size_t bytes) { std::memset(data, 0xff, bytes); });  // NaN
    const auto poisoned = call();
    EXPECT_TRUE(bit_equal(fresh.out, poisoned.out)) << what;
    EXPECT_TRUE(bit_equal(fresh.lse, poisoned.lse)) << what;
}

}  // namespace attend_test
