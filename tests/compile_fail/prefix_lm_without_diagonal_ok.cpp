// SPDX-License-Identifier: MIT
// Twin of prefix_lm_without_diagonal_ko.cpp: the causal part names its diagonal.
#include <attend/mask.hpp>

attend::prefix_lm_rule prefix() { return attend::prefix_lm(3, attend::diagonal_offset(4)); }
