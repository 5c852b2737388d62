// SPDX-License-Identifier: MIT
// Twin of mha_cache_storage_ok.cpp: a double module's cache holds doubles; only a float module (llama.cpp's
// float activations over an fp16 cache) stores its keys and values in 16 bits.
// expect-error: caches keys and values in T, or a float one in Eigen::half or Eigen::bfloat16
#include <attend/mha.hpp>

auto attend_double_module_with_an_fp16_cache() {
    const attend::multi_head_attention<double> m(attend::mha_config{8, 2});
    return m.make_cache<Eigen::half>(1, 4);
}
