// SPDX-License-Identifier: MIT
// Twin of mha_q8_cache_double_ok.cpp: an int8 (q8_0) cache is read by float or 16-bit queries, so a double
// module cannot decode over one.
// expect-error: cache is read by float or 16-bit queries
#include <attend/mha.hpp>

auto attend_double_module_over_an_int8_cache() {
    const attend::multi_head_attention<double> m(attend::mha_config{64, 2});
    attend::q8_kv_cache cache(attend::kv_cache_config{}.with_kv_heads(2).with_capacity(4).with_head_dim(32));
    attend::tensor<double, 3> x(1, 1, 64);
    return m.forward_cached(x, cache);
}
