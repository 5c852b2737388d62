// SPDX-License-Identifier: MIT
#pragma once
/// Helpers of the MPI tests: the communicator, the same random problem on every rank, and comparisons that every
/// rank checks (a failure on any rank fails mpirun).

#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <mpi.h>

#include <attend/distributed/sharding.hpp>
#include <attend/tensor.hpp>

#include "support/compare.hpp"

namespace attend_test {

inline int mpi_rank() {
    int r = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &r);
    return r;
}

inline int mpi_size() {
    int n = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    return n;
}

/// The relative error of a result against the single-process one: max_rel_diff (compare.hpp) with the floor 0.1.
/// The floor matters only for tensors that are zero up to rounding: a query that sees a single key has dq = 0 as the
/// difference of two terms of size |d_out . v| ~ 1 (inputs are in [-1, 1)), exactly 0 in one summation order and
/// a few ulps of those terms in another, so its error is relative to them, not to the zero result.
template <class T, int R>
double relative_error(const attend::tensor<T, R>& a, const attend::tensor<T, R>& b) {
    return max_rel_diff(a, b, 0.1);
}

/// The contiguous layout of `length` positions on every rank of the world communicator.
inline attend::distributed::shard_layout even_layout(attend::index_t length) {
    return attend::distributed::shard_layout(attend::distributed::sharding::contiguous,
                                             std::vector<attend::index_t>(static_cast<std::size_t>(mpi_size()),
                                                                          length));
}

/// True on every rank when `text` is the same string on every rank.
inline bool same_on_every_rank(const std::string& text) {
    int length = static_cast<int>(text.size());
    MPI_Bcast(&length, 1, MPI_INT, 0, MPI_COMM_WORLD);
    std::string root(static_cast<std::size_t>(length), '\0');
    if (mpi_rank() == 0) root = text;
    MPI_Bcast(root.data(), length, MPI_CHAR, 0, MPI_COMM_WORLD);
    int mine = root == text ? 1 : 0, all = 0;
    MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    return all == 1;
}

}  // namespace attend_test
