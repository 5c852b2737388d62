// SPDX-License-Identifier: MIT
// Fuzz target: serving sessions over a paged KV cache, every decision drawn from the input. Sequences join,
// leave, fork, roll back, reorder, and ragged batches append and attend (tests/support/paged_model.hpp); after
// every operation the cache must equal a model that keeps each sequence in a plain kv_cache of its own, the
// pool's bookkeeping must hold, a refused operation must be the right typed error and change nothing, and
// attention over the batch must equal, bit for bit, attention over each sequence alone. Caches of float, double,
// fp16 and bf16 (queries of the same type), and int8 and int4 pools under float queries (against a
// quantized_kv_cache each).
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <type_traits>

#include "fuzz_check.hpp"
#include "fuzz_input.hpp"
#include "support/paged_model.hpp"

namespace attend_fuzz {
namespace {

struct input_choice {
    fuzz_input* in;
    index_t operator()(index_t lo, index_t hi) const { return in->in_range(lo, hi); }
};

struct abort_failure {
    void operator()(const std::string& what) const { fail(what); }
};

template <class T, class Stored = T>
void run_session(fuzz_input& in) {
    using session_type = attend_test::paged_session<T, input_choice, abort_failure, Stored>;
    constexpr bool quantized = attend::detail::is_quantized_block_v<Stored>;
    typename session_type::sizes z;
    static constexpr index_t head_layouts[][2] = {{1, 1}, {2, 1}, {4, 2}, {3, 3}};
    const auto& heads = head_layouts[in.choose(4)];
    z.heads = heads[0];
    z.kv_heads = heads[1];
    z.head_dim = quantized ? 32 * in.in_range(1, 2) : in.in_range(1, 8);  // a quantized row is whole blocks of 32
    z.block_size = in.in_range(1, 9);
    z.blocks = in.in_range(1, 80);
    z.max_sequences = in.in_range(1, 5);
    z.window = in.chance(96) ? in.in_range(1, 40) : 0;
    z.max_new = in.in_range(0, 6);
    z.prefill = in.in_range(0, 60);
    z.history = 400;
    attend::sdpa_options o;
    o.threads = 1 + in.choose(2);
    if (in.chance(64)) o.softcap = 0.5 + static_cast<double>(in.in_range(0, 40)) / 8.0;
    std::ostringstream text;
    const char* type = quantized ? (std::is_same_v<Stored, attend::q8_0_block> ? "int8 (q8_0) pool, float queries"
                                                                               : "int4 (q4_0) pool, float queries")
                       : std::is_same_v<T, float>       ? "float"
                       : std::is_same_v<T, double>      ? "double"
                       : std::is_same_v<T, Eigen::half> ? "fp16"
                                                        : "bf16";
    text << "paged session: " << type << ", heads " << z.heads << "/" << z.kv_heads << ", head_dim " << z.head_dim
         << ", block_size " << z.block_size << ", blocks " << z.blocks << ", max_sequences " << z.max_sequences
         << ", window " << z.window << ", threads " << o.threads;
    case_description() = text.str();
    session_type session(z, o, input_choice{&in}, abort_failure{}, in.word());
    for (int step = 0; step < 64 && !in.exhausted(); ++step) {
        session.step();
        session.check_model();
    }
}

}  // namespace
}  // namespace attend_fuzz

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    attend_fuzz::fuzz_input in(data, size);
    // float and double mostly; fp16 and bf16 (cache and queries) one in eight each, int8 and int4 pools one in
    // sixteen each
    const unsigned kind = in.byte();
    if (kind < 96) attend_fuzz::run_session<float>(in);
    else if (kind < 128) attend_fuzz::run_session<Eigen::half>(in);
    else if (kind < 160) attend_fuzz::run_session<Eigen::bfloat16>(in);
    else if (kind < 224) attend_fuzz::run_session<double>(in);
    else if (kind < 240) attend_fuzz::run_session<float, attend::q8_0_block>(in);
    else attend_fuzz::run_session<float, attend::q4_0_block>(in);
    return 0;
}
