// SPDX-License-Identifier: MIT
// Twin of rank_three_shard_axis_ok.cpp: a rank-3 tensor is [batch, len, dim] or an lse [batch, heads, len], so
// cutting it without naming its sequence axis does not compile.
// expect-error: name its sequence axis with sequence_axis{1} or sequence_axis{2}
#include <attend/distributed/sharding.hpp>

auto shard_of_headless_input(const attend::distributed::shard_layout& layout) {
    const attend::tensor<float, 3> x(2, 8, 4);
    return attend::distributed::take_shard(x, layout, 0);
}
