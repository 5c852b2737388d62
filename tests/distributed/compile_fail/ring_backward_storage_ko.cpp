// SPDX-License-Identifier: MIT
// Twin of ring_backward_storage_ok.cpp: the ring's backward takes q, k and v of one type, as attention_backward
// does; float queries over bf16 shards run forward only.
// expect-error: ring attention backward takes q, k and v of one scalar type
#include <attend/distributed/ring.hpp>

auto ring_backward_of_float_over_bf16(const attend::distributed::shard_layout& layout, MPI_Comm comm) {
    attend::tensor<float, 4> q(1, 2, 4, 8), out(1, 2, 4, 8), d_out(1, 2, 4, 8);
    attend::tensor<Eigen::bfloat16, 4> k(1, 2, 4, 8), v(1, 2, 4, 8);
    attend::tensor<float, 3> lse(1, 2, 4);
    return attend::distributed::ring_attention_backward(q, k, v, attend::no_mask{}, out, lse, d_out, layout, comm);
}
