// SPDX-License-Identifier: MIT
// Twin of mha_cache_storage_ko.cpp: a float module decodes over an fp16 cache.
#include <attend/mha.hpp>

auto attend_float_module_over_an_fp16_cache() {
    const attend::multi_head_attention<float> m(attend::mha_config{8, 2});
    auto cache = m.make_cache<Eigen::half>(1, 4);
    attend::tensor<float, 3> x(1, 1, 8);
    x.setZero();
    return m.forward_cached(x, cache);
}
