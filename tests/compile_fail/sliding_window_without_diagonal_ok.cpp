// SPDX-License-Identifier: MIT
// Twin of sliding_window_without_diagonal_ko.cpp: the window names its diagonal.
#include <attend/mask.hpp>

attend::sliding_window_rule window() { return attend::sliding_window(2, 0, attend::alignment::bottom_right); }
