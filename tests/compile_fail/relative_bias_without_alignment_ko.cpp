// SPDX-License-Identifier: MIT
// A T5 relative-position bias without its alignment must not compile.
// expect-error: no matching function for call to
#include <attend/score_bias.hpp>

attend::score_bias relative(const attend::relative_position_bias<float>& table) {
    return attend::score_bias::relative(table);
}
