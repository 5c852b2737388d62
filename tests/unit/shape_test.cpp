// SPDX-License-Identifier: MIT
// Tests of shape.hpp: check_shapes accepts every valid layout and names the broken rule, with both shapes,
// for each invalid one.
#include <limits>
#include <string>

#include <gtest/gtest.h>

#include <attend/shape.hpp>

namespace {

using attend::index_t;
using attend::tensor;

TEST(shape, rank_four_inputs_report_every_size) {
    tensor<float, 4> q(2, 8, 5, 16), k(2, 2, 7, 16), v(2, 2, 7, 3);
    const auto s = attend::check_shapes(q, k, v);
    EXPECT_EQ(s.batch, 2);
    EXPECT_EQ(s.heads, 8);
    EXPECT_EQ(s.kv_heads, 2);
    EXPECT_EQ(s.query_len, 5);
    EXPECT_EQ(s.key_len, 7);
    EXPECT_EQ(s.head_dim, 16);
    EXPECT_EQ(s.value_dim, 3);
    EXPECT_EQ(s.rank, 4);
    EXPECT_EQ(s.group_size(), 4);
    EXPECT_EQ(s.kv_head(0), 0);
    EXPECT_EQ(s.kv_head(3), 0);
    EXPECT_EQ(s.kv_head(4), 1);
    EXPECT_EQ(s.kv_head(7), 1);
}

TEST(shape, rank_three_inputs_are_one_head) {
    tensor<double, 3> q(3, 4, 2), k(3, 6, 2), v(3, 6, 5);
    const auto s = attend::check_shapes(q, k, v);
    EXPECT_EQ(s.heads, 1);
    EXPECT_EQ(s.kv_heads, 1);
    EXPECT_EQ(s.rank, 3);
}

TEST(shape, zero_batch_and_zero_query_len_are_valid_empty_problems) {
    tensor<float, 4> q(0, 2, 3, 4), k(0, 2, 5, 4), v(0, 2, 5, 4);
    EXPECT_EQ(attend::check_shapes(q, k, v).batch, 0);
    tensor<float, 4> q2(1, 2, 0, 4), k2(1, 2, 5, 4), v2(1, 2, 5, 4);
    EXPECT_EQ(attend::check_shapes(q2, k2, v2).query_len, 0);
}

TEST(shape, views_over_caller_memory_are_checked_without_copies) {
    float buffer[2 * 3 * 4] = {};
    attend::const_tensor_view<float, 3> q(buffer, 2, 3, 4), k(buffer, 2, 3, 4), v(buffer, 2, 3, 4);
    EXPECT_EQ(attend::check_shapes(q, k, v).key_len, 3);
}

template <class Q, class K, class V>
void expect_shape_error(const Q& q, const K& k, const V& v, const std::string& id,
                        std::initializer_list<std::string> fragments) {
    try {
        (void)attend::check_shapes(q, k, v);
        FAIL() << "expected shape_error " << id;
    } catch (const attend::shape_error& e) {
        EXPECT_EQ(e.id(), id);
        const std::string what = e.what();
        EXPECT_EQ(what, e.message() + " [" + id + "]") << what;
        for (const auto& f : fragments) EXPECT_NE(what.find(f), std::string::npos) << "'" << f << "' not in " << what;
    }
}

TEST(shape_errors, each_rule_has_its_id_and_names_both_shapes) {
    tensor<float, 4> q(2, 8, 128, 64), k(2, 8, 256, 32), v(2, 8, 256, 32);
    expect_shape_error(q, k, v, "attend.shape.key_dim", {"64 != key head_dim 32", "[2,8,128,64]", "[2,8,256,32]"});

    tensor<float, 4> qb(2, 4, 3, 8), kb(3, 4, 5, 8), vb(3, 4, 5, 8);
    expect_shape_error(qb, kb, vb, "attend.shape.batch", {"[2,4,3,8]", "[3,4,5,8]"});

    tensor<float, 4> q1(1, 4, 3, 8), k1(1, 2, 5, 8), v1(1, 4, 5, 8);
    expect_shape_error(q1, k1, v1, "attend.shape.kv_heads", {"[1,2,5,8]", "[1,4,5,8]"});

    tensor<float, 4> v2(1, 2, 6, 8);
    expect_shape_error(q1, k1, v2, "attend.shape.key_len", {"[1,2,5,8]", "[1,2,6,8]"});

    tensor<float, 4> q3(1, 6, 3, 8), k3(1, 4, 5, 8), v3(1, 4, 5, 8);
    expect_shape_error(q3, k3, v3, "attend.shape.gqa", {"heads 6", "kv_heads 4"});

    tensor<float, 4> q4(1, 2, 3, 8), k4(1, 2, 0, 8), v4(1, 2, 0, 8);
    expect_shape_error(q4, k4, v4, "attend.shape.empty_keys", {"[1,2,0,8]"});

    tensor<float, 4> q5(1, 2, 3, 0), k5(1, 2, 4, 0), v5(1, 2, 4, 8);
    expect_shape_error(q5, k5, v5, "attend.shape.empty_head_dim", {"[1,2,3,0]"});

    tensor<float, 4> q6(1, 0, 3, 8), k6(1, 0, 4, 8), v6(1, 0, 4, 8);
    expect_shape_error(q6, k6, v6, "attend.shape.empty_heads", {"[1,0,3,8]"});

    tensor<float, 3> k7(1, 4, 8), v7(1, 4, 8);
    tensor<float, 4> q7(1, 1, 3, 8);
    const auto qv = attend::detail::as_view(q7);
    const auto kv = attend::detail::as_view(k7);
    const auto vv = attend::detail::as_view(v7);
    try {
        (void)attend::detail::check_views(qv, kv, vv);
        FAIL();
    } catch (const attend::shape_error& e) {
        EXPECT_EQ(e.id(), "attend.shape.rank");
        EXPECT_NE(std::string(e.what()).find("[1,4,8]"), std::string::npos);
    }
}

TEST(shape_errors, element_counts_that_overflow_the_index_type_are_rejected_before_any_read) {
    float one = 0;
    const index_t huge = std::numeric_limits<index_t>::max() / 4;
    // Views claiming astronomically many elements over a single float: the check must not touch memory.
    attend::const_tensor_view<float, 4> q(&one, 1, 1, huge, 8), k(&one, 1, 1, 2, 8), v(&one, 1, 1, 2, 8);
    expect_shape_error(q, k, v, "attend.shape.overflow", {"overflow"});
    attend::const_tensor_view<float, 4> q2(&one, 1, 1, huge / 8, 1), k2(&one, 1, 1, huge / 8, 1),
        v2(&one, 1, 1, huge / 8, 1);
    expect_shape_error(q2, k2, v2, "attend.shape.overflow", {"scores"});
}

}  // namespace
