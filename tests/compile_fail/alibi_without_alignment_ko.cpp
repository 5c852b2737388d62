// SPDX-License-Identifier: MIT
// ALiBi without its alignment must not compile: in a decode the top-left distances are off by key_len - query_len.
// expect-error: no matching function for call to
#include <attend/score_bias.hpp>

attend::score_bias alibi() { return attend::score_bias::alibi(attend::alibi_slopes(4)); }
