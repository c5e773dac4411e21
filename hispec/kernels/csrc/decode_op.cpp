// A range of decoder layers in one call (hispec/kernels/layer_op.py, ``decode_layers``), and whole
// decode steps.
//
// The fused Python path (DecoderLayer's per-layer fused forward) makes ~10 calls per layer: four
// matmuls through the PyTorch dispatcher and six kernels through ctypes, each with its argument
// checks and tensor allocations; on a 135M-parameter model that Python work costs as much as the
// matmuls themselves at batch 1. This op runs the same sequence of calls from C++: the same ATen
// matmul kernels with the same inputs, and the very same compiled kernels (hispec_kernels.h,
// linked to the library ctypes loaded: one copy in the process), so its results are bit for bit
// those of the Python path.
//
// Built on first use with the machine's C++ compiler against the installed torch's headers,
// cached beside the C library (hispec/kernels/build.py), loaded with torch.ops.load_library.
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>
#if __has_include(<ATen/ops/_weight_int4pack_mm_for_cpu_native.h>) && __has_include(<ATen/ops/_weight_int8pack_mm_native.h>)
#include <ATen/ops/_weight_int4pack_mm_for_cpu_native.h>
#include <ATen/ops/_weight_int8pack_mm_native.h>
// PyTorch's CPU int4 / int8 kernels called as its dispatcher would call them for CPU tensors
// (the same function, so the same bits), without the dispatch: ~1-2 us per call, 120 calls a token
#define INT4_MM at::native::_weight_int4pack_mm_cpu
#define INT8_MM at::native::_weight_int8pack_mm_cpu
#else
#define INT4_MM at::_weight_int4pack_mm_for_cpu
#define INT8_MM at::_weight_int8pack_mm
#endif

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "hispec_kernels.h"

namespace {

int is_bf(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16 ? 1 : 0; }

// The output buffer ``out`` of hispec's own kernels, reused across layers: [T, N] float32, (re)made
// when missing or of another size.
at::Tensor& output(at::Tensor& out, const at::Tensor& x, int64_t n) {
    if (!out.defined() || out.size(0) != x.size(0) || out.size(1) != n) out = at::empty({x.size(0), n}, x.options());
    return out;
}

// x [T, K] -> [T, N]; hispec's kernels write into ``out`` (see output), ATen's return a new tensor.
at::Tensor run_matmul(int64_t kind, const at::Tensor& x, const at::Tensor& w, const at::Tensor& p, int64_t group,
                  at::Tensor& out) {
    if (kind == HS_MM_INT4) return INT4_MM(x, w, group, p);
    if (kind == HS_MM_INT8) return INT8_MM(x, w, p);
    if (kind == HS_MM_DENSE || kind == HS_MM_FLOAT_LINEAR) return at::linear(x, w);
    if (kind == HS_MM_DENSE_BF16) return at::linear(x.to(at::kBFloat16), w);
    if (kind == HS_MM_PANEL) {  // x is contiguous: every input here is a buffer this op wrote
        at::Tensor& y = output(out, x, group);
        hs_panel_matmul(x.data_ptr<float>(), x.size(0), x.size(1), w.data_ptr<float>(), group, y.data_ptr<float>(), 1);
        return y;
    }
    if (kind == HS_MM_Q4 || kind == HS_MM_Q4_PANELS) {
        // p [2, N, K / 32] float32: d, then m
        at::Tensor& y = output(out, x, w.size(0));
        TORCH_CHECK(p.is_contiguous() && p.size(0) == 2, "q4 parameters: contiguous [2, N, K / 32]");
        const float* d = p.data_ptr<float>();
        (kind == HS_MM_Q4 ? hs_q4_matmul : hs_q4_panel_matmul)(w.data_ptr<uint8_t>(), d, d + p.size(1) * p.size(2),
                                                               x.data_ptr<float>(), x.size(0), w.size(0), x.size(1),
                                                               y.data_ptr<float>(), 1);
        return y;
    }
    if (kind == HS_MM_Q8A4 || kind == HS_MM_Q8A4_PANELS) {
        // p [2, N, K / 32] float16, tiled: d, then m
        at::Tensor& y = output(out, x, w.size(0));
        TORCH_CHECK(p.is_contiguous() && p.size(0) == 2 && p.scalar_type() == at::kHalf,
                    "q8a parameters: contiguous float16 [2, N, K / 32]");
        const auto* d = reinterpret_cast<const uint16_t*>(p.data_ptr<at::Half>());
        (kind == HS_MM_Q8A4 ? hs_q8a_q4_matmul : hs_q8a_q4_panel_matmul)(
            w.data_ptr<uint8_t>(), d, d + p.size(1) * p.size(2), x.data_ptr<float>(), x.size(0), w.size(0), x.size(1),
            y.data_ptr<float>(), 1);
        return y;
    }
    if (kind == HS_MM_Q8) {
        at::Tensor& y = output(out, x, w.size(0));
        hs_q8_group_matmul(w.data_ptr<int8_t>(), p.data_ptr<float>(), group == 16 ? 16 : 32, x.data_ptr(), is_bf(x),
                           x.size(0), w.size(0), x.size(1), y.data_ptr<float>(), 1);  // group 16: a scale per 16 (Q6_K)
        return y;
    }
    if (kind == HS_MM_Q8A8) {  // p [N, K / 32] float16, tiled
        at::Tensor& y = output(out, x, w.size(0));
        TORCH_CHECK(p.scalar_type() == at::kHalf, "q8a8 scales: float16");
        hs_q8a_q8_group_matmul(w.data_ptr<int8_t>(), reinterpret_cast<const uint16_t*>(p.data_ptr<at::Half>()),
                               group == 16 ? 16 : 32, x.data_ptr(), is_bf(x), x.size(0), w.size(0), x.size(1),
                               y.data_ptr<float>(), 1);
        return y;
    }
    if (kind == HS_MM_Q8A4_TILES || kind == HS_MM_Q8A8_TILES) {  // prompt chunks on bfloat16 tiles
        at::Tensor& y = output(out, x, w.size(0));
        const bool four = kind == HS_MM_Q8A4_TILES;
        TORCH_CHECK(p.is_contiguous() && p.scalar_type() == at::kHalf && x.scalar_type() == at::kFloat,
                    "bfloat16 tiles: float32 rows and contiguous float16 scales");
        const auto* d = reinterpret_cast<const uint16_t*>(p.data_ptr<at::Half>());
        const int64_t K = x.size(1);
        const int fmt = four ? HS_Q8A_Q4 : (group == 16 ? HS_Q8A_Q8G16 : HS_Q8A_Q8);
        TORCH_CHECK(hs_bf16_tiles_matmul(fmt, static_cast<const uint8_t*>(w.data_ptr()), d,
                                         four ? d + p.size(1) * p.size(2) : nullptr, x.data_ptr<float>(), x.size(0),
                                         w.size(0), K, y.data_ptr<float>(), 1),
                    "bfloat16 tiles: no AMX-BF16 here, or out of memory");
        return y;
    }
    const int64_t t = x.size(0);
    const at::Tensor rows = t == 1 ? at::cat({x, x}) : x;  // [max(T, 2), K]
    return at::mm(w, rows.t()).t().slice(0, 0, t).contiguous();
}

// Where the op's time goes, summed per part while profiling is on (scripts/profile-decode.py): the
// wall time of each call, measured where it runs, so that a decode step splits into its matmuls,
// its other kernels and what is outside the op (the engine's Python, sampling). The order is
// layer_op.py's PROFILE_PARTS.
enum Part { MATMUL, ATTENTION, ROPE_CACHE, NORM, SILU_MUL, RESIDUAL, SETUP, PARTS };
bool profiling = false;
double part_seconds[PARTS] = {};
int64_t part_calls[PARTS] = {};

// Times its scope into ``part`` while profiling is on: ``{ Timed t(NORM); hs_rms_norm(...); }``.
struct Timed {
    Part part;
    std::chrono::steady_clock::time_point t0;
    explicit Timed(Part p) : part(p) {
        if (profiling) t0 = std::chrono::steady_clock::now();
    }
    ~Timed() {
        if (!profiling) return;
        part_seconds[part] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        part_calls[part]++;
    }
};

at::Tensor matmul(int64_t kind, const at::Tensor& x, const at::Tensor& w, const at::Tensor& p, int64_t group,
                  at::Tensor& out) {
    Timed t(MATMUL);
    return run_matmul(kind, x, w, p, group, out);
}

// Turns the timing on or off; returns each part's (seconds, calls) summed since the last call, and restarts.
std::tuple<std::vector<double>, std::vector<int64_t>> profile(bool on) {
    auto summed = std::make_tuple(std::vector<double>(part_seconds, part_seconds + PARTS),
                                  std::vector<int64_t>(part_calls, part_calls + PARTS));
    profiling = on;
    std::fill(part_seconds, part_seconds + PARTS, 0.0);
    std::fill(part_calls, part_calls + PARTS, 0);
    return summed;
}

// A range of layers as the op runs it: their plans, flattened (plan.py's layer_plan;
// layer_op.LayerPlans), and their cache layers in one KV pool. Made once per range and pool and held
// between calls, so that a decoding step hands over one object instead of ~360 tensors (their
// conversion cost ~0.2-0.3 ms per call on a Zen 3). Per layer l (index i): k_pools[i], v_pools[i]: its cache
// (float32 or bfloat16);
// norms[NORMS i + k]: its RMSNorm weights, k = 0 input, 1 post-attention, 2 and 3 the query and key heads'
// (QK-norm: Qwen3, Gemma 3), 4 and 5 the attention's and the MLP's outputs' (sandwich norms: Gemma 3); an
// empty tensor where the layer has not got one; weights[8i + 2j], [8i + 2j + 1]: matmul j's weight and
// its parameters (qkv, o, gate_up, down), kinds[4i + j], groups[4i + j]; flags[FLAGS i + k]: k = 0 its
// attention's sliding window (0: none), 1 whether it rotates by the local RoPE rows (cos_local, ssin_local),
// 2 its gated activation (ACT_SILU, ACT_GELU_TANH). A model family is data here, not another loop.
// attn_scale: the attention logits' scale (0: 1 / sqrt(head_dim)).
constexpr size_t NORMS = 6, FLAGS = 3;
enum Act { ACT_SILU = 0, ACT_GELU_TANH = 1 };

struct Range : torch::CustomClassHolder {
    std::vector<at::Tensor> k_pools, v_pools, norms, weights;
    std::vector<int64_t> kinds, groups, flags;
    int64_t num_heads, num_kv_heads;
    double eps, attn_scale;
    bool bf16_acts;

    Range(std::vector<at::Tensor> k_pools_, std::vector<at::Tensor> v_pools_, std::vector<at::Tensor> norms_,
          std::vector<at::Tensor> weights_, std::vector<int64_t> kinds_, std::vector<int64_t> groups_,
          std::vector<int64_t> flags_, int64_t num_heads_, int64_t num_kv_heads_, double eps_, double attn_scale_,
          bool bf16_acts_)
        : k_pools(std::move(k_pools_)), v_pools(std::move(v_pools_)), norms(std::move(norms_)),
          weights(std::move(weights_)), kinds(std::move(kinds_)), groups(std::move(groups_)), flags(std::move(flags_)),
          num_heads(num_heads_), num_kv_heads(num_kv_heads_), eps(eps_), attn_scale(attn_scale_),
          bf16_acts(bf16_acts_) {
        const size_t n = norms.size() / NORMS;
        TORCH_CHECK(k_pools.size() == n && v_pools.size() == n && norms.size() == NORMS * n &&
                    weights.size() == 8 * n && kinds.size() == 4 * n && groups.size() == 4 * n &&
                    flags.size() == FLAGS * n, "Range: list lengths");
        for (size_t i = 0; i < n; i++) {
            TORCH_CHECK((k_pools[i].scalar_type() == at::kFloat || k_pools[i].scalar_type() == at::kBFloat16) &&
                        v_pools[i].scalar_type() == k_pools[i].scalar_type() && k_pools[i].is_contiguous() &&
                        v_pools[i].is_contiguous(), "Range: contiguous float32 or bfloat16 cache layers");
            const int64_t D = k_pools[i].size(-1), H[NORMS] = {-1, -1, D, D, -1, -1};
            for (size_t k = 0; k < NORMS; k++) {
                const at::Tensor& w = norms[NORMS * i + k];
                TORCH_CHECK(w.numel() == 0 ? k >= 2 : w.scalar_type() == at::kFloat && w.is_contiguous() &&
                                                          (H[k] < 0 || w.numel() == H[k]),
                            "Range: contiguous float32 norm weights (QK-norm: [head_dim])");
            }
            TORCH_CHECK(flags[FLAGS * i] >= 0 && (flags[FLAGS * i + 2] == ACT_SILU || flags[FLAGS * i + 2] == ACT_GELU_TANH),
                        "Range: a window >= 0 and a known activation");
        }
    }

    int64_t layers() const { return static_cast<int64_t>(norms.size() / NORMS); }

    // layer i's norm k, or nullptr where it has none
    const float* norm(int64_t i, size_t k) const {
        const at::Tensor& w = norms[NORMS * i + k];
        return w.numel() ? w.data_ptr<float>() : nullptr;
    }
};

// h [T, H] float32 entering the range's first layer -> after its last.
// cos, ssin [T, D]: the RoPE rows of the tokens' positions; cos_local, ssin_local: those of the layers
// that rotate by the local base (flags), the same tensors where the model has no other base.
// prompt: the tokens are a prompt's (their attention may take the prompt path: hs_attention_amx).
at::Tensor decode_layers(const at::Tensor& h_in, const at::Tensor& cos, const at::Tensor& ssin,
                         const at::Tensor& cos_local, const at::Tensor& ssin_local,
                         const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& seq,
                         const at::Tensor& lengths, const std::optional<at::Tensor>& tail_start,
                         const std::optional<at::Tensor>& tail, int64_t block_size, bool parallel,
                         const c10::intrusive_ptr<Range>& range, bool prompt) {
    const int64_t n = range->layers();
    const auto& weights = range->weights;
    const auto& kinds = range->kinds;
    const auto& groups = range->groups;
    const auto& k_pools = range->k_pools;
    const auto& v_pools = range->v_pools;
    const int64_t num_heads = range->num_heads, num_kv_heads = range->num_kv_heads;
    TORCH_CHECK(h_in.scalar_type() == at::kFloat && h_in.is_contiguous() && h_in.dim() == 2, "h: contiguous [T, H] float32");
    if (n == 0) return h_in;  // (the sizes below come from the first layer's cache)
    const int64_t T = h_in.size(0), H = h_in.size(1), D = k_pools[0].size(-1);
    const auto act = range->bf16_acts ? at::kBFloat16 : at::kFloat;
    const int out_bf = range->bf16_acts ? 1 : 0;
    const auto fopt = h_in.options();
    const auto aopt = fopt.dtype(act);
    TORCH_CHECK(cos_local.sizes() == cos.sizes() && ssin_local.sizes() == cos.sizes() && cos_local.is_contiguous() &&
                ssin_local.is_contiguous() && cos_local.scalar_type() == at::kFloat &&
                ssin_local.scalar_type() == at::kFloat, "decode_layers: local RoPE rows as cos, ssin");
    const float e = static_cast<float>(range->eps);
    const float scale = range->attn_scale > 0 ? static_cast<float>(range->attn_scale)
                                              : 1.0f / std::sqrt(static_cast<float>(D));
    // buffers written in full by each layer, made once per call (h ping-pongs between two: a
    // layer reads the previous h while it writes the next)
    at::Tensor x = at::empty({T, H}, aopt), x2 = at::empty({T, H}, aopt);
    at::Tensor q = at::empty({T, num_heads, D}, fopt), att = at::empty({T, num_heads * D}, aopt);
    at::Tensor hs[2] = {at::empty({T, H}, fopt), at::empty({T, H}, fopt)};
    at::Tensor outs[4], a;  // the four matmuls' outputs (hispec's kernels), the gated activation
    const float* h = h_in.data_ptr<float>();
    for (int64_t i = 0; i < n; i++) {
        const at::Tensor& kp = k_pools[i];
        const at::Tensor& vp = v_pools[i];
        const int64_t* flag = range->flags.data() + FLAGS * i;  // window, local RoPE, activation
        const at::Tensor& c = flag[1] ? cos_local : cos;
        const at::Tensor& sn = flag[1] ? ssin_local : ssin;
        auto mm = [&](int64_t j, const at::Tensor& in) {
            return matmul(kinds[4 * i + j], in, weights[8 * i + 2 * j], weights[8 * i + 2 * j + 1], groups[4 * i + j],
                          outs[j]);
        };
        {
            Timed t(NORM);
            hs_rms_norm(h, range->norm(i, 0), T, H, e, x.data_ptr(), out_bf);
        }
        const at::Tensor qkv = mm(0, x).contiguous();  // [T, (Hq + 2 Hkv) D]
        {
            Timed t(ROPE_CACHE);
            hs_rope_write_qk(qkv.data_ptr(), is_bf(qkv), c.data_ptr<float>(), sn.data_ptr<float>(),
                             slots.data_ptr<int64_t>(), T, num_heads, num_kv_heads, D, kp.size(1), kp.data_ptr(),
                             vp.data_ptr(), is_bf(kp), q.data_ptr<float>(), range->norm(i, 2), range->norm(i, 3), e);
        }
        {
            Timed t(ATTENTION);
            hs_paged_attention_window(q.data_ptr<float>(), kp.data_ptr(), vp.data_ptr(), is_bf(kp),
                                      tables.data_ptr<int32_t>(), tables.size(1), seq.data_ptr<int32_t>(),
                                      lengths.data_ptr<int32_t>(), tail ? tail_start->data_ptr<int32_t>() : nullptr,
                                      tail ? tail->data_ptr<int64_t>() : nullptr, tail ? tail->size(1) : 0, T,
                                      num_heads, kp.size(0), kp.size(1), D, block_size, scale, att.data_ptr(), out_bf,
                                      parallel ? 1 : 0, flag[0], prompt ? 1 : 0);
        }
        const at::Tensor o = mm(1, att).contiguous();  // [T, H]
        float* h2 = hs[i % 2].data_ptr<float>();
        {
            Timed t(NORM);
            if (const float* on = range->norm(i, 4))  // h2 = h + norm(o)
                hs_norm_add_rms_norm(h, o.data_ptr(), is_bf(o), on, range->norm(i, 1), T, H, e, h2, x2.data_ptr(), out_bf);
            else
                hs_add_rms_norm(h, o.data_ptr(), is_bf(o), range->norm(i, 1), T, H, e, h2, x2.data_ptr(), out_bf);
        }
        const at::Tensor gu = mm(2, x2).contiguous();  // [T, 2 I]
        const int64_t I = gu.size(1) / 2;
        if (!a.defined() || a.size(1) != I) a = at::empty({T, I}, aopt);
        {
            Timed t(SILU_MUL);
            (flag[2] == ACT_GELU_TANH ? hs_gelu_tanh_mul : hs_silu_mul)(gu.data_ptr(), is_bf(gu), T, I, a.data_ptr(),
                                                                        out_bf);
        }
        const at::Tensor down = mm(3, a).contiguous();  // [T, H]
        {
            Timed t(RESIDUAL);
            if (const float* mn = range->norm(i, 5))  // h2 += norm(down(a))
                hs_norm_add_into(h2, down.data_ptr(), is_bf(down), mn, T, H, e);
            else
                hs_add_into(h2, down.data_ptr(), is_bf(down), T, H);  // h2 += down(a)
        }
        h = h2;
    }
    return hs[(n - 1) % 2];
}

// What a decoding step needs besides the layers: the token embeddings, the final RMSNorm and the
// output head (one matmul of the kinds above), held like a Range.
// The embeddings: a float32 table [V, H] (embed_type HS_GGML_F32), or a GGUF tensor's rows in the
// file's blocks, uint8 [V, row bytes] of embed_type (model/load/gguf_embedding.py), each row read
// with hs_dequant_rows as the model's own lookup reads it.
// embed_scale: the embeddings' factor (Gemma: sqrt(hidden)), each element times it rounded to float32 as
// DecoderModel.embed multiplies (1: none).
struct Head : torch::CustomClassHolder {
    at::Tensor embed, norm, weight, params;  // [V, H] float32 or [V, row bytes] uint8, [H] float32, the head's weight and parameters
    int64_t embed_type, kind, group;
    double eps, embed_scale;

    Head(at::Tensor embed_, int64_t embed_type_, at::Tensor norm_, at::Tensor weight_, at::Tensor params_,
         int64_t kind_, int64_t group_, double eps_, double embed_scale_)
        : embed(std::move(embed_)), norm(std::move(norm_)), weight(std::move(weight_)), params(std::move(params_)),
          embed_type(embed_type_), kind(kind_), group(group_), eps(eps_), embed_scale(embed_scale_) {
        TORCH_CHECK(norm.scalar_type() == at::kFloat && norm.is_contiguous() && embed.is_contiguous() && embed.dim() == 2,
                    "Head: contiguous embeddings [V, *] and float32 norm [H]");
        const bool table = embed.scalar_type() == at::kFloat && embed_type == HS_GGML_F32 && embed.size(1) == norm.numel();
        const bool rows = embed.scalar_type() == at::kByte &&
                          hs_dequant_row_bytes(static_cast<int>(embed_type), norm.numel()) == embed.size(1);
        TORCH_CHECK(table || rows, "Head: float32 embeddings [V, H], or uint8 rows [V, row bytes] of a type hs_dequant_rows reads");
    }
};

// One decoding step of B sequences, one new token each: embed ``tokens [B]`` at ``positions [B]``
// (or several tokens of one sequence, rows in a row with the same table: each sees those before it),
// run the range's layers (sequence b reads and writes the cache through its block table, row b
// of ``tables`` [B x width], flattened), the final norm and the head -> logits [B, V] float32.
// The same kernels and inputs as the step taken op by op (embedding rows, RoPE rows of the tables
// ``cos, ssin [P, D]``, decode_layers, rms_norm, the head's matmul), so the same bits; what it
// saves is a dozen tensors and calls made per step in Python. Attention shares the threads from
// ``parallel_min_keys`` keys in all (the B sequences' positions + 1), as layer_op.py decides it.
// ``cos_local_table, ssin_local_table``: the local RoPE base's tables (the same tensors where the model
// has no other base).
at::Tensor decode_step(const std::vector<int64_t>& tokens, const std::vector<int64_t>& positions,
                       const std::vector<int64_t>& tables, int64_t block_size, const at::Tensor& cos_table,
                       const at::Tensor& ssin_table, const at::Tensor& cos_local_table,
                       const at::Tensor& ssin_local_table, int64_t parallel_min_keys,
                       const c10::intrusive_ptr<Range>& range, const c10::intrusive_ptr<Head>& head) {
    const int64_t B = static_cast<int64_t>(tokens.size());
    TORCH_CHECK(B > 0 && positions.size() == tokens.size() && tables.size() % B == 0, "decode_step: B tokens, positions");
    const int64_t width = static_cast<int64_t>(tables.size()) / B, V = head->embed.size(0), H = head->norm.numel();
    const int64_t P = cos_table.size(0), D = cos_table.size(1);
    std::optional<Timed> setup(std::in_place, SETUP);  // the step's inputs, until the layers start
    TORCH_CHECK(cos_table.is_contiguous() && ssin_table.is_contiguous() && cos_table.scalar_type() == at::kFloat &&
                ssin_table.sizes() == cos_table.sizes() && ssin_table.scalar_type() == at::kFloat,
                "decode_step: contiguous float32 RoPE tables [P, D]");
    const bool local = !cos_local_table.is_same(cos_table);
    TORCH_CHECK(cos_local_table.is_contiguous() && ssin_local_table.is_contiguous() &&
                cos_local_table.scalar_type() == at::kFloat && ssin_local_table.scalar_type() == at::kFloat &&
                cos_local_table.size(1) == D &&
                ssin_local_table.sizes() == cos_local_table.sizes(), "decode_step: local RoPE tables as the others");
    const auto fopt = head->norm.options();
    at::Tensor h = at::empty({B, H}, fopt), cos = at::empty({B, D}, fopt), ssin = at::empty({B, D}, fopt);
    at::Tensor cos_l = local ? at::empty({B, D}, fopt) : cos, ssin_l = local ? at::empty({B, D}, fopt) : ssin;
    const float embed_scale = static_cast<float>(head->embed_scale);
    at::Tensor slots = at::empty({B}, fopt.dtype(at::kLong)), seq = at::empty({B}, fopt.dtype(at::kInt));
    at::Tensor lengths = at::empty({B}, fopt.dtype(at::kInt)), tab = at::empty({B, width}, fopt.dtype(at::kInt));
    const uint8_t* emb = static_cast<const uint8_t*>(head->embed.data_ptr());
    int32_t* tp = tab.data_ptr<int32_t>();
    for (int64_t b = 0; b < B; b++) {
        const int64_t tok = tokens[b], pos = positions[b];
        TORCH_CHECK(tok >= 0 && tok < V && pos >= 0 && pos < P && pos / block_size < width,
                    "decode_step: token ", tok, " or position ", pos, " out of range");
        hs_dequant_rows(static_cast<int>(head->embed_type), emb, head->embed.size(1) * head->embed.element_size(), &tok,
                        1, H, embed_scale, h.data_ptr<float>() + b * H);
        std::memcpy(cos.data_ptr<float>() + b * D, cos_table.data_ptr<float>() + pos * D, D * sizeof(float));
        std::memcpy(ssin.data_ptr<float>() + b * D, ssin_table.data_ptr<float>() + pos * D, D * sizeof(float));
        if (local) {
            TORCH_CHECK(pos < cos_local_table.size(0), "decode_step: position ", pos, " past the local RoPE table");
            std::memcpy(cos_l.data_ptr<float>() + b * D, cos_local_table.data_ptr<float>() + pos * D, D * sizeof(float));
            std::memcpy(ssin_l.data_ptr<float>() + b * D, ssin_local_table.data_ptr<float>() + pos * D, D * sizeof(float));
        }
        for (int64_t j = 0; j < width; j++) tp[b * width + j] = static_cast<int32_t>(tables[b * width + j]);
        slots.data_ptr<int64_t>()[b] = tables[b * width + pos / block_size] * block_size + pos % block_size;
        // a row that goes on the row before it (the same table, the next position: a verification
        // pass's drafts) is the same sequence to attention, which then reads its keys once for both
        const bool same = b > 0 && pos == positions[b - 1] + 1 &&
                          std::equal(tables.begin() + b * width, tables.begin() + (b + 1) * width,
                                     tables.begin() + (b - 1) * width);
        seq.data_ptr<int32_t>()[b] = same ? seq.data_ptr<int32_t>()[b - 1] : static_cast<int32_t>(b);
        lengths.data_ptr<int32_t>()[b] = static_cast<int32_t>(pos + 1);
    }
    int64_t keys = B;
    for (const int64_t p : positions) keys += p;
    setup.reset();
    const at::Tensor out = decode_layers(h, cos, ssin, cos_l, ssin_l, slots, tab, seq, lengths, std::nullopt, std::nullopt,
                                         block_size, keys >= parallel_min_keys, range, false);
    at::Tensor x = at::empty({B, H}, fopt), logits;
    {
        Timed t(NORM);
        hs_rms_norm(out.data_ptr<float>(), head->norm.data_ptr<float>(), B, H, static_cast<float>(head->eps), x.data_ptr(),
                 0);
    }
    return matmul(head->kind, x, head->weight, head->params, head->group, logits).contiguous();
}

// The index of the largest of ``row[0 .. n)``, as torch.argmax picks it: the first of equal
// maxima, the first NaN where there is one (NaN counts as the largest): hs_argmax (vector compares).
int64_t argmax_row(const float* row, int64_t n) { return hs_argmax(row, n); }

// Whether the last ``n`` tokens of ``text`` occurred earlier with a token after them (an occurrence
// ending at ``e <= size - 2``), as ``decode.lookup.NgramIndex.match`` finds a match of ``n`` tokens.
bool ngram_recurs(const std::vector<int64_t>& text, int64_t n) {
    const int64_t size = static_cast<int64_t>(text.size());
    if (n <= 0 || size < n + 1) return false;
    const int64_t* tail = text.data() + size - n;
    for (int64_t e = size - 2; e >= n - 1; e--) {
        if (std::equal(tail, tail + n, text.data() + e - n + 1)) return true;
    }
    return false;
}

// Up to ``steps`` greedy decoding steps of B sequences in one call: decode_step on ``tokens`` at
// ``positions``, the argmax of each row of its logits as the next tokens at ``positions + 1``, and
// so on -> the tokens chosen, [B, s] int64 (row b: sequence b's next s tokens), s <= steps: it stops
// early once every row has chosen one of ``eos``. Each step is exactly decode_step and each
// choice exactly torch.argmax, so the tokens are those of ``steps`` calls of decode_step with an
// argmax between them; what goes is the Python and dispatch between the steps. The block tables
// must hold the positions the steps write (``positions[b] + steps - 1``).
//
// ``stop_ngram`` (empty, or one per row): it also stops after a step where a row b with
// ``stop_ngram[b] = n > 0`` ends on an n-gram that occurred earlier in its text (``history``'s
// slice ``[history_ends[b-1], history_ends[b])``: its tokens up to the one at ``positions[b]``,
// then the tokens chosen), with a token after it: where prompt lookup has drafts to offer, so
// that the caller can verify them before the next plain step. A stop only shortens the run: the
// tokens are a prefix of those of the full run.
//
// ``temperature`` (empty: every row greedy, or one per row): a row with temperature > 0 samples
// instead, from hs_sampling_probs of its logits row (that temperature, ``top_k``, ``top_p``) by
// hs_sample_pick with ``uniforms[b, s]`` ([B, steps] float64: the numbers of the positions it fills,
// DecodeContext.uniforms): the token sampler.choose gives with the same logits and number.
at::Tensor decode_steps(std::vector<int64_t> tokens, std::vector<int64_t> positions, const std::vector<int64_t>& tables,
                        int64_t block_size, const at::Tensor& cos_table, const at::Tensor& ssin_table,
                        const at::Tensor& cos_local_table, const at::Tensor& ssin_local_table,
                        int64_t steps, const std::vector<int64_t>& eos, const std::vector<int64_t>& history,
                        const std::vector<int64_t>& history_ends, const std::vector<int64_t>& stop_ngram,
                        const std::vector<double>& temperature, const std::vector<int64_t>& top_k,
                        const std::vector<double>& top_p, const std::optional<at::Tensor>& uniforms,
                        int64_t parallel_min_keys, const c10::intrusive_ptr<Range>& range,
                        const c10::intrusive_ptr<Head>& head) {
    const int64_t B = static_cast<int64_t>(tokens.size());
    TORCH_CHECK(steps > 0 && B > 0, "decode_steps: at least one step of one sequence");
    const bool sampled = !temperature.empty();
    TORCH_CHECK(!sampled || (static_cast<int64_t>(temperature.size()) == B && static_cast<int64_t>(top_k.size()) == B &&
                             static_cast<int64_t>(top_p.size()) == B && uniforms.has_value() &&
                             uniforms->scalar_type() == at::kDouble && uniforms->is_contiguous() &&
                             uniforms->dim() == 2 && uniforms->size(0) == B && uniforms->size(1) >= steps),
                "decode_steps: temperature, top_k and top_p need one entry per row and uniforms [B, steps] float64");
    std::vector<float> probs;  // a sampled row's distribution
    TORCH_CHECK(stop_ngram.empty() || (static_cast<int64_t>(stop_ngram.size()) == B &&
                                       static_cast<int64_t>(history_ends.size()) == B &&
                                       history_ends.back() == static_cast<int64_t>(history.size())),
                "decode_steps: stop_ngram and history_ends need one entry per row, ending at the history's end");
    std::vector<std::vector<int64_t>> texts(stop_ngram.empty() ? 0 : B);  // each row's text so far
    for (int64_t b = 0; b < static_cast<int64_t>(texts.size()); b++) {
        if (stop_ngram[b] > 0) {
            texts[b].assign(history.begin() + (b ? history_ends[b - 1] : 0), history.begin() + history_ends[b]);
        }
    }
    at::Tensor out = at::empty({B, steps}, at::TensorOptions().dtype(at::kLong));
    int64_t* chosen = out.data_ptr<int64_t>();
    std::vector<bool> ended(B, false);
    bool stop = false;
    int64_t s = 0;
    while (s < steps) {
        const at::Tensor logits = decode_step(tokens, positions, tables, block_size, cos_table, ssin_table,
                                              cos_local_table, ssin_local_table, parallel_min_keys, range,
                                              head);  // [B, V]
        const int64_t V = logits.size(1);
        const float* lp = logits.data_ptr<float>();
        bool all_ended = true;
        for (int64_t b = 0; b < B; b++) {
            int64_t t;
            if (sampled && temperature[b] > 0) {
                probs.resize(V);
                const float temp = static_cast<float>(temperature[b]), p = static_cast<float>(top_p[b]);
                hs_sampling_probs(lp + b * V, probs.data(), 1, V, &temp, &top_k[b], &p);
                hs_sample_pick(probs.data(), 1, V, uniforms->data_ptr<double>() + b * uniforms->size(1) + s, &t);
            } else {
                t = argmax_row(lp + b * V, V);
            }
            chosen[b * steps + s] = t;
            tokens[b] = t;
            positions[b] += 1;
            ended[b] = ended[b] || std::find(eos.begin(), eos.end(), t) != eos.end();
            all_ended = all_ended && ended[b];
            if (!texts.empty() && stop_ngram[b] > 0 && !ended[b]) {
                texts[b].push_back(t);
                stop = stop || ngram_recurs(texts[b], stop_ngram[b]);
            }
        }
        s++;
        if (all_ended || stop) break;
    }
    return s == steps ? out : out.slice(1, 0, s).contiguous();
}

}  // namespace

TORCH_LIBRARY(hispec_fused, m) {
    m.class_<Range>("Range").def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                                             std::vector<at::Tensor>, std::vector<int64_t>, std::vector<int64_t>,
                                             std::vector<int64_t>, int64_t, int64_t, double, double, bool>());
    m.class_<Head>("Head").def(
        torch::init<at::Tensor, int64_t, at::Tensor, at::Tensor, at::Tensor, int64_t, int64_t, double, double>());
    m.def("profile(bool on) -> (float[], int[])", profile);
    m.def("decode_layers(Tensor h, Tensor cos, Tensor ssin, Tensor cos_local, Tensor ssin_local, Tensor slots, Tensor tables, Tensor seq, Tensor lengths, "
          "Tensor? tail_start, Tensor? tail, int block_size, bool parallel, "
          "__torch__.torch.classes.hispec_fused.Range range, bool prompt=False) -> Tensor",
          decode_layers);
    m.def("decode_step(int[] tokens, int[] positions, int[] tables, int block_size, Tensor cos, Tensor ssin, "
          "Tensor cos_local, Tensor ssin_local, int parallel_min_keys, __torch__.torch.classes.hispec_fused.Range range, "
          "__torch__.torch.classes.hispec_fused.Head head) -> Tensor",
          decode_step);
    m.def("decode_steps(int[] tokens, int[] positions, int[] tables, int block_size, Tensor cos, Tensor ssin, "
          "Tensor cos_local, Tensor ssin_local, int steps, int[] eos, int[] history, int[] history_ends, int[] stop_ngram, float[] temperature, "
          "int[] top_k, float[] top_p, Tensor? uniforms, int parallel_min_keys, "
          "__torch__.torch.classes.hispec_fused.Range range, "
          "__torch__.torch.classes.hispec_fused.Head head) -> Tensor",
          decode_steps);
}
