// SPDX-License-Identifier: MIT
// Twin of ring_backward_storage_ko.cpp: the backward of bf16 shards, q, k and v all bf16.
#include <attend/distributed/ring.hpp>

auto ring_backward_of_bf16(const attend::distributed::shard_layout& layout, MPI_Comm comm) {
    attend::tensor<Eigen::bfloat16, 4> q(1, 2, 4, 8), k(1, 2, 4, 8), v(1, 2, 4, 8), out(1, 2, 4, 8), d_out(1, 2, 4, 8);
    attend::tensor<float, 3> lse(1, 2, 4);
    return attend::distributed::ring_attention_backward(q, k, v, attend::no_mask{}, out, lse, d_out, layout, comm);
}
