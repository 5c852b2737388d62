// SPDX-License-Identifier: MIT
// Twin of column_major_input_ok.cpp: a column-major tensor would read heads and positions transposed.
// expect-error: Eigen::RowMajor
#include <attend/shape.hpp>

attend::attention_shape check() {
    Eigen::Tensor<float, 4> q(1, 2, 3, 4), k(1, 2, 5, 4), v(1, 2, 5, 4);
    return attend::check_shapes(q, k, v);
}
