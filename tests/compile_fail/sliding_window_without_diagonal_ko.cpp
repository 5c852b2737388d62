// SPDX-License-Identifier: MIT
// A sliding window without its diagonal must not compile: top-left and bottom-right differ whenever
// query_len != key_len (a decode's window in 0.1 silently sat at the top-left corner).
// expect-error: attend::sliding_window
#include <attend/mask.hpp>

attend::sliding_window_rule window() { return attend::sliding_window(2, 0); }
