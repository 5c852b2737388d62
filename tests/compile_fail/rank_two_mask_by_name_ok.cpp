// SPDX-License-Identifier: MIT
// Twin of rank_two_mask_by_name_ko.cpp: the constructor says how the two axes meet the scores.
#include <attend/mask.hpp>

attend::forbidden_mask padding(const attend::tensor<bool, 2>& key_padding_mask) {
    return attend::forbidden_mask::key_padding(key_padding_mask);
}
