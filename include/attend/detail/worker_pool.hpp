// SPDX-License-Identifier: MIT
#pragma once
/// The threads run_units hands its workers to, kept between calls. Starting and joining a std::thread costs
/// about 100 microseconds on a virtual machine (a tenth of a 256-token prefill on 2 threads; a decode over 1024
/// keys started threads twice and spent a third of its time so), and waking a sleeping one tens of
/// microseconds. A helper that finished its units spins a while for the next call before it sleeps, so a loop
/// of calls does not wait for a thread.
///
/// One caller at a time uses the pool: a call made while it is busy (from another application thread, or from
/// inside a unit) starts its own threads, as every call did before, so nothing waits for another call. The pool
/// grows to the most helpers a call asked for and its threads live until the process exits; a call that needs
/// more than max_helpers starts its own.
/// A child made by fork() has none of its parent's threads: it never uses the pool it inherited.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__) || defined(_M_IX86)
#include <emmintrin.h>
#endif
#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#endif

namespace attend::detail {

/// The hardware's thread count (1 if unknown), read once per process: glibc reads it from a file on every query,
/// an open, read and close that had cost a small call (a one-token decode step of a small model) a third of its
/// time.
inline int hardware_threads() noexcept {
    static const int n = [] {
        const unsigned h = std::thread::hardware_concurrency();
        return h == 0 ? 1 : static_cast<int>(h);
    }();
    return n;
}

/// What a helper runs: run(context, worker), which must not throw (run_units catches inside it).
struct pool_job {
    void (*run)(void*, int) = nullptr;
    void* context = nullptr;

    /// The job that calls f(worker); f must outlive it.
    template <class F>
    static pool_job of(const F& f) {
        return {[](void* c, int worker) { (*static_cast<const F*>(c))(worker); },
                const_cast<void*>(static_cast<const void*>(&f))};
    }
};

/// A hint to the core that this thread is spinning (x86 pause; a plain loop elsewhere).
inline void spin_pause() noexcept {
#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__) || defined(_M_IX86)
    _mm_pause();
#elif defined(__aarch64__) || defined(__arm__)
    __asm__ __volatile__("yield");
#endif
}

/// Spins until ready() or until `budget` has passed; returns ready(). The clock is read every 64 pauses; after the
/// first 5 µs each of those rounds also yields the core to any other thread ready to run on it: where threads
/// outnumber cores (a parallel build, another process), a helper spinning on pause alone had taken the time its
/// own caller needed (bench/README.md, fifth sitting).
template <class Ready>
bool spin_until(const Ready& ready, std::chrono::microseconds budget) {
    if (budget.count() <= 0) return ready();
    const auto start = std::chrono::steady_clock::now();
    const auto until = start + budget, pausing = start + std::chrono::microseconds(5);
    for (;;) {
        for (int i = 0; i < 64; ++i) {
            if (ready()) return true;
            spin_pause();
        }
        const auto now = std::chrono::steady_clock::now();
        if (now >= until) return ready();
        if (now >= pausing) std::this_thread::yield();
    }
}

class worker_pool {
public:
    /// A call that needs more helpers than these starts its own threads, as a call does when the pool is busy.
    static constexpr int max_helpers = 63;
    /// How long a helper spins for its next job, and the caller for its helpers, before sleeping (spin_until).
    /// Longer than the gap between the attention calls of a decode step of a small model.
    static constexpr std::chrono::microseconds spin_budget{500};

    /// The process's pool, marked busy for the caller; nullptr when another call holds it, in a forked child,
    /// or after it was destroyed at exit. Give it back with release().
    static worker_pool* acquire() noexcept {
        worker_pool* pool = instance();
        if (pool == nullptr || forked().load(std::memory_order_relaxed)) return nullptr;
        if (pool->busy_.exchange(true, std::memory_order_acquire)) return nullptr;
        return pool;
    }
    void release() noexcept { busy_.store(false, std::memory_order_release); }

    /// Grows the pool toward `helpers` threads (at most max_helpers); returns how many it has for this call,
    /// fewer when the system refused a thread.
    int reserve(int helpers) noexcept {
        helpers = std::min(helpers, max_helpers);
        try {
            // Room first: a started thread's slot is then stored without an allocation that could fail.
            slots_.reserve(static_cast<std::size_t>(helpers));
            while (static_cast<int>(slots_.size()) < helpers) {
                auto s = std::make_unique<slot>();
                s->thread = std::thread(&worker_pool::serve, this, s.get(), static_cast<int>(slots_.size()) + 1);
                slots_.push_back(std::move(s));
                helper_count_.store(static_cast<int>(slots_.size()), std::memory_order_relaxed);
            }
        } catch (...) {  // a thread or its slot could not be made: use those there are
        }
        return std::min(helpers, static_cast<int>(slots_.size()));
    }

    /// Runs job.run(job.context, w) on helper w for w in [1, helpers], then returns once all have finished;
    /// meanwhile the caller runs own(), its own share. helpers <= reserve()'s answer. noexcept: the helpers read
    /// the caller's job until they finish, so it may not unwind before they have.
    template <class Own>
    void run(const pool_job& job, int helpers, const Own& own) noexcept {
        job_ = job;
        pending_.store(helpers, std::memory_order_relaxed);
        for (int w = 1; w <= helpers; ++w) wake(*slots_[static_cast<std::size_t>(w - 1)]);
        own();
        if (spin_until([this] { return pending_.load(std::memory_order_acquire) == 0; }, spin())) return;
        std::unique_lock<std::mutex> lock(done_mutex_);
        caller_sleeping_.store(true);  // paired with the last helper's decrement, as in wake()
        done_cv_.wait(lock, [this] { return pending_.load() == 0; });
        caller_sleeping_.store(false);
    }

    /// Runs each(w) once on every helper thread the pool has, w its number, if no call holds the pool; returns
    /// whether it ran. For per-thread state of the helpers (their kept scratch). each must not throw.
    template <class Each>
    static bool each_helper(const Each& each) noexcept {
        worker_pool* pool = acquire();
        if (pool == nullptr) return false;
        pool->run(pool_job::of(each), static_cast<int>(pool->slots_.size()), [] {});
        pool->release();
        return true;
    }

    worker_pool() = default;
    worker_pool(const worker_pool&) = delete;
    worker_pool& operator=(const worker_pool&) = delete;
    ~worker_pool() {
        for (auto& s : slots_) {
            s->state.store(slot::stopping);
            std::lock_guard<std::mutex> lock(s->mutex);
            s->cv.notify_one();
        }
        for (auto& s : slots_) s->thread.join();
    }

private:
    struct slot {
        enum : int { idle, given, stopping };
        std::atomic<int> state{idle};
        std::atomic<bool> sleeping{false};
        std::mutex mutex;
        std::condition_variable cv;
        std::thread thread;
    };

    /// The pool lives on the heap behind a static owner: destroyed at exit (joining its threads) unless the
    /// process is a forked child, whose copies of the threads do not exist; there it is left as it is. Callers
    /// read it through `current`, which is never destroyed, so a call made after the owner's destruction (from
    /// a later static's destructor) finds no pool and starts its own threads.
    struct owner {
        owner() noexcept {
#if defined(__unix__) || defined(__APPLE__)
            pthread_atfork(nullptr, nullptr, [] { forked().store(true); });
#endif
            try {
                current().store(new worker_pool);
            } catch (...) {  // no pool: every call starts its own threads
            }
        }
        ~owner() {
            worker_pool* p = current().exchange(nullptr);
            if (!forked().load()) delete p;
        }
    };
    static std::atomic<worker_pool*>& current() noexcept {
        static std::atomic<worker_pool*> pool{nullptr};  // trivially destructible: outlives every owner
        return pool;
    }
    static worker_pool* instance() noexcept {
        static const owner o;
        (void)o;
        return current().load();
    }
    static std::atomic<bool>& forked() noexcept {
        static std::atomic<bool> f{false};
        return f;
    }
    /// No spinning when the pool's threads and the caller outnumber the hardware's: a spinning helper would
    /// take a core from one still working.
    std::chrono::microseconds spin() const noexcept {
        return helper_count_.load(std::memory_order_relaxed) + 1 <= hardware_threads() ? spin_budget
                                                                                       : std::chrono::microseconds{0};
    }

    /// Sets the slot's job and wakes its thread if it sleeps. The store of `state` and the load of `sleeping`
    /// here, and the helper's store of `sleeping` and load of `state`, are sequentially consistent: one of the
    /// two sees the other's, so a helper never sleeps through its job.
    void wake(slot& s) {
        s.state.store(slot::given);
        if (s.sleeping.load()) {
            std::lock_guard<std::mutex> lock(s.mutex);
            s.cv.notify_one();
        }
    }

    void serve(slot* s, int worker) {
        const auto has_job = [s] { return s->state.load(std::memory_order_acquire) != slot::idle; };
        for (;;) {
            if (!spin_until(has_job, spin())) {
                std::unique_lock<std::mutex> lock(s->mutex);
                s->sleeping.store(true);
                s->cv.wait(lock, [s] { return s->state.load() != slot::idle; });
                s->sleeping.store(false);
            }
            if (s->state.load(std::memory_order_acquire) == slot::stopping) return;
            job_.run(job_.context, worker);
            int given = slot::given;  // idle again, unless the pool was told to stop meanwhile
            s->state.compare_exchange_strong(given, slot::idle, std::memory_order_relaxed);
            // The last helper to finish wakes the caller if it sleeps (the same pairing as wake()).
            if (pending_.fetch_sub(1) == 1 && caller_sleeping_.load()) {
                std::lock_guard<std::mutex> lock(done_mutex_);
                done_cv_.notify_one();
            }
        }
    }

    std::atomic<bool> busy_{false};
    std::vector<std::unique_ptr<slot>> slots_;  // helper w is slots_[w - 1]
    pool_job job_;                              // the current call's, written before any helper is woken
    std::atomic<int> helper_count_{0};          // slots_.size(), for the helpers' spin()
    std::atomic<int> pending_{0};
    std::atomic<bool> caller_sleeping_{false};
    std::mutex done_mutex_;
    std::condition_variable done_cv_;
};

}  // namespace attend::detail
