// SPDX-License-Identifier: MIT
#pragma once
/// Files a test program writes for itself (a .safetensors to read back): named in the test temporary directory
/// with a token of this process, so two programs running at once (two build trees' tests) never share one, and
/// removed when the program ends, so a run leaves nothing behind.

#include <cstdio>
#include <mutex>
#include <random>
#include <set>
#include <string>

#include <gtest/gtest.h>

namespace attend_test {

class scratch_files {
public:
    /// The path of this program's scratch file `name` (the same path for the same name), removed at exit.
    static std::string path(const std::string& name) {
        scratch_files& files = instance();
        const std::string p = ::testing::TempDir() + "attend_" + files.token_ + "_" + name;
        const std::lock_guard<std::mutex> lock(files.mutex_);
        files.paths_.insert(p);
        return p;
    }

    scratch_files(const scratch_files&) = delete;
    scratch_files& operator=(const scratch_files&) = delete;
    ~scratch_files() {
        for (const std::string& p : paths_) std::remove(p.c_str());  // a name never written: nothing to remove
    }

private:
    scratch_files() : token_(std::to_string(std::random_device{}())) {}
    static scratch_files& instance() {
        static scratch_files files;
        return files;
    }

    std::string token_;
    std::mutex mutex_;
    std::set<std::string> paths_;
};

}  // namespace attend_test
