// SPDX-License-Identifier: MIT
// attend/distributed/ring.hpp compiles with nothing included before it, and a second include is harmless.
// Sorting includes would drop the second one.
// clang-format off
#include <attend/distributed/ring.hpp>
#include <attend/distributed/ring.hpp>
// clang-format on

int main() { return attend::distributed::ring_options{}.attention.threads == 0 ? 0 : 1; }
