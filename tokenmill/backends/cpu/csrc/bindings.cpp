// The Python module: every function under its name, with named arguments, and
// the weight structs of layer_stack.h as classes with named fields (kernels.py
// CpuOps types them for Python). Compiled after the other sources, in one unit.
#include <torch/extension.h>

#include <pybind11/stl.h>

#include <optional>

#include "distributed.h"
#include "layer_stack.h"
#include "moe.h"

namespace py = pybind11;

void prepare_gelu_tanh();  // (fused_ops.cpp)
at::Tensor gelu_tanh_and_mul(at::Tensor gate_up);

#define TOKENMILL_DEF(name, ...) m.def(#name, torch::wrap_pybind_function(name), __VA_ARGS__)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<PackedWeight>(m, "PackedWeight")
      .def(py::init([](int64_t format, int64_t n, int64_t k, at::Tensor data, at::Tensor bias,
                       std::vector<PackedWeight> parts) {
             TORCH_CHECK(format >= 0 && format < kNumFormats, "PackedWeight: unknown format ", format);
             TORCH_CHECK(n > 0 && k > 0, "PackedWeight: n and k must be positive");
             const bool of_parts = static_cast<WeightFormat>(format) == WeightFormat::kParts;
             TORCH_CHECK(of_parts != parts.empty(), "PackedWeight: parts go with the parts format, and only there");
             int64_t rows = 0;
             for (const PackedWeight& part : parts) {
               TORCH_CHECK(part.k == k && part.format != WeightFormat::kParts, "PackedWeight: a part of ", k,
                           " inputs in a format of its own");
               rows += part.n;
             }
             TORCH_CHECK(!of_parts || rows == n, "PackedWeight: the parts' ", rows, " outputs are not n = ", n);
             return PackedWeight{static_cast<WeightFormat>(format), n, k, data, bias, std::move(parts)};
           }),
           py::kw_only(), py::arg("format"), py::arg("n"), py::arg("k"), py::arg("data"), py::arg("bias"),
           py::arg("parts") = std::vector<PackedWeight>{})
      .def_property_readonly("format", [](const PackedWeight& w) { return static_cast<int64_t>(w.format); })
      .def_readonly("n", &PackedWeight::n)
      .def_readonly("k", &PackedWeight::k)
      .def_readonly("data", &PackedWeight::data)
      .def_readonly("bias", &PackedWeight::bias)
      .def_readonly("parts", &PackedWeight::parts);
  py::class_<LayerWeights>(m, "LayerWeights")
      .def(py::init([](at::Tensor norm1, PackedWeight qkv, PackedWeight o, at::Tensor norm2,
                       std::optional<PackedWeight> gate_up, std::optional<PackedWeight> down, at::Tensor q_norm,
                       at::Tensor k_norm, int64_t sliding_window, double scale, at::Tensor attn_out_norm,
                       at::Tensor mlp_out_norm, at::Tensor cos, at::Tensor sin, double logit_softcap,
                       std::optional<PackedWeight> router, std::vector<PackedWeight> experts_gate_up,
                       std::vector<PackedWeight> experts_down, int64_t top_k, bool norm_topk_prob,
                       bool topk_then_softmax, double swiglu_limit, double swiglu_alpha,
                       std::optional<at::Tensor> sinks) {
             TORCH_CHECK(logit_softcap >= 0, "LayerWeights: logit_softcap > 0, or 0 for none");
             TORCH_CHECK(cos.numel() == sin.numel(), "LayerWeights: cos and sin, both or neither");
             // The MLP: dense (gate_up, down) or sparse (router, experts), one of the two.
             const bool dense = gate_up.has_value() && down.has_value();
             const bool sparse = router.has_value() && !experts_gate_up.empty();
             TORCH_CHECK(dense != sparse && (dense || (!gate_up.has_value() && !down.has_value())),
                         "LayerWeights: gate_up and down, or a router and experts");
             LayerWeights w{norm1, qkv, o, norm2, dense ? *gate_up : PackedWeight{}, dense ? *down : PackedWeight{},
                            MoeWeights{}, q_norm, k_norm, sliding_window, scale, attn_out_norm, mlp_out_norm,
                            cos, sin, logit_softcap};
             if (sinks.has_value() && sinks->numel()) {
               TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->dim() == 1, "LayerWeights: sinks [num_heads] float32");
               w.sinks = sinks->contiguous();
             }
             if (sparse) {
               w.moe = MoeWeights{*router, std::move(experts_gate_up), std::move(experts_down), top_k, norm_topk_prob,
                                  topk_then_softmax, swiglu_limit, swiglu_alpha};
               check_moe(w.moe, norm2.numel());
             }
             return w;
           }),
           py::kw_only(), py::arg("norm1"), py::arg("qkv"), py::arg("o"), py::arg("norm2"),
           py::arg("gate_up") = py::none(), py::arg("down") = py::none(), py::arg("q_norm"), py::arg("k_norm"),
           py::arg("sliding_window"), py::arg("scale"), py::arg("attn_out_norm"), py::arg("mlp_out_norm"),
           py::arg("cos"), py::arg("sin"), py::arg("logit_softcap"), py::arg("router") = py::none(),
           py::arg("experts_gate_up") = std::vector<PackedWeight>{},
           py::arg("experts_down") = std::vector<PackedWeight>{}, py::arg("top_k") = 0,
           py::arg("norm_topk_prob") = false, py::arg("topk_then_softmax") = false, py::arg("swiglu_limit") = 0.0,
           py::arg("swiglu_alpha") = 1.702, py::arg("sinks") = py::none())
      .def_readonly("norm1", &LayerWeights::norm1)
      .def_readonly("qkv", &LayerWeights::qkv)
      .def_readonly("o", &LayerWeights::o)
      .def_readonly("norm2", &LayerWeights::norm2)
      .def_readonly("gate_up", &LayerWeights::gate_up)
      .def_readonly("down", &LayerWeights::down)
      .def_readonly("q_norm", &LayerWeights::q_norm)
      .def_readonly("k_norm", &LayerWeights::k_norm)
      .def_readonly("sliding_window", &LayerWeights::sliding_window)
      .def_readonly("scale", &LayerWeights::scale)
      .def_readonly("attn_out_norm", &LayerWeights::attn_out_norm)
      .def_readonly("mlp_out_norm", &LayerWeights::mlp_out_norm)
      .def_readonly("logit_softcap", &LayerWeights::logit_softcap)
      .def_property_readonly("num_experts", [](const LayerWeights& w) {
        return static_cast<int64_t>(w.moe.gate_up.size());
      });
  py::class_<ModelWeights>(m, "ModelWeights")
      .def(py::init([](std::vector<LayerWeights> layers, at::Tensor final_norm, double eps, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, at::Tensor cos, at::Tensor sin, bool prefill_tiles,
                       const std::string& act) {
             TORCH_CHECK(act == "silu" || act == "gelu_pytorch_tanh", "ModelWeights: act silu or gelu_pytorch_tanh");
             const MlpAct a = act == "silu" ? MlpAct::kSilu : MlpAct::kGeluTanh;
             if (a == MlpAct::kGeluTanh) prepare_gelu_tanh();  // (its table, outside the kernels' regions)
             return ModelWeights{std::move(layers), final_norm, eps, num_heads, num_kv_heads, head_dim, cos, sin,
                                 prefill_tiles, a};
           }),
           py::kw_only(), py::arg("layers"), py::arg("final_norm"), py::arg("eps"), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("cos"), py::arg("sin"), py::arg("prefill_tiles"),
           py::arg("act"))
      .def_readonly("layers", &ModelWeights::layers)
      .def_readonly("final_norm", &ModelWeights::final_norm)
      .def_readonly("eps", &ModelWeights::eps)
      .def_readonly("num_heads", &ModelWeights::num_heads)
      .def_readonly("num_kv_heads", &ModelWeights::num_kv_heads)
      .def_readonly("head_dim", &ModelWeights::head_dim)
      .def_readonly("prefill_tiles", &ModelWeights::prefill_tiles);

  py::class_<LoraAdapterWeights>(m, "LoraAdapterWeights")
      .def(py::init([](std::vector<at::Tensor> a, std::vector<at::Tensor> b, std::vector<at::Tensor> scale,
                       std::vector<at::Tensor> parts, at::ScalarType dtype) {
             TORCH_CHECK(a.size() == b.size() && a.size() == scale.size() && a.size() == parts.size() &&
                             a.size() % kLoraProjections == 0,
                         "LoraAdapterWeights: a, b, scale and parts for each of 4 projections of every layer");
             LoraAdapterWeights w;
             for (size_t i = 0; i < a.size(); ++i)  // (an empty A: that projection is not adapted)
               w.projections.push_back(a[i].numel() == 0 ? LoraProjection{}
                                                         : pack_lora_projection(a[i], b[i], scale[i], parts[i], dtype));
             return w;
           }),
           py::kw_only(), py::arg("a"), py::arg("b"), py::arg("scale"), py::arg("parts"), py::arg("dtype"));

  py::class_<ShmGroup>(m, "ShmGroup")
      .def(py::init([](at::Tensor region, int64_t rank, int64_t size, int64_t capacity, std::vector<int64_t> pids,
                       double timeout_s) { return ShmGroup{region, rank, size, capacity, std::move(pids), timeout_s}; }),
           py::kw_only(), py::arg("region"), py::arg("rank"), py::arg("size"), py::arg("capacity"), py::arg("pids"),
           py::arg("timeout_s"))
      .def_readonly("rank", &ShmGroup::rank)
      .def_readonly("size", &ShmGroup::size);

  TOKENMILL_DEF(paged_attention, py::arg("q"), py::arg("kv_cache"), py::arg("block_tables"), py::arg("seq_lens"),
                py::arg("scale"), py::arg("sliding_window"), py::arg("seq_ids"), py::arg("prefill_tiles") = false,
                py::arg("logit_softcap") = 0.0, py::arg("sinks") = py::none());
  TOKENMILL_DEF(rms_norm, py::arg("x"), py::arg("weight"), py::arg("eps"));
  TOKENMILL_DEF(fused_add_rms_norm, py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"));
  TOKENMILL_DEF(rope_qkv_cache, py::arg("qkv"), py::arg("num_heads"), py::arg("num_kv_heads"),
                py::arg("head_dim"), py::arg("positions"), py::arg("cos"), py::arg("sin"), py::arg("kv_cache"),
                py::arg("slot_mapping"), py::arg("q_norm"), py::arg("k_norm"), py::arg("eps"));
  TOKENMILL_DEF(silu_and_mul, py::arg("gate_up"));
  TOKENMILL_DEF(gelu_tanh_and_mul, py::arg("gate_up"));
  TOKENMILL_DEF(kq_pack, py::arg("fmt"), py::arg("blocks"), py::arg("out"));
  TOKENMILL_DEF(q8_pack, py::arg("q"), py::arg("d"), py::arg("out"));
  TOKENMILL_DEF(q8_embed, py::arg("qweight"), py::arg("qscale"), py::arg("ids"), py::arg("float32_out"));
  TOKENMILL_DEF(argmax_rows, py::arg("logits"));
  TOKENMILL_DEF(apply_token_bitmask, py::arg("logits"), py::arg("bitmask"), py::arg("rows"));
  // (From Python with no K/V prefetch streams: the layer calls feed them, formats.h.)
  m.def("packed_gemm", torch::wrap_pybind_function([](at::Tensor x, const PackedWeight& w, bool float32_out) {
          return packed_gemm(std::move(x), w, float32_out, KvStreams{});
        }), py::arg("x"), py::arg("weight"), py::arg("float32_out"));
  m.def("packed_gemm_silu", torch::wrap_pybind_function([](at::Tensor x, const PackedWeight& w) {
          return packed_gemm_silu(std::move(x), w, KvStreams{});
        }), py::arg("x"), py::arg("weight"));
  m.def("moe_mlp", torch::wrap_pybind_function([](const at::Tensor& x, const PackedWeight& router,
                                                   std::vector<PackedWeight> experts_gate_up,
                                                   std::vector<PackedWeight> experts_down, int64_t top_k,
                                                   bool norm_topk_prob, bool topk_then_softmax,
                                                   double swiglu_limit, double swiglu_alpha) {
          const MoeWeights w{router, std::move(experts_gate_up), std::move(experts_down), top_k, norm_topk_prob,
                             topk_then_softmax, swiglu_limit, swiglu_alpha};
          return moe_mlp(x, w, KvStreams{});
        }), py::arg("x"), py::arg("router"), py::arg("experts_gate_up"), py::arg("experts_down"), py::arg("top_k"),
        py::arg("norm_topk_prob"), py::arg("topk_then_softmax") = false, py::arg("swiglu_limit") = 0.0,
        py::arg("swiglu_alpha") = 1.702);
  m.def("packed_gemm_dtypes", torch::wrap_pybind_function(packed_gemm_dtypes));
  m.def("weight_formats", torch::wrap_pybind_function(weight_formats));
  TOKENMILL_DEF(layer_loop, py::arg("model"), py::arg("hidden"), py::arg("positions"), py::arg("kv_caches"),
                py::arg("slot_mapping"), py::arg("tables"), py::arg("seq_lens"), py::arg("seq_ids"),
                py::arg("layer_groups"),
                py::arg("output_rows"), py::arg("all_rows"), py::arg("kv_prefetch"),
                py::arg("lora_adapters") = std::vector<const LoraAdapterWeights*>{},
                py::arg("lora_rows") = std::vector<at::Tensor>{});
  TOKENMILL_DEF(lora_delta, py::arg("out"), py::arg("x"), py::arg("lora_adapters"), py::arg("lora_rows"),
                py::arg("layer"), py::arg("projection"));
  TOKENMILL_DEF(layer_loop_tp, py::arg("model"), py::arg("hidden"), py::arg("positions"), py::arg("kv_caches"),
                py::arg("slot_mapping"), py::arg("tables"), py::arg("seq_lens"), py::arg("seq_ids"),
                py::arg("layer_groups"),
                py::arg("output_rows"), py::arg("all_rows"), py::arg("group"), py::arg("kv_prefetch"));
  TOKENMILL_DEF(shm_all_reduce, py::arg("group"), py::arg("t"));
  TOKENMILL_DEF(shm_gather, py::arg("group"), py::arg("local"), py::arg("out"), py::arg("widths"));
  TOKENMILL_DEF(shm_send, py::arg("group"), py::arg("data"));
  TOKENMILL_DEF(shm_receive, py::arg("group"));
  TOKENMILL_DEF(layer_stack, py::arg("model"), py::arg("hidden"), py::arg("positions"), py::arg("kv_caches"),
                py::arg("slot_mapping"), py::arg("tables"), py::arg("seq_lens"), py::arg("seq_ids"),
                py::arg("layer_groups"),
                py::arg("bounds"), py::arg("kv_prefetch"),
                py::arg("lora_adapters") = std::vector<const LoraAdapterWeights*>{},
                py::arg("lora_rows") = std::vector<at::Tensor>{});
  TOKENMILL_DEF(kv_prefetch_rows, py::arg("kv_cache"), py::arg("tables"), py::arg("seq_lens"),
                py::arg("seq_ids"), py::arg("window"));
}
