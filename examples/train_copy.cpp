// SPDX-License-Identifier: MIT
// Trains one attention layer to copy a sequence, with attend's forward and backward and a few lines of Adam.
// A sample is 8 digits, a separator, then the digits again: [x0 .. x7, SEP, x0 .. x6], and position 8 + i must
// predict x_i (next-token prediction over the second half). The model is a token embedding, one causal
// self-attention layer with rotary positions (attend::multi_head_attention) and an output projection to the
// vocabulary. Every answer sits exactly 8 positions back, so the layer has to learn a relative-position lookup,
// which rotary embeddings make expressible and the causal mask leaves possible (the key is in the past).
// Trains on a fixed pool of sequences for a fixed seed, prints the loss curve, and measures the accuracy on
// held-out sequences that are not in the pool. Exits non-zero unless the final loss is below 0.05 (the initial
// loss is ln 11 ~ 2.4) and the held-out token accuracy is at least 95 %.
// `train_copy --steps N` (N < 400) runs the same code for N steps and only asks that the loss fell: what the
// sanitizer build runs, where every step costs a hundred times more and the question is memory, not learning.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <vector>

#include <attend/mha.hpp>
#include <attend/mha_backward.hpp>

namespace {

using attend::index_t;
using attend::tensor;

constexpr index_t digits = 8;  // length of the sequence to copy
constexpr index_t vocab = 11;  // 0-9 and the separator
constexpr index_t separator = 10;
constexpr index_t len = 2 * digits;           // the model sees [x0 .. x7, SEP, x0 .. x6]
constexpr index_t model_dim = 32, heads = 4;  // head_dim 8
constexpr index_t batch = 32, full_steps = 400;
constexpr float final_loss_limit = 0.05f, accuracy_limit = 0.95f;

/// splitmix64: the same numbers on every platform.
struct rng {
    std::uint64_t state;
    std::uint64_t next() {
        std::uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
        return z ^ (z >> 31);
    }
    float uniform(float lo, float hi) {
        return lo + (hi - lo) * static_cast<float>(static_cast<double>(next() >> 11) * 0x1.0p-53);
    }
};

using sequence = std::vector<index_t>;  // the `digits` digits to copy

sequence random_sequence(rng& r) {
    sequence s(digits);
    for (auto& d : s) d = static_cast<index_t>(r.next() % 10);
    return s;
}

/// Model input token at position i of a sample, and the target of position i >= digits.
index_t input_token(const sequence& s, index_t i) {
    if (i < digits) return s[static_cast<std::size_t>(i)];
    return i == digits ? separator : s[static_cast<std::size_t>(i - digits - 1)];
}
index_t target_token(const sequence& s, index_t i) { return s[static_cast<std::size_t>(i - digits)]; }

/// Embedding, attention layer and readout, with their gradients in the same layout.
struct model {
    tensor<float, 2> embedding{vocab, model_dim};  // [vocab, model_dim]
    attend::multi_head_attention<float> attention{attend::mha_config{model_dim, heads}, 7};
    tensor<float, 2> readout{vocab, model_dim};  // [vocab, model_dim]
    tensor<float, 1> readout_bias{vocab};

    explicit model(rng& r) {
        for (index_t n = 0; n < embedding.size(); ++n) embedding.data()[n] = r.uniform(-1, 1);
        const float bound = 1.0f / std::sqrt(static_cast<float>(model_dim));
        for (index_t n = 0; n < readout.size(); ++n) readout.data()[n] = r.uniform(-bound, bound);
        readout_bias.setZero();
    }
};

attend::mha_options layer_options() {
    attend::mha_options o;
    o.rotary = attend::rotary_embedding{model_dim / heads};
    o.attention.threads = 1;
    return o;
}

/// Logits `[batch, len, vocab]` of the readout at every position (only positions >= digits are used).
struct forward_pass {
    tensor<float, 3> x;  // embedded inputs [batch, len, model_dim]
    attend::mha_saved<float> saved;
    attend::mha_result<float> layer;
    tensor<float, 3> logits;
};

forward_pass run_forward(const model& m, const std::vector<sequence>& samples) {
    const auto b_count = static_cast<index_t>(samples.size());
    forward_pass f;
    f.x = tensor<float, 3>(b_count, len, model_dim);
    for (index_t b = 0; b < b_count; ++b)
        for (index_t i = 0; i < len; ++i)
            for (index_t e = 0; e < model_dim; ++e)
                f.x(b, i, e) = m.embedding(input_token(samples[static_cast<std::size_t>(b)], i), e);
    f.layer = m.attention.forward(f.x, f.x, f.x, attend::causal(attend::alignment::top_left), layer_options(), f.saved);
    f.logits = tensor<float, 3>(b_count, len, vocab);
    for (index_t b = 0; b < b_count; ++b)
        for (index_t i = 0; i < len; ++i)
            for (index_t t = 0; t < vocab; ++t) {
                float z = m.readout_bias(t);
                for (index_t e = 0; e < model_dim; ++e) z += f.layer.out(b, i, e) * m.readout(t, e);
                f.logits(b, i, t) = z;
            }
    return f;
}

/// Softmax of one logits row, in place over `p`.
void softmax_row(const tensor<float, 3>& logits, index_t b, index_t i, std::vector<float>& p) {
    float max = logits(b, i, 0), sum = 0;
    for (index_t t = 1; t < vocab; ++t) max = std::max(max, logits(b, i, t));
    for (index_t t = 0; t < vocab; ++t) sum += (p[static_cast<std::size_t>(t)] = std::exp(logits(b, i, t) - max));
    for (auto& x : p) x /= sum;
}

/// Adam (Kingma & Ba) over flat parameter spans: m, v moments per element, bias-corrected.
struct adam {
    float lr = 3e-3f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;
    std::vector<std::vector<float>> m, v;
    int t = 0;

    void step(const std::vector<attend::parameter_span<float>>& params,
              const std::vector<attend::parameter_span<const float>>& grads) {
        if (m.empty())
            for (const auto& p : params) {
                m.emplace_back(static_cast<std::size_t>(p.size), 0.0f);
                v.emplace_back(static_cast<std::size_t>(p.size), 0.0f);
            }
        ++t;
        const float c1 = 1 - std::pow(beta1, static_cast<float>(t)), c2 = 1 - std::pow(beta2, static_cast<float>(t));
        for (std::size_t k = 0; k < params.size(); ++k)
            for (index_t n = 0; n < params[k].size; ++n) {
                const float g = grads[k].data[n];
                float& mk = m[k][static_cast<std::size_t>(n)];
                float& vk = v[k][static_cast<std::size_t>(n)];
                mk = beta1 * mk + (1 - beta1) * g;
                vk = beta2 * vk + (1 - beta2) * g * g;
                params[k].data[n] -= lr * (mk / c1) / (std::sqrt(vk / c2) + eps);
            }
    }
};

/// One training step on `samples`: mean cross-entropy over the copied positions, gradients, Adam. Returns the loss.
float train_step(model& m, adam& opt, const std::vector<sequence>& samples) {
    const auto f = run_forward(m, samples);
    const auto b_count = static_cast<index_t>(samples.size());
    const float per_target = 1.0f / static_cast<float>(b_count * digits);
    // d loss / d logits = (softmax - one_hot) / targets, then back through the readout.
    tensor<float, 2> d_readout(vocab, model_dim);
    tensor<float, 1> d_readout_bias(vocab);
    tensor<float, 3> d_layer(b_count, len, model_dim);
    d_readout.setZero();
    d_readout_bias.setZero();
    d_layer.setZero();
    std::vector<float> p(vocab);
    float loss = 0;
    for (index_t b = 0; b < b_count; ++b)
        for (index_t i = digits; i < len; ++i) {
            softmax_row(f.logits, b, i, p);
            const index_t target = target_token(samples[static_cast<std::size_t>(b)], i);
            loss -= std::log(p[static_cast<std::size_t>(target)]) * per_target;
            for (index_t t = 0; t < vocab; ++t) {
                const float dz = (p[static_cast<std::size_t>(t)] - (t == target ? 1.0f : 0.0f)) * per_target;
                d_readout_bias(t) += dz;
                for (index_t e = 0; e < model_dim; ++e) {
                    d_readout(t, e) += dz * f.layer.out(b, i, e);
                    d_layer(b, i, e) += dz * m.readout(t, e);
                }
            }
        }
    const auto g = attend::multi_head_attention_backward(
        m.attention, f.x, f.x, f.x, attend::causal(attend::alignment::top_left), f.saved, d_layer, layer_options());
    // Self-attention f(x, x, x): the input's gradient is the sum of the three; scattered into the embedding rows.
    tensor<float, 2> d_embedding(vocab, model_dim);
    d_embedding.setZero();
    for (index_t b = 0; b < b_count; ++b)
        for (index_t i = 0; i < len; ++i)
            for (index_t e = 0; e < model_dim; ++e)
                d_embedding(input_token(samples[static_cast<std::size_t>(b)], i), e) +=
                    g.d_query(b, i, e) + g.d_key(b, i, e) + g.d_value(b, i, e);

    auto params = m.attention.parameters();
    auto grads = g.parameters();
    params.push_back({"embedding", m.embedding.data(), m.embedding.size()});
    grads.push_back({"embedding", d_embedding.data(), d_embedding.size()});
    params.push_back({"readout", m.readout.data(), m.readout.size()});
    grads.push_back({"readout", d_readout.data(), d_readout.size()});
    params.push_back({"readout_bias", m.readout_bias.data(), m.readout_bias.size()});
    grads.push_back({"readout_bias", d_readout_bias.data(), d_readout_bias.size()});
    opt.step(params, grads);
    return loss;
}

/// Fraction of copied tokens predicted right (argmax) over `samples`.
float accuracy(const model& m, const std::vector<sequence>& samples) {
    const auto f = run_forward(m, samples);
    index_t right = 0;
    for (index_t b = 0; b < static_cast<index_t>(samples.size()); ++b)
        for (index_t i = digits; i < len; ++i) {
            index_t best = 0;
            for (index_t t = 1; t < vocab; ++t)
                if (f.logits(b, i, t) > f.logits(b, i, best)) best = t;
            right += best == target_token(samples[static_cast<std::size_t>(b)], i);
        }
    return static_cast<float>(right) / static_cast<float>(static_cast<index_t>(samples.size()) * digits);
}

}  // namespace

int main(int argc, char** argv) {
    attend::index_t steps = full_steps;
    if (argc == 3 && std::strcmp(argv[1], "--steps") == 0) steps = std::atoll(argv[2]);
    if (argc != 1 && !(argc == 3 && steps >= 1 && steps <= full_steps)) {
        std::fprintf(stderr, "usage: train_copy [--steps N], 1 <= N <= %lld\n", static_cast<long long>(full_steps));
        return 2;
    }
    rng r{2026};
    model m(r);
    adam opt;
    // A fixed training pool, and held-out sequences that are not in it.
    std::vector<sequence> pool(4096);
    for (auto& s : pool) s = random_sequence(r);
    const std::set<sequence> seen(pool.begin(), pool.end());
    std::vector<sequence> held_out;
    while (held_out.size() < 512) {
        auto s = random_sequence(r);
        if (!seen.count(s)) held_out.push_back(std::move(s));
    }

    std::printf("step  loss\n");
    float loss = 0, first_loss = 0;
    std::vector<sequence> samples(batch);
    for (attend::index_t step = 1; step <= steps; ++step) {
        for (auto& s : samples) s = pool[static_cast<std::size_t>(r.next() % pool.size())];
        loss = train_step(m, opt, samples);
        if (step == 1) first_loss = loss;
        if (step == 1 || step % 25 == 0)
            std::printf("%4lld  %.4f\n", static_cast<long long>(step), static_cast<double>(loss));
    }
    if (steps < full_steps) {  // a short run: the loss must have fallen, nothing more
        std::printf("%lld steps: loss %.4f from %.4f\n", static_cast<long long>(steps), static_cast<double>(loss),
                    static_cast<double>(first_loss));
        return loss < first_loss ? 0 : 1;
    }
    const float held_out_accuracy = accuracy(m, held_out);
    std::printf("final loss %.4f (limit %.2f), held-out token accuracy %.2f %% (limit %.0f %%) on %zu sequences\n",
                static_cast<double>(loss), static_cast<double>(final_loss_limit),
                100.0 * static_cast<double>(held_out_accuracy), 100.0 * static_cast<double>(accuracy_limit),
                held_out.size());
    const bool ok = loss < final_loss_limit && held_out_accuracy >= accuracy_limit;
    std::printf("%s\n", ok ? "converged" : "did NOT converge");
    return ok ? 0 : 1;
}
