// SPDX-License-Identifier: MIT
#pragma once
/// For a test binary that interposes glibc's malloc family to watch or fail allocations. Defines
/// ATTEND_TEST_MALLOC_HOOKS where that is possible (glibc, and no AddressSanitizer, which owns malloc), and then
/// replaces every global operator new and delete with one that goes through std::malloc and std::free, so
/// std::vector, std::string and the rest reach the same hooks as Eigen (which allocates with malloc). The binary
/// defines malloc, calloc, realloc, memalign and free itself under `#ifdef ATTEND_TEST_MALLOC_HOOKS`, on top of
/// glibc's own (__libc_malloc and the rest, declared here); aligned_alloc and posix_memalign go through its
/// memalign. Include this in exactly one translation unit, at global scope.

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <new>

#if defined(__SANITIZE_ADDRESS__)
#define ATTEND_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define ATTEND_TEST_ASAN 1
#endif
#endif

#if defined(__GLIBC__) && !defined(ATTEND_TEST_ASAN)
#define ATTEND_TEST_MALLOC_HOOKS 1
#include <malloc.h>

extern "C" {
void* __libc_malloc(std::size_t);
void* __libc_calloc(std::size_t, std::size_t);
void* __libc_realloc(void*, std::size_t);
void* __libc_memalign(std::size_t, std::size_t);
void __libc_free(void*);

void* aligned_alloc(std::size_t alignment, std::size_t n) noexcept { return memalign(alignment, n); }
int posix_memalign(void** out, std::size_t alignment, std::size_t n) noexcept {
    void* p = memalign(alignment, n);
    if (!p) return ENOMEM;
    *out = p;
    return 0;
}
}

void* operator new(std::size_t n) {
    if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
    throw std::bad_alloc();
}
void* operator new[](std::size_t n) { return operator new(n); }
void* operator new(std::size_t n, std::align_val_t alignment) {
    void* p = nullptr;
    if (posix_memalign(&p, std::max(sizeof(void*), static_cast<std::size_t>(alignment)), n == 0 ? 1 : n) == 0) return p;
    throw std::bad_alloc();
}
void* operator new[](std::size_t n, std::align_val_t alignment) { return operator new(n, alignment); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept { return std::malloc(n == 0 ? 1 : n); }
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept { return std::malloc(n == 0 ? 1 : n); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }

#endif
