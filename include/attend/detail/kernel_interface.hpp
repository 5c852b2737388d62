// SPDX-License-Identifier: MIT
#pragma once
/// What every kernel takes and gives, forward and backward, reference and tiled: row-major matrix views of a
/// (batch, head) slice, the validated parameters of a call, and where the results go.

#include <array>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include "../score_bias.hpp"
#include "../score_function.hpp"
#include "../shape.hpp"
#include "dropout.hpp"
#include "paged_view.hpp"

/// Compiling the kernels once. A program that includes attend in many translation units compiles the float and
/// double kernels in each of them; it can instead define ATTEND_SEPARATE_KERNELS everywhere and compile
/// src/kernels.cpp (which defines ATTEND_KERNELS_DEFINE) once, as the attend::kernels CMake target does: every
/// kernel header then declares its float and double instances `extern template`, and that file defines them.
/// Results are the same bits either way; only where the code is compiled changes.
#if defined(ATTEND_KERNELS_DEFINE)
#define ATTEND_KERNEL_INSTANCE template
#elif defined(ATTEND_SEPARATE_KERNELS)
#define ATTEND_KERNEL_INSTANCE extern template
#endif

namespace attend::detail {

template <class T>
using row_matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class T>
using tile_map = Eigen::Map<row_matrix<T>, 0, Eigen::OuterStride<>>;
template <class T>
using const_tile_map = Eigen::Map<const row_matrix<T>, 0, Eigen::OuterStride<>>;

/// A `[len, dim]` slice of a strided view as a row-major matrix with the view's row stride.
template <class T>
auto matrix_of(const strided_view<T>& x, index_t b, index_t h) {
    using plain = row_matrix<std::remove_const_t<T>>;
    using map = Eigen::Map<std::conditional_t<std::is_const_v<T>, const plain, plain>, 0, Eigen::OuterStride<>>;
    return map(x.row(b, h, 0), x.dims[2], x.dims[3], Eigen::OuterStride<>(x.strides[2]));
}

/// Where the results go: out `[batch, heads, query_len, value_dim]` (strided), and when not null the contiguous
/// weights `[batch, heads, query_len, key_len]` in the storage type T, and lse `[batch, heads, query_len]` in the
/// accumulation type (float for 16-bit storage, as PyTorch's flash kernels keep it: a 16-bit lse would lose the
/// precision merge_partials and the backward need).
template <class T>
struct attention_outputs {
    strided_view<T> out;
    T* weights = nullptr;
    accumulator_t<T>* lse = nullptr;
};

/// check_finite's scan of the keys and values (input_scan.hpp), handed to a kernel that reads them once anyway:
/// the tiled kernel's decode path notes what it sees while it streams them and asks for the verdict before it
/// writes any output, so the default options do not read K and V twice; any other path runs the scan first.
class deferred_kv_scan {
public:
    /// The scan as check_call runs it before a kernel, on up to `threads` threads (the same error for any
    /// count): throws value_error attend.value.non_finite or attend.value.score_overflow.
    virtual void scan_now(int threads) const = 0;
    /// The verdict from what a pass over every key and value row found: `key_max_abs` `[batch * kv_heads]` the
    /// largest |k| of each (batch, kv head) as the kernel computes with it, `non_finite` whether any key or value
    /// was NaN or +-inf. Throws exactly what scan_now would throw (it runs scan_now whenever the findings do not
    /// settle the call), otherwise returns.
    virtual void verify(const std::vector<double>& key_max_abs, bool non_finite) const = 0;

protected:
    ~deferred_kv_scan() = default;
};

/// Everything a kernel needs besides tensors and mask, already validated.
template <class T>
struct kernel_params {
    T scale = 1;
    T softcap = 0;  ///< > 0: scaled scores become softcap * tanh(score / softcap) before bias and mask; 0: off
    dropout_rule dropout;
    const score_bias* bias = nullptr;
    const score_tiles* score_mod = nullptr;  ///< the user's score modifier (score_function.hpp), or null
    bool weights_after_dropout = false;
    /// `[heads]` sink logits (sinks.hpp): each joins its head's softmax denominators with no value; empty: none.
    std::vector<T> sinks;
    /// Not null: check_finite's scan of k and v is left to the forward kernel (deferred_kv_scan); null: done.
    const deferred_kv_scan* kv_scan = nullptr;
    bool has_sinks() const { return !sinks.empty(); }
    T sink(index_t head) const { return sinks[static_cast<std::size_t>(head)]; }
};

/// The inputs of a backward call as strided views, so multi-head attention can pass heads of its projected
/// `[batch, len, heads * dim]` buffers (split_heads) without copying. out and d_out are `[batch, heads,
/// query_len, value_dim]`; lse is contiguous `[batch, heads, query_len]`, in the accumulation type as the forward
/// writes it (float for 16-bit storage).
template <class T>
struct backward_inputs {
    strided_view<const T> q, k, v, out, d_out;
    const accumulator_t<T>* lse = nullptr;
    std::array<index_t, 3> lse_dims{};  ///< batch, heads, query_len (rank-2 lse `[batch, query_len]`: heads = 1)
    int lse_rank = 3;                   ///< rank of the lse the caller passed (2 or 3), for messages
};

/// Where the gradients go. d_query, d_key, d_value are overwritten (not accumulated into) and must not overlap each other
/// or the inputs. d_score_bias, when not null, is contiguous `[heads, query_len + key_len - 1]` and is
/// written only when the call has a score_bias; d_sinks, when not null, `[heads]`, only when it has sinks.
template <class T>
struct gradient_outputs {
    strided_view<T> d_query, d_key, d_value;
    T* d_score_bias = nullptr;
    T* d_sinks = nullptr;
};

}  // namespace attend::detail
