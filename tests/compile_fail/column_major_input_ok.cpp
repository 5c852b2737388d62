// SPDX-License-Identifier: MIT
// Twin of column_major_input_ko.cpp: row-major tensors (PyTorch's layout) are accepted.
#include <attend/shape.hpp>

attend::attention_shape check() {
    attend::tensor<float, 4> q(1, 2, 3, 4), k(1, 2, 5, 4), v(1, 2, 5, 4);
    return attend::check_shapes(q, k, v);
}
