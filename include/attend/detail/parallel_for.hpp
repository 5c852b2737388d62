// SPDX-License-Identifier: MIT
#pragma once
/// The threads of the tiled kernel: a fork-join over numbered work units with a static, deterministic
/// partition. A unit is always computed entirely by one thread and nothing a unit computes depends on which
/// thread ran it or on how many threads there are, so results are bit-identical for any thread count.
///
/// Eigen never starts threads of its own here: without OpenMP its products are single-threaded. When Eigen was
/// built with OpenMP (EIGEN_HAS_OPENMP / _OPENMP), each worker sets its own OpenMP thread count to 1 for the
/// duration of the call (omp_set_num_threads acts on the calling thread's ICV), so Eigen's GEMM does not nest a
/// second level of threads under ours; the caller's setting is restored before returning. A global
/// Eigen::setNbThreads(n > 1) by the application would still win; attend never calls it.

#include <algorithm>
#include <exception>
#include <thread>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "../tensor.hpp"
#include "worker_pool.hpp"

namespace attend::detail {

/// The number of threads a call uses: `requested`, or the hardware concurrency when it is 0.
inline int resolve_threads(int requested) { return requested > 0 ? requested : hardware_threads(); }

/// Keeps Eigen single-threaded inside a worker (a no-op without OpenMP).
class eigen_single_thread_scope {
public:
    eigen_single_thread_scope() {
#if defined(_OPENMP)
        saved_ = omp_get_max_threads();
        omp_set_num_threads(1);
#endif
    }
    ~eigen_single_thread_scope() {
#if defined(_OPENMP)
        omp_set_num_threads(saved_);
#endif
    }
    eigen_single_thread_scope(const eigen_single_thread_scope&) = delete;
    eigen_single_thread_scope& operator=(const eigen_single_thread_scope&) = delete;

private:
#if defined(_OPENMP)
    int saved_ = 1;
#endif
};

/// A callable's address and the one function that calls it: parallel_for's fork and join compile once, not once
/// per body (they were a tenth of the kernels' code); one indirect call per unit costs nothing next to a tile.
class unit_body {
public:
    template <class Body>
    explicit unit_body(Body& body)
        : body_(const_cast<void*>(static_cast<const void*>(&body))),
          call_([](void* b, index_t unit, int worker) { (*static_cast<Body*>(b))(unit, worker); }) {}
    void operator()(index_t unit, int worker) const { call_(body_, unit, worker); }

private:
    void* body_;
    void (*call_)(void*, index_t, int);
};

/// The worker that runs unit u of a call with `workers` workers: one unit of each round of `workers` units, dealt
/// forward in even rounds and backward in odd ones (w, 2 workers - 1 - w, 2 workers + w, ...). Units of rising
/// cost, such as the query blocks of a causal mask, then even out: plain round robin gave the last worker the
/// dearer unit of every round (2 workers, the 8 query blocks of a causal head, block b doing b + 1/2 tiles of
/// work: 18 against 14 tiles; dealt this way, 16 and 16).
inline int worker_of(index_t unit, int workers) {
    const index_t round = unit / workers, at = unit % workers;
    return static_cast<int>(round % 2 == 0 ? at : workers - 1 - at);
}

/// Runs body(unit, worker) for every unit in [0, units), worker in [0, workers) with
/// workers = min(threads, units), unit u on worker_of(u, workers). The calling thread is
/// worker 0; the others are the process's kept threads (worker_pool) or, when those are busy with another
/// call, std::threads started for this call and joined before it returns. Which thread runs a worker changes
/// nothing it computes. The first exception a worker throws is rethrown here after every worker has stopped.
inline void run_units(index_t units, int threads, const unit_body& body) {
    if (units <= 0) return;
    const int workers = static_cast<int>(std::min<index_t>(std::max(threads, 1), units));
    std::vector<std::exception_ptr> errors(static_cast<std::size_t>(workers));
    const auto work = [&](int worker) noexcept {
        try {
            eigen_single_thread_scope single;
            for (index_t unit = 0; unit < units; ++unit)
                if (worker_of(unit, workers) == worker) body(unit, worker);
        } catch (...) {
            errors[static_cast<std::size_t>(worker)] = std::current_exception();
        }
    };
    // Workers [1, started) run on other threads; the units of any worker past them run here afterwards, still
    // one worker's units on one thread, so results do not change when the system refuses a thread.
    int started = 1;
    if (workers == 1) {
        work(0);
    } else if (worker_pool* pool = workers - 1 <= worker_pool::max_helpers ? worker_pool::acquire() : nullptr) {
        started = pool->reserve(workers - 1) + 1;
        pool->run(pool_job::of(work), started - 1, [&] { work(0); });
        pool->release();
    } else {
        std::vector<std::thread> own;
        try {
            own.reserve(static_cast<std::size_t>(workers - 1));
            for (int w = 1; w < workers; ++w) own.emplace_back(work, w);
        } catch (...) {  // fewer threads: the rest run below
        }
        started = static_cast<int>(own.size()) + 1;
        work(0);
        for (auto& t : own) t.join();
    }
    for (int w = started; w < workers; ++w) work(w);
    for (const auto& e : errors)
        if (e) std::rethrow_exception(e);
}

/// run_units over any callable body(unit, worker).
template <class Body>
void parallel_for(index_t units, int threads, Body&& body) {
    run_units(units, threads, unit_body(body));
}

}  // namespace attend::detail
