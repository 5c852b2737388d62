// SPDX-License-Identifier: MIT
// Twin of packed_lengths_unnamed_ko.cpp: the same list, named as offsets (or as lengths), compiles.
#include <attend/mask.hpp>

attend::block_diagonal_rule packed() { return attend::block_diagonal(attend::segment_offsets({0, 3, 5})); }
