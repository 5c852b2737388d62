// SPDX-License-Identifier: MIT
#pragma once
/// Two guards of the calls that write memory. Outputs that share memory with an input or with each other are
/// rejected before anything is written (shape_error attend.shape.aliasing): the kernels read inputs while they
/// write outputs, tile by tile and from several threads, so an overlap would give results that depend on the
/// order of the work. And a result, workspace or thread scratch that cannot be allocated becomes a resource_error
/// (attend.resource.allocation) naming what was being allocated and its size, instead of a std::bad_alloc from
/// deep inside Eigen or the standard library.

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <new>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include "../error.hpp"
#include "../shape.hpp"
#include "../tensor.hpp"
#include "worker_pool.hpp"

namespace attend::detail {

/// Scratch blocks this thread has freed, kept for its next call of the same shape. A call's scratch (a worker's
/// score tile, packed K and V: about a megabyte) is freed at its end; glibc gives such blocks back to the system
/// (munmap, or a trim of the heap's top), so every call faulted its scratch in again, page by page: with 2
/// threads that had been over a third of a 256-token prefill. Kept: blocks of exactly the size asked for, at most
/// max_blocks of them and max_bytes in all; a block past either limit is freed as before.
class scratch_blocks {
public:
    static constexpr std::size_t max_blocks = 128;  // a worker's scratch plus up to 7 parked query blocks' (6 each)
    static constexpr std::size_t max_bytes = std::size_t(64) << 20;

    /// A kept block of exactly `bytes`, or nullptr.
    void* take(std::size_t bytes) {
        for (std::size_t n = blocks_.size(); n-- > 0;)
            if (blocks_[n].bytes == bytes) {
                void* p = blocks_[n].data;
                blocks_.erase(blocks_.begin() + static_cast<std::ptrdiff_t>(n));
                held_ -= bytes;
                return p;
            }
        return nullptr;
    }
    /// Keeps p (of `bytes`) if the limits allow; false: the caller frees it.
    bool keep(void* p, std::size_t bytes) {
        if (blocks_.size() >= max_blocks || bytes > max_bytes - held_) return false;
        try {
            blocks_.push_back({p, bytes});
        } catch (const std::bad_alloc&) {  // no room to note it: freed as before
            return false;
        }
        held_ += bytes;
        return true;
    }
    std::size_t held_bytes() const { return held_; }
    /// f(data, bytes) for every kept block: a test fills them with NaN, since no kernel may read scratch it did not
    /// write (unzeroed_vector).
    template <class F>
    void for_each_kept(const F& f) const {
        for (const block& b : blocks_) f(b.data, b.bytes);
    }
    std::size_t block_count() const { return blocks_.size(); }
    /// Frees every kept block; returns their bytes.
    std::size_t release() noexcept {
        for (const block& b : blocks_) Eigen::internal::aligned_free(b.data);
        blocks_.clear();
        const std::size_t freed = held_;
        held_ = 0;
        return freed;
    }

    scratch_blocks() = default;  // allocates nothing: a thread's first free may come before any allocation
    scratch_blocks(const scratch_blocks&) = delete;
    scratch_blocks& operator=(const scratch_blocks&) = delete;
    ~scratch_blocks() {
        release();
        gone() = true;
    }

    /// This thread's blocks; nullptr once they were destroyed at the thread's exit (a scratch vector freed later,
    /// by another thread_local's destructor, is then freed directly).
    static scratch_blocks* of_this_thread() {
        if (gone()) return nullptr;
        thread_local scratch_blocks blocks;
        return &blocks;
    }

private:
    struct block {
        void* data;
        std::size_t bytes;
    };
    static bool& gone() {
        thread_local bool destroyed = false;  // trivially destructible: readable after the blocks are gone
        return destroyed;
    }
    std::vector<block> blocks_;
    std::size_t held_ = 0;
};

/// Eigen's aligned allocation, through this thread's scratch_blocks.
template <class T>
struct scratch_allocator {
    using value_type = T;
    scratch_allocator() = default;
    template <class U>
    scratch_allocator(const scratch_allocator<U>&) noexcept {}

    T* allocate(std::size_t n) {
        const std::size_t bytes = n * sizeof(T);  // std::vector keeps n within max_size()
        if (scratch_blocks* kept = scratch_blocks::of_this_thread())
            if (void* p = kept->take(bytes)) return static_cast<T*>(p);
        return static_cast<T*>(Eigen::internal::aligned_malloc(bytes));  // std::bad_alloc when it fails
    }
    void deallocate(T* p, std::size_t n) noexcept {
        scratch_blocks* kept = scratch_blocks::of_this_thread();
        if (!kept || !kept->keep(p, n * sizeof(T))) Eigen::internal::aligned_free(p);
    }
    template <class U>
    bool operator==(const scratch_allocator<U>&) const noexcept {
        return true;
    }
    template <class U>
    bool operator!=(const scratch_allocator<U>&) const noexcept {
        return false;
    }
};

/// A vector whose data is aligned for the widest SIMD packet of the target (Eigen's EIGEN_MAX_ALIGN_BYTES). The
/// kernels' scratch is one: Eigen's vectorized sums and exps handle a buffer's unaligned head element by element,
/// so with malloc's 16-byte alignment an AVX build would sum and exponentiate in an order, and with a precision,
/// that depend on where the heap put the buffer, and the same call could give different bits twice in a row.
/// Its blocks are kept for the thread's next call (scratch_blocks); a vector's elements are still value-initialized
/// (zero) when it is sized (unzeroed_vector, below, leaves them as the memory held them).
template <class T>
using aligned_vector = std::vector<T, scratch_allocator<T>>;

/// scratch_allocator whose vectors leave their elements default-initialized when sized (for float and double: not
/// written at all), for the buffers a kernel writes before it reads them. Zeroing a tiled call's scores, panels and
/// scaled queries on every call had been 3 % of a 256-token prefill (Zen 4, perf), the scratch blocks being kept.
template <class T>
struct unzeroed_scratch_allocator : scratch_allocator<T> {
    unzeroed_scratch_allocator() = default;
    template <class U>
    unzeroed_scratch_allocator(const unzeroed_scratch_allocator<U>&) noexcept {}
    /// Sizing default-initializes; a construction with arguments goes to std::allocator_traits' placement new.
    template <class U>
    void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>) {
        ::new (static_cast<void*>(p)) U;
    }
};

/// An aligned_vector whose elements start with whatever the memory held (see unzeroed_scratch_allocator).
template <class T>
using unzeroed_vector = std::vector<T, unzeroed_scratch_allocator<T>>;

/// The bytes [begin, end) from a tensor's lowest to its highest element address (empty: begin == end). For a
/// strided view this is conservative: two views whose rows interleave (two heads of one projected buffer)
/// overlap by this measure although they share no element.
struct memory_range {
    std::uintptr_t begin = 0;
    std::uintptr_t end = 0;

    bool overlaps(const memory_range& o) const {
        return begin < end && o.begin < o.end && begin < o.end && o.begin < end;
    }
};

/// The range of `size` contiguous elements at `data`.
template <class T>
memory_range range_of(const T* data, index_t size) {
    if (data == nullptr || size <= 0) return {};
    const auto begin = reinterpret_cast<std::uintptr_t>(data);
    return {begin, begin + static_cast<std::uintptr_t>(size) * sizeof(T)};
}

/// The range of a strided view, whatever the signs of its strides.
template <class T>
memory_range range_of(const strided_view<T>& v) {
    if (v.data == nullptr) return {};
    std::uintptr_t below = 0, above = 0;  // elements before and after v.data
    for (std::size_t a = 0; a < 4; ++a) {
        if (v.dims[a] <= 0) return {};
        const index_t reach = (v.dims[a] - 1) * v.strides[a];
        if (reach < 0) below += static_cast<std::uintptr_t>(-reach);
        else above += static_cast<std::uintptr_t>(reach);
    }
    const auto base = reinterpret_cast<std::uintptr_t>(v.data);
    return {base - below * sizeof(T), base + (above + 1) * sizeof(T)};
}

/// A tensor of a call, for the aliasing check: its name in messages, its shape as spelled there, its memory.
struct named_range {
    const char* name;
    shape_words shape;
    memory_range range;
};

template <class T>
named_range named(const char* name, const strided_view<T>& v) {
    return {name, words_of(v), range_of(v)};
}

template <class T, std::size_t N>
named_range named(const char* name, const T* data, const std::array<index_t, N>& dims) {
    static_assert(N <= 4, "shapes of rank 4 at most");
    index_t size = 1;
    shape_words words{{}, N};
    for (std::size_t a = 0; a < N; ++a) {
        size *= dims[a];
        words.dims[a] = dims[a];
    }
    return {name, words, range_of(data, size)};
}

/// Throws shape_error attend.shape.aliasing, naming both tensors, when an output overlaps an input or an
/// earlier output. Runs before anything is written.
inline void check_no_aliasing(std::initializer_list<named_range> inputs, std::initializer_list<named_range> outputs) {
    const auto fail = [](const named_range& out, const char* kind, const named_range& other) {
        throw shape_error("attend.shape.aliasing",
                          concat("output ", out.name, ' ', out.shape.text(), " overlaps ", kind, ' ', other.name, ' ',
                                 other.shape.text(),
                                 " in memory; outputs are written while inputs are still read, so an "
                                 "output may share no memory with an input or another output: pass separate buffers"));
    };
    for (auto out = outputs.begin(); out != outputs.end(); ++out) {
        for (const auto& in : inputs)
            if (out->range.overlaps(in.range)) fail(*out, "input", in);
        for (auto earlier = outputs.begin(); earlier != out; ++earlier)
            if (out->range.overlaps(earlier->range)) fail(*out, "output", *earlier);
    }
}

/// "weights [1,1,1048576,1048576] = 4398046511104 bytes": what an allocation was for. The byte count is a
/// double because the product of the dims may overflow every integer type.
template <class Dims>
std::string allocation_text(const char* what, const Dims& dims, std::size_t scalar_bytes) {
    double bytes = static_cast<double>(scalar_bytes);
    for (auto d : dims) bytes *= static_cast<double>(d);
    return concat(what, ' ', format_shape(dims), " = ", bytes, " bytes");
}

[[noreturn]] inline void throw_allocation_failure(const std::string& what, const char* cause, const char* hint) {
    throw resource_error("attend.resource.allocation",
                         concat("could not allocate ", what, " (", cause, "); nothing was written. ", hint));
}

/// Runs allocate() and returns what it returns; a std::bad_alloc or std::length_error (a size past what the
/// allocator can represent) becomes resource_error attend.resource.allocation with describe()'s text and the
/// hint. describe is called only on failure, so a call that succeeds builds no message.
template <class Allocate, class Describe>
auto allocating(Allocate&& allocate, Describe&& describe, const char* hint) -> decltype(allocate()) {
    try {
        return allocate();
    } catch (const resource_error&) {  // already says what failed, from deeper inside
        throw;
    } catch (const std::bad_alloc&) {
        throw_allocation_failure(describe(), "std::bad_alloc", hint);
    } catch (const std::length_error&) {
        throw_allocation_failure(describe(), "std::length_error", hint);
    }
}

/// t.resize(dims), guarded: `what` names t in the message.
template <class Tensor, class Dims>
void resize_guarded(Tensor& t, const Dims& dims, const char* what, const char* hint) {
    allocating([&] { t.resize(dims); }, [&] { return allocation_text(what, dims, sizeof(typename Tensor::Scalar)); },
               hint);
}

}  // namespace attend::detail

namespace attend {

/// Frees the scratch the calling thread kept from its earlier calls for its next one (at most 64 MiB a thread;
/// docs/guarantees.md), and that of attend's kept worker threads unless a call is using them at that moment,
/// for a program done with attention that lives on. Returns the bytes freed.
inline std::size_t release_scratch() noexcept {
    std::atomic<std::size_t> freed{0};
    const auto release_here = [&freed](int) noexcept {
        if (detail::scratch_blocks* kept = detail::scratch_blocks::of_this_thread()) freed += kept->release();
    };
    release_here(0);
    detail::worker_pool::each_helper(release_here);
    return freed.load();
}

}  // namespace attend
