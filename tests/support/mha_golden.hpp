// SPDX-License-Identifier: MIT
#pragma once
/// The nn.MultiheadAttention goldens of tests/data/mha.json as attend objects: the module (config and parameters
/// under PyTorch's names), the inputs, and the masks in nn.MultiheadAttention's conventions.

#include <string>

#include <gtest/gtest.h>

#include <attend/mask.hpp>
#include <attend/mha.hpp>

#include "golden.hpp"

namespace attend_test {

/// The case names of tests/data/mha.json.
inline const char* const golden_mha_cases[] = {"self_attention_masked", "cross_attention_L3_S5", "kdim5_vdim6",
                                               "no_bias"};

template <class T>
attend::torch_mha_parameters<T> golden_parameters(const json& c) {
    attend::torch_mha_parameters<T> p;
    const json& params = member(c, "parameters");
    for (const auto& name_json : member(c, "parameter_names")) {
        const auto name = name_json.get<std::string>();
        const json& t = params.at(name);
        if (name == "in_proj_weight") p.in_proj_weight = to_tensor<T, 2>(t, name);
        else if (name == "q_proj_weight") p.q_proj_weight = to_tensor<T, 2>(t, name);
        else if (name == "k_proj_weight") p.k_proj_weight = to_tensor<T, 2>(t, name);
        else if (name == "v_proj_weight") p.v_proj_weight = to_tensor<T, 2>(t, name);
        else if (name == "in_proj_bias") p.in_proj_bias = to_tensor<T, 1>(t, name);
        else if (name == "out_proj.weight") p.out_proj_weight = to_tensor<T, 2>(t, name);
        else if (name == "out_proj.bias") p.out_proj_bias = to_tensor<T, 1>(t, name);
        else ADD_FAILURE() << "unknown parameter " << name;
    }
    return p;
}

inline attend::mha_config golden_config(const json& c) {
    const json& cfg = member(c, "config");
    attend::mha_config config;
    config.model_dim = cfg.at("embed_dim").get<attend::index_t>();
    config.heads = cfg.at("num_heads").get<attend::index_t>();
    config.key_dim = cfg.at("kdim").get<attend::index_t>();
    config.value_dim = cfg.at("vdim").get<attend::index_t>();
    config.bias = cfg.at("bias").get<bool>();
    return config;
}

/// The query, key and value inputs of a case.
template <class T>
struct golden_inputs {
    attend::tensor<T, 3> query, key, value;
};

template <class T>
golden_inputs<T> golden_mha_inputs(const json& c) {
    const json& in = member(c, "inputs");
    return {to_tensor<T, 3>(in.at("query"), "query"), to_tensor<T, 3>(in.at("key"), "key"),
            to_tensor<T, 3>(in.at("value"), "value")};
}

/// Calls f(mask, options) with the case's masks: attn_mask [L, S] (true = blocked) as the mask, key_padding_mask
/// [B, S] (true = ignore) as options.key_padding, both in nn.MultiheadAttention's convention and both wrapped the
/// same way, forbidden_mask::from_torch_mha, as a user porting PyTorch code writes them.
template <class F>
auto with_golden_masks(const json& c, attend::mha_options options, F&& f) {
    const json& masks = member(c, "masks");
    if (!masks.at("key_padding_mask").is_null())
        options.key_padding =
            attend::forbidden_mask::key_padding(to_bool<2>(masks.at("key_padding_mask"), "key_padding_mask"));
    if (!masks.at("attn_mask").is_null()) {
        return f(attend::forbidden_mask::query_key_grid(to_bool<2>(masks.at("attn_mask"))), options);
    }
    return f(attend::no_mask{}, options);
}

/// forward of the case's inputs under its masks.
template <class T>
attend::mha_result<T> golden_forward(const attend::multi_head_attention<T>& m, const json& c,
                                     const attend::mha_options& options) {
    const auto x = golden_mha_inputs<T>(c);
    return with_golden_masks(c, options, [&](const auto& mask, const attend::mha_options& o) {
        return m.forward(x.query, x.key, x.value, mask, o);
    });
}

}  // namespace attend_test
