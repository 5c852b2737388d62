// SPDX-License-Identifier: MIT
// A bare list for a packed form must not compile: {0, 3, 5} may be offsets (cu_seqlens) or lengths, and read as
// the other it names other segments. The twin names them.
// expect-error: no matching function for call to
#include <attend/mask.hpp>

attend::block_diagonal_rule packed() { return attend::block_diagonal({0, 3, 5}); }
