// SPDX-License-Identifier: MIT
// CMake's project(attend VERSION ...) and version.hpp must agree (the CMake side comes in as -D definitions).
#include <attend/version.hpp>

#include <cstdio>

int main() {
    constexpr int cmake_version =
        ATTEND_CMAKE_VERSION_MAJOR * 10000 + ATTEND_CMAKE_VERSION_MINOR * 100 + ATTEND_CMAKE_VERSION_PATCH;
    if (ATTEND_VERSION_MAJOR != ATTEND_CMAKE_VERSION_MAJOR || ATTEND_VERSION_MINOR != ATTEND_CMAKE_VERSION_MINOR ||
        ATTEND_VERSION_PATCH != ATTEND_CMAKE_VERSION_PATCH || attend::version != cmake_version) {
        std::printf("version.hpp says %d.%d.%d, CMakeLists.txt says %d.%d.%d\n", ATTEND_VERSION_MAJOR,
                    ATTEND_VERSION_MINOR, ATTEND_VERSION_PATCH, ATTEND_CMAKE_VERSION_MAJOR, ATTEND_CMAKE_VERSION_MINOR,
                    ATTEND_CMAKE_VERSION_PATCH);
        return 1;
    }
    std::printf("attend %d.%d.%d\n", ATTEND_VERSION_MAJOR, ATTEND_VERSION_MINOR, ATTEND_VERSION_PATCH);
    return 0;
}
