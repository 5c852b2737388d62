// SPDX-License-Identifier: MIT
#pragma once
/// Where a causal-style rule puts its diagonal when query_len != key_len.

namespace attend {

/// top_left: query i sees keys j <= i (PyTorch's is_causal). bottom_right: j <= i + key_len - query_len, so the
/// last query sees the last key (KV-cache decoding, FlashAttention >= 2.1). Equal when query_len == key_len.
enum class alignment { top_left, bottom_right };

}  // namespace attend
