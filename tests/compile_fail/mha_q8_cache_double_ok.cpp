// SPDX-License-Identifier: MIT
// Twin of mha_q8_cache_double_ko.cpp: a float module decodes over an int8 (q8_0) cache.
#include <attend/mha.hpp>

auto attend_float_module_over_an_int8_cache() {
    const attend::multi_head_attention<float> m(attend::mha_config{64, 2});
    auto cache = m.make_cache<attend::q8_0_block>(1, 4);
    attend::tensor<float, 3> x(1, 1, 64);
    return m.forward_cached(x, cache);
}
