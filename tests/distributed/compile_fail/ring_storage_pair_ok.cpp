// SPDX-License-Identifier: MIT
// Twin of ring_storage_pair_ko.cpp: float queries over bf16 shards, the shards travelling in 16 bits.
#include <attend/distributed/ring.hpp>

auto ring_of_float_over_bf16(const attend::distributed::shard_layout& layout, MPI_Comm comm) {
    attend::tensor<float, 4> q(1, 2, 4, 8);
    attend::tensor<Eigen::bfloat16, 4> k(1, 2, 4, 8), v(1, 2, 4, 8);
    return attend::distributed::ring_attention(q, k, v, attend::causal(attend::alignment::top_left), layout, comm);
}
