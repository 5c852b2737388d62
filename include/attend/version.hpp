// SPDX-License-Identifier: MIT
#pragma once
/// attend's version. CMake's project version is checked against these by a test.
#define ATTEND_VERSION_MAJOR 0
#define ATTEND_VERSION_MINOR 2
#define ATTEND_VERSION_PATCH 0

namespace attend {
/// The version as a number, major * 10000 + minor * 100 + patch.
inline constexpr int version = ATTEND_VERSION_MAJOR * 10000 + ATTEND_VERSION_MINOR * 100 + ATTEND_VERSION_PATCH;
}  // namespace attend
