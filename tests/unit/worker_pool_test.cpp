// SPDX-License-Identifier: MIT
// The kept worker threads (detail/worker_pool.hpp) behind parallel_for: a loop of calls reuses them; every unit
// runs once on the worker worker_of deals it to, whoever calls and however calls nest or overlap; an exception
// on a kept thread reaches the caller and leaves the pool usable; a forked child never waits for its parent's
// threads; release_scratch reaches the kept threads' scratch.
#include <gtest/gtest.h>
#include <attend/detail/memory.hpp>
#include <attend/detail/parallel_for.hpp>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <sys/wait.h>
#include <unistd.h>
#endif

namespace {

using attend::index_t;
using attend::detail::parallel_for;

/// The units of one call, each with the worker that ran it and how often it ran.
struct unit_record {
    std::vector<std::atomic<int>> runs, worker;
    explicit unit_record(index_t units)
        : runs(static_cast<std::size_t>(units)), worker(static_cast<std::size_t>(units)) {}
    void note(index_t unit, int w) {
        ++runs[static_cast<std::size_t>(unit)];
        worker[static_cast<std::size_t>(unit)] = w;
    }
    /// Every unit ran once, on worker worker_of(unit, workers).
    bool dealt_by_worker_of(int workers) const {
        for (std::size_t u = 0; u < runs.size(); ++u)
            if (runs[u] != 1 || worker[u] != attend::detail::worker_of(static_cast<index_t>(u), workers)) return false;
        return true;
    }
};

/// parallel_for(units, threads) recorded; true when every unit ran once on the worker worker_of gives it.
bool runs_on_its_worker(index_t units, int threads) {
    unit_record r(units);
    parallel_for(units, threads, [&](index_t unit, int w) { r.note(unit, w); });
    return r.dealt_by_worker_of(static_cast<int>(std::min<index_t>(threads, units)));
}

TEST(WorkerPool, EveryUnitRunsOnceOnItsWorkerForAnyThreadCount) {
    for (int threads = 1; threads <= 9; ++threads)
        for (index_t units = 1; units <= 40; units += 3) EXPECT_TRUE(runs_on_its_worker(units, threads)) << threads;
    // More workers than the pool keeps: the call starts its own threads.
    EXPECT_TRUE(runs_on_its_worker(100, attend::detail::worker_pool::max_helpers + 5));
}

TEST(WorkerPool, UnitsOfRisingCostAreDealtEvenlyToTwoOrThreeWorkers) {
    // Unit u costs u (a causal head's query blocks), over an even number of rounds: every worker's share is the
    // mean, where plain round robin gave the last worker the dearer unit of every round (2 workers, 8 units: 16
    // against 12).
    for (int workers = 2; workers <= 3; ++workers) {
        const index_t units = 8 * workers;
        std::vector<index_t> cost(static_cast<std::size_t>(workers), 0);
        for (index_t u = 0; u < units; ++u) cost[static_cast<std::size_t>(attend::detail::worker_of(u, workers))] += u;
        const index_t mean = units * (units - 1) / 2 / workers;
        for (int w = 0; w < workers; ++w) EXPECT_EQ(cost[static_cast<std::size_t>(w)], mean) << workers << ' ' << w;
    }
}

TEST(WorkerPool, ALoopOfCallsRunsOnTheSameKeptThread) {
    std::vector<std::thread::id> helper;
    for (int call = 0; call < 50; ++call)
        parallel_for(2, 2, [&](index_t unit, int) {
            if (unit == 1) helper.push_back(std::this_thread::get_id());
        });
    ASSERT_EQ(helper.size(), 50u);
    for (const auto& id : helper) EXPECT_EQ(id, helper.front());
    EXPECT_NE(helper.front(), std::this_thread::get_id());
}

TEST(WorkerPool, SleepingHelpersAndASleepingCallerAreWoken) {
    // Gaps between calls longer than the helpers' spin (they sleep), and a helper's unit longer than the
    // caller's spin (the caller sleeps): every call still completes with every unit.
    const auto past_spin = attend::detail::worker_pool::spin_budget * 5;
    for (int call = 0; call < 4; ++call) {
        std::this_thread::sleep_for(past_spin);
        unit_record r(2);
        parallel_for(2, 2, [&](index_t unit, int w) {
            if (unit == 1) std::this_thread::sleep_for(past_spin);
            r.note(unit, w);
        });
        EXPECT_TRUE(r.dealt_by_worker_of(2));
    }
}

TEST(WorkerPool, CallsFromManyApplicationThreadsAtOnceAllComplete) {
    // One call holds the pool; the others start their own threads. All give every unit once.
    std::atomic<int> wrong{0};
    std::vector<std::thread> callers;
    for (int c = 0; c < 4; ++c)
        callers.emplace_back([&, c] {
            for (int call = 0; call < 200; ++call)
                if (!runs_on_its_worker(17 + c, 2 + (call + c) % 3)) ++wrong;
        });
    for (auto& t : callers) t.join();
    EXPECT_EQ(wrong.load(), 0);
}

TEST(WorkerPool, AUnitThatCallsParallelForCompletes) {
    // The inner calls find the pool held by the outer one (by the same thread, for worker 0's units).
    std::atomic<int> inner_wrong{0};
    unit_record outer(6);
    parallel_for(6, 2, [&](index_t unit, int w) {
        if (!runs_on_its_worker(5, 2)) ++inner_wrong;
        outer.note(unit, w);
    });
    EXPECT_TRUE(outer.dealt_by_worker_of(2));
    EXPECT_EQ(inner_wrong.load(), 0);
}

TEST(WorkerPool, AnExceptionOnAKeptThreadReachesTheCallerAndThePoolStaysUsable) {
    std::thread::id before, after;
    parallel_for(2, 2, [&](index_t unit, int) {
        if (unit == 1) before = std::this_thread::get_id();
    });
    try {
        parallel_for(6, 2, [](index_t unit, int) {
            if (unit == 3) throw std::runtime_error("unit 3");
        });
        ADD_FAILURE() << "no exception";
    } catch (const std::runtime_error& e) {
        EXPECT_STREQ(e.what(), "unit 3");
    }
    EXPECT_TRUE(runs_on_its_worker(9, 2));
    parallel_for(2, 2, [&](index_t unit, int) {
        if (unit == 1) after = std::this_thread::get_id();
    });
    EXPECT_EQ(before, after);
}

TEST(WorkerPool, ReleaseScratchFreesTheKeptThreadsScratch) {
    // A kept thread's scratch (a scan's widened row, say) stays with that thread; release_scratch reaches it.
    parallel_for(2, 2, [](index_t unit, int) {
        if (unit == 1) attend::detail::aligned_vector<float> row(4096);
    });
    std::size_t helper_held = 0;
    parallel_for(2, 2, [&](index_t unit, int) {
        if (unit == 1) helper_held = attend::detail::scratch_blocks::of_this_thread()->held_bytes();
    });
    EXPECT_GE(helper_held, 4096 * sizeof(float));
    EXPECT_GE(attend::release_scratch(), helper_held);
    parallel_for(2, 2, [&](index_t unit, int) {
        if (unit == 1) helper_held = attend::detail::scratch_blocks::of_this_thread()->held_bytes();
    });
    EXPECT_EQ(helper_held, 0u);
}

#if defined(__unix__) || defined(__APPLE__)
TEST(WorkerPool, AForkedChildRunsItsCallsWithoutItsParentsThreads) {
    EXPECT_TRUE(runs_on_its_worker(8, 2));  // the parent's pool has a kept thread
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
        alarm(30);  // a child waiting for a thread that does not exist in it would hang: end it instead
        bool ok = true;
        for (int call = 0; call < 20; ++call) ok = ok && runs_on_its_worker(8, 2);
        _exit(ok ? 0 : 1);
    }
    int status = 0;
    ASSERT_EQ(waitpid(child, &status, 0), child);
    EXPECT_TRUE(WIFEXITED(status)) << "the child was ended by signal " << WTERMSIG(status);
    EXPECT_EQ(WEXITSTATUS(status), 0);
    EXPECT_TRUE(runs_on_its_worker(8, 2));  // and the parent's pool still works
}
#endif

}  // namespace
