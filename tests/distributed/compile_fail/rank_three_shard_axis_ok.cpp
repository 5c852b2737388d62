// SPDX-License-Identifier: MIT
// Twin of rank_three_shard_axis_ko.cpp: the same cut with its sequence axis named.
#include <attend/distributed/sharding.hpp>

auto shard_of_headless_input(const attend::distributed::shard_layout& layout) {
    const attend::tensor<float, 3> x(2, 8, 4);
    return attend::distributed::take_shard(x, layout, 0, attend::distributed::sequence_axis{1});
}
