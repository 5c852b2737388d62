# SPDX-License-Identifier: MIT
# Sourced by scripts/demo and scripts/test. attend_prereqs [command...] checks cmake, a C++ compiler (g++ or
# c++), any extra commands given, and the Debian packages attend builds against. Missing pieces are installed
# with apt-get when running as root; otherwise the exact install line is printed and the script exits 1.
# Test hook: ATTEND_PREREQ_FAKE_MISSING="cmake libgtest-dev" treats the listed commands/packages as missing.

attend_prereq_packages=(libeigen3-dev libgtest-dev libbenchmark-dev nlohmann-json3-dev openmpi-bin libopenmpi-dev)

attend_fake_missing() {
    [[ " ${ATTEND_PREREQ_FAKE_MISSING:-} " == *" $1 "* ]]
}

attend_have_command() {
    ! attend_fake_missing "$1" && command -v "$1" >/dev/null 2>&1
}

attend_have_package() {
    ! attend_fake_missing "$1" &&
        [[ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null)" == "install ok installed" ]]
}

# The Debian package that provides a command.
attend_package_of() {
    case "$1" in
        clang++) echo clang ;;
        c++) echo g++ ;;
        *) echo "$1" ;;
    esac
}

attend_prereqs() {
    local missing=() name
    attend_have_command cmake || missing+=(cmake)
    attend_have_command g++ || attend_have_command c++ || missing+=(g++)
    for name in "$@"; do
        attend_have_command "$name" || missing+=("$(attend_package_of "$name")")
    done
    if command -v dpkg-query >/dev/null 2>&1; then
        for name in "${attend_prereq_packages[@]}"; do
            attend_have_package "$name" || missing+=("$name")
        done
    else
        echo "note: no dpkg-query (not Debian/Ubuntu?); CMake will report missing libraries" >&2
    fi
    ((${#missing[@]} == 0)) && return 0

    if [[ "$(id -u)" == 0 ]]; then
        echo "Installing missing prerequisites: ${missing[*]}" >&2
        apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y "${missing[@]}"
    else
        echo "Missing prerequisites: ${missing[*]}. Install them with:" >&2
        echo "sudo apt-get install -y ${missing[*]}"
        exit 1
    fi
}
