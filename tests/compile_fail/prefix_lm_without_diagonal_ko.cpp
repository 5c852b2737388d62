// SPDX-License-Identifier: MIT
// A prefix LM rule without the diagonal of its causal part must not compile.
// expect-error: attend::prefix_lm
#include <attend/mask.hpp>

attend::prefix_lm_rule prefix() { return attend::prefix_lm(3); }
