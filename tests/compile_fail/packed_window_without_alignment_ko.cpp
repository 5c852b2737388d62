// SPDX-License-Identifier: MIT
// A window inside packed segments without the corner of each segment it starts from must not compile.
// expect-error: no matching function for call to
#include <attend/mask.hpp>

attend::packed_segments_rule packed() {
    return attend::packed_segments(attend::segment_offsets({0, 3}), attend::segment_offsets({0, 5})).window(2, 0);
}
