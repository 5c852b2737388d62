// SPDX-License-Identifier: MIT
// Twin of mha_paged_q8_double_ko.cpp: a float module decodes over an int8 (q8_0) paged pool.
#include <attend/mha.hpp>

auto attend_float_module_over_an_int8_pool() {
    const attend::multi_head_attention<float> m(attend::mha_config{64, 2});
    attend::paged_cache_config c;
    c.kv_heads = 2;
    c.head_dim = 32;
    c.blocks = 4;
    attend::paged_kv_cache<attend::q8_0_block> cache(c);
    const attend::index_t id = cache.add_sequence();
    attend::tensor<float, 3> x(1, 1, 64);
    return m.forward_cached(x, cache, {id}, {1});
}
