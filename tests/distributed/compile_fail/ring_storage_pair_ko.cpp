// SPDX-License-Identifier: MIT
// Twin of ring_storage_pair_ok.cpp: the ring's forward takes the storage pairs scaled_dot_product_attention takes,
// and double queries over float shards are none of them.
// expect-error: or float q with Eigen::half or Eigen::bfloat16 k and v
#include <attend/distributed/ring.hpp>

auto ring_of_double_over_float(const attend::distributed::shard_layout& layout, MPI_Comm comm) {
    attend::tensor<double, 4> q(1, 2, 4, 8);
    attend::tensor<float, 4> k(1, 2, 4, 8), v(1, 2, 4, 8);
    return attend::distributed::ring_attention(q, k, v, attend::causal(attend::alignment::top_left), layout, comm);
}
