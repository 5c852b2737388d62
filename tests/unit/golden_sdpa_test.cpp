// SPDX-License-Identifier: MIT
// scaled_dot_product_attention against tests/data/sdpa.json, written by tests/data/generate_goldens.py with
// float64 PyTorch math and cross-checked there against torch's own SDPA and F.multi_head_attention_forward.
// Each case's mask is built with the named constructor of its convention:
//   sdpa_bool -> allowed_mask::from_torch_sdpa (true = may attend)
//   mha_bool  -> forbidden_mask::from_torch_mha (true = blocked), then to_allowed
//   additive  -> additive_mask<double>::from_values
//   causal_*  -> causal(alignment::top_left / bottom_right)
// and runs in double with both kernels; out, weights and lse must match to 1e-10. The max abs error of every case
// is printed and recorded as a test property.

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <iostream>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <attend/attend.hpp>

#include "support/compare.hpp"
#include "support/dense_masks.hpp"
#include "support/golden.hpp"

namespace {

using attend::index_t;
using attend_test::json;
using attend_test::max_abs_diff;
template <class T, int Rank>
using tensor = attend::tensor<T, Rank>;

constexpr double tolerance = 1e-10;

const json& sdpa_doc() {
    static const json doc = attend_test::load_golden("sdpa.json");
    return doc;
}

std::vector<std::string> case_names() {
    std::vector<std::string> names;
    for (const json& c : attend_test::member(sdpa_doc(), "cases")) names.push_back(c.at("name").get<std::string>());
    return names;
}

struct errors {
    double out = 0, weights = 0, lse = 0;
    std::string out_at, weights_at, lse_at;
};

/// Runs one case of rank Rank with the mask the case names, on one kernel.
template <int Rank, class Mask>
errors run_case(const json& c, const Mask& mask, attend::kernel kernel) {
    const auto q = attend_test::tensor_at<double, Rank>(c, "q");
    const auto k = attend_test::tensor_at<double, Rank>(c, "k");
    const auto v = attend_test::tensor_at<double, Rank>(c, "v");
    attend::sdpa_options o;
    o.scale = attend_test::to_optional_number(attend_test::member(c, "scale"), "scale");
    o.need_weights = true;
    o.need_lse = true;
    o.kernel = kernel;
    const auto r = attend::scaled_dot_product_attention(q, k, v, mask, o);
    errors e;
    e.out = max_abs_diff(r.out, attend_test::tensor_at<double, Rank>(c, "out"), &e.out_at);
    e.weights = max_abs_diff(r.weights, attend_test::tensor_at<double, Rank>(c, "weights"), &e.weights_at);
    e.lse = max_abs_diff(r.lse, attend_test::tensor_at<double, Rank - 1>(c, "lse"), &e.lse_at);
    return e;
}

/// Calls f(mask) with the mask tensor of the case read at its own rank (2, 3 or 4) and wrapped by `wrap`.
template <class Scalar, class Wrap, class F>
void with_mask_tensor(const json& mask, Wrap&& wrap, F&& f) {
    const json& t = attend_test::member(mask, "tensor");
    switch (attend_test::shape_of(t, "mask.tensor").size()) {
        case 2: f(wrap(attend_test::to_tensor<Scalar, 2>(t, "mask.tensor"))); return;
        case 3: f(wrap(attend_test::to_tensor<Scalar, 3>(t, "mask.tensor"))); return;
        case 4: f(wrap(attend_test::to_tensor<Scalar, 4>(t, "mask.tensor"))); return;
        default: FAIL() << "mask tensor of unsupported rank";
    }
}

/// Dispatches on mask.kind with the named constructor of that convention.
template <int Rank>
errors run_with_named_mask(const json& c, attend::kernel kernel) {
    const json& mask = attend_test::member(c, "mask");
    const std::string kind = attend_test::member(mask, "kind").get<std::string>();
    errors e;
    bool ran = false;
    const auto go = [&](const auto& m) {
        e = run_case<Rank>(c, m, kernel);
        ran = true;
    };
    if (kind == "none") {
        go(attend::no_mask{});
    } else if (kind == "sdpa_bool") {
        with_mask_tensor<bool>(
            mask, [](const auto& t) { return attend_test::dense_mask<attend::allowed_mask>(t); }, go);
    } else if (kind == "mha_bool") {
        with_mask_tensor<bool>(
            mask, [](const auto& t) { return attend::to_allowed(attend_test::dense_mask<attend::forbidden_mask>(t)); },
            go);
    } else if (kind == "additive") {
        with_mask_tensor<double>(
            mask, [](const auto& t) { return attend_test::dense_mask<attend::additive_mask<double>>(t); }, go);
    } else if (kind == "causal_top_left") {
        go(attend::causal(attend::alignment::top_left));
    } else if (kind == "causal_bottom_right") {
        go(attend::causal(attend::alignment::bottom_right));
    } else {
        ADD_FAILURE() << "unknown mask kind \"" << kind << "\"";
    }
    if (!ran) {
        e.out = e.weights = e.lse = std::numeric_limits<double>::infinity();
        e.out_at = "the case did not run";
    }
    return e;
}

class GoldenSdpa : public ::testing::TestWithParam<std::string> {};

TEST_P(GoldenSdpa, OutWeightsAndLseMatchPyTorchFloat64ToOneInTenBillion) {
    const json& c = attend_test::find_case(sdpa_doc(), GetParam());
    const int rank = static_cast<int>(attend_test::shape_of(attend_test::member(c, "q"), "q").size());
    ASSERT_TRUE(rank == 3 || rank == 4) << "q of rank " << rank;
    for (const auto kernel : {attend::kernel::reference, attend::kernel::tiled}) {
        const char* kernel_name = kernel == attend::kernel::reference ? "reference" : "tiled";
        SCOPED_TRACE(kernel_name);
        errors e;
        ASSERT_NO_THROW(e = rank == 3 ? run_with_named_mask<3>(c, kernel) : run_with_named_mask<4>(c, kernel));
        std::cout << std::scientific << std::setprecision(2) << "  " << std::left << std::setw(36) << GetParam() << ' '
                  << std::setw(9) << kernel_name << " max abs error: out " << e.out << ", weights " << e.weights
                  << ", lse " << e.lse << std::defaultfloat << '\n';
        RecordProperty(std::string(kernel_name) + "_max_abs_error_out", std::to_string(e.out));
        RecordProperty(std::string(kernel_name) + "_max_abs_error_weights", std::to_string(e.weights));
        RecordProperty(std::string(kernel_name) + "_max_abs_error_lse", std::to_string(e.lse));
        EXPECT_LE(e.out, tolerance) << "out: " << e.out_at;
        EXPECT_LE(e.weights, tolerance) << "weights: " << e.weights_at;
        EXPECT_LE(e.lse, tolerance) << "lse: " << e.lse_at;
    }
}

INSTANTIATE_TEST_SUITE_P(SdpaJson, GoldenSdpa, ::testing::ValuesIn(case_names()),
                         [](const ::testing::TestParamInfo<std::string>& param_info) { return param_info.param; });

// The file must cover what the test promises to check: every mask convention, both ranks, GQA and MQA, L != S.
TEST(GoldenSdpaFile, CoversEveryMaskKindBothRanksAndGroupedQueries) {
    std::set<std::string> kinds;
    bool rank3 = false, gqa = false, mqa = false, rectangular = false;
    for (const json& c : attend_test::member(sdpa_doc(), "cases")) {
        kinds.insert(c.at("mask").at("kind").get<std::string>());
        const auto qs = attend_test::shape_of(c.at("q")), ks = attend_test::shape_of(c.at("k"));
        if (qs.size() == 3) rank3 = true;
        if (qs.size() == 4 && ks[1] != qs[1]) (ks[1] == 1 ? mqa : gqa) = true;
        if (qs[qs.size() - 2] != ks[ks.size() - 2]) rectangular = true;
    }
    for (const char* kind : {"none", "sdpa_bool", "mha_bool", "additive", "causal_top_left", "causal_bottom_right"})
        EXPECT_EQ(kinds.count(kind), 1u) << "no case of mask kind " << kind;
    EXPECT_TRUE(rank3);
    EXPECT_TRUE(gqa);
    EXPECT_TRUE(mqa);
    EXPECT_TRUE(rectangular);
}

// The conventions matter: reading an mha_bool case's tensor in the SDPA convention (the seeds' trap) must not
// reproduce the golden output. This makes sure the cases above could tell the two constructors apart.
TEST(GoldenSdpaFile, ReadingAnMhaMaskInTheSdpaConventionDoesNotMatch) {
    int checked = 0;
    for (const json& c : attend_test::member(sdpa_doc(), "cases")) {
        if (c.at("mask").at("kind") != "mha_bool" || attend_test::shape_of(c.at("q")).size() != 4) continue;
        const json& t = c.at("mask").at("tensor");
        attend::sdpa_options o;
        o.empty_rows = attend::empty_rows::zero;  // the inverted mask may leave rows empty
        o.scale = attend_test::to_optional_number(c.at("scale"));
        const auto q = attend_test::tensor_at<double, 4>(c, "q"), k = attend_test::tensor_at<double, 4>(c, "k"),
                   v = attend_test::tensor_at<double, 4>(c, "v");
        const auto want = attend_test::tensor_at<double, 4>(c, "out");
        const auto run = [&](const auto& mask) {
            return max_abs_diff(attend::scaled_dot_product_attention(q, k, v, mask, o).out, want);
        };
        double wrong = 0;
        switch (attend_test::shape_of(t).size()) {
            case 2: wrong = run(attend::allowed_mask::query_key_grid(attend_test::to_tensor<bool, 2>(t))); break;
            case 4: wrong = run(attend::allowed_mask::from_torch_sdpa(attend_test::to_tensor<bool, 4>(t))); break;
            default: continue;
        }
        EXPECT_GT(wrong, 1e-3) << c.at("name").get<std::string>();
        ++checked;
    }
    EXPECT_GT(checked, 0);
}

}  // namespace
