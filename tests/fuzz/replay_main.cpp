// SPDX-License-Identifier: MIT
/// Runs a fuzz target without libFuzzer: every file named on the command line, and every regular file under every
/// directory named, is passed once to LLVMFuzzerTestOneInput, in sorted order. This is how ctest replays the
/// committed corpus with any compiler (and under the sanitizer build), and how a crash input is reproduced
/// under a debugger. Exits non-zero if an argument does not exist or no input was found.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);

namespace {

std::vector<std::filesystem::path> inputs_of(const std::filesystem::path& argument) {
    std::vector<std::filesystem::path> files;
    if (std::filesystem::is_directory(argument)) {
        for (const auto& entry : std::filesystem::recursive_directory_iterator(argument))
            if (entry.is_regular_file()) files.push_back(entry.path());
        std::sort(files.begin(), files.end());
    } else if (std::filesystem::is_regular_file(argument)) {
        files.push_back(argument);
    }
    return files;
}

}  // namespace

int main(int argc, char** argv) {
    std::size_t replayed = 0;
    for (int a = 1; a < argc; ++a) {
        const std::vector<std::filesystem::path> files = inputs_of(argv[a]);
        if (files.empty() && !std::filesystem::is_directory(argv[a])) {
            std::fprintf(stderr, "replay: %s is neither a file nor a directory\n", argv[a]);
            return 2;
        }
        for (const auto& file : files) {
            std::ifstream stream(file, std::ios::binary);
            const std::vector<char> bytes((std::istreambuf_iterator<char>(stream)), std::istreambuf_iterator<char>());
            // A buffer of exactly the input's size, so reading past the input is a sanitizer error here as under
            // libFuzzer.
            const std::vector<std::uint8_t> input(bytes.begin(), bytes.end());
            LLVMFuzzerTestOneInput(input.empty() ? nullptr : input.data(), input.size());
            ++replayed;
        }
    }
    std::printf("replay: %zu inputs\n", replayed);
    return replayed > 0 ? 0 : 1;
}
