// SPDX-License-Identifier: MIT
// Twin of packed_window_without_alignment_ko.cpp: the segments' window names its alignment.
#include <attend/mask.hpp>

attend::packed_segments_rule packed() {
    return attend::packed_segments(attend::segment_offsets({0, 3}), attend::segment_offsets({0, 5}))
        .window(2, 0, attend::alignment::bottom_right);
}
