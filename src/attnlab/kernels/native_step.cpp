// One decoding step through every block of a decoder, in one call: the same kernels and the
// same roundings as the modules' forward calls, without a Python frame between them.
//
// For each block (pre-norm, as attnlab.models.decoder.DecoderBlock):
//
//   h = norm1(x);  q, k, v = h Wq^T, h Wk^T, h Wv^T        B x (H|G) x D, one position a row
//   q, k = rope(qnorm(q)), rope(knorm(k));  cache[:, :, offset] = k, v
//   x = x + (attention(q, cache[:, :, :offset + 1]) Wo^T)  softmax(q k^T scale + mask) v
//   x = x + mlp(norm2(x))                                    down(act(gate h) * up h) or W2 act(W1 h)
//
// A StepPlan holds the blocks as typed structs, built once from Python
// (attnlab.kernels.fused_layers) and kept while the modules stay as they were; its run() then
// touches no Python object per block. Each product runs the kernel that the module itself
// would run for these rows (the module's plan names it, as a StepKind): attnlab's GEMVs,
// PyTorch's packed int8/int4 ops or linear. A module planned on any other kernel has no
// StepKind, and then no StepPlan is built: the modules run. Norms, RoPE and the attention are
// native_decode.cpp's kernels, the residual adds and activations ATen's. A decoding step
// spends ~1-2 ms in Python frames and small ATen calls around 7 products per block otherwise
// (4 layers, 2 cores), which is what this file saves.
#include <torch/extension.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace py = pybind11;

torch::Tensor gemv(const torch::Tensor& x, const torch::Tensor& w, const std::optional<torch::Tensor>& bias,
                   bool pairs);
torch::Tensor gemv_int8(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& s,
                        const std::optional<torch::Tensor>& bias, bool integers);
torch::Tensor gemv_int4(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& s,
                        const torch::Tensor& z, int64_t group_size, const std::optional<torch::Tensor>& bias,
                        bool pairs, bool integers);
torch::Tensor gemv_int8_grouped(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& s,
                                const std::optional<torch::Tensor>& z, int64_t group_size,
                                const std::optional<torch::Tensor>& bias);
torch::Tensor gemv_tiles(const torch::Tensor& x, const torch::Tensor& w,
                         const std::optional<torch::Tensor>& bias);
torch::Tensor gemv_int8_tiles(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& s,
                              const std::optional<torch::Tensor>& bias);
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const std::optional<torch::Tensor>& mask, double scale, bool causal);
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps, bool unit_offset);
torch::Tensor activation(const torch::Tensor& gate, const std::optional<torch::Tensor>& up, int64_t kind);
bool has_vector_activation();
torch::Tensor rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                     bool interleaved);

namespace {

// The products a StepPlan runs, each named in Python (StepKind) as the kernel of
// attnlab.kernels.catalog / attnlab.quantization.kernels whose result it computes: attnlab's
// GEMVs, PyTorch's packed int8/int4 ops (then the bias added after, as the Python kernels add
// it), the formula (linear, any weight layout) and the AMX tile kernels.
enum class StepKind : int64_t {
  kFloat, kFloatPairs, kInt8, kInt4, kInt4Pairs, kInt8Mm, kInt4Mm, kFormula, kTiles,
  kInt8Tiles, kInt8Integers, kInt4Integers, kInt8Grouped
};
// The block's norms, named in Python (NormKind) as attnlab.kernels.fused_layers reads them off
// its modules: RMSNorm, RMSNorm times 1 + w (Gemma), LayerNorm.
enum class NormKind : int64_t { kRms, kRmsUnitOffset, kLayerNorm };
// The MLP's activations, named in Python (Activation) as attnlab.layers.ACTIVATIONS names
// them; silu and gelu_tanh are also the codes of native_decode.cpp's activation().
enum class Activation : int64_t { kSilu = 0, kGeluTanh = 1, kGelu = 2, kRelu = 3 };

// One product: kind, weight or codes, scales (int4_mm: its scale/zero pairs), zeros, group
// size and bias, as the module's planned kernel reads them (int8_grouped: zeros None without
// offsets).
struct Linear {
  StepKind kind;
  torch::Tensor w;
  std::optional<torch::Tensor> s, z, bias;
  int64_t group;

  Linear(StepKind kind, torch::Tensor w, std::optional<torch::Tensor> s,
         std::optional<torch::Tensor> z, int64_t group, std::optional<torch::Tensor> bias)
      : kind(kind), w(std::move(w)), s(std::move(s)), z(std::move(z)), bias(std::move(bias)),
        group(group) {
    const bool scaled = kind == StepKind::kInt8 || kind == StepKind::kInt8Integers ||
                        kind == StepKind::kInt8Mm || kind == StepKind::kInt8Tiles ||
                        kind == StepKind::kInt4Mm || kind == StepKind::kInt8Grouped;
    const bool zeroed = kind == StepKind::kInt4 || kind == StepKind::kInt4Pairs ||
                        kind == StepKind::kInt4Integers;
    TORCH_CHECK(!(scaled || zeroed) || this->s, "s: expected the scales of this kind, got None");
    TORCH_CHECK(!zeroed || this->z, "z: expected the zeros of this kind, got None");
  }

  torch::Tensor biased(const torch::Tensor& y) const { return bias ? at::add(y, *bias) : y; }

  torch::Tensor operator()(const torch::Tensor& x) const {
    switch (kind) {
      case StepKind::kFloat: return gemv(x, w, bias, false);
      case StepKind::kFloatPairs: return gemv(x, w, bias, true);
      case StepKind::kInt8: return gemv_int8(x, w, *s, bias, false);
      case StepKind::kInt8Integers: return gemv_int8(x, w, *s, bias, true);
      case StepKind::kInt4: return gemv_int4(x, w, *s, *z, group, bias, false, false);
      case StepKind::kInt4Pairs: return gemv_int4(x, w, *s, *z, group, bias, true, false);
      case StepKind::kInt4Integers: return gemv_int4(x, w, *s, *z, group, bias, false, true);
      case StepKind::kInt8Mm: return biased(at::_weight_int8pack_mm(x, w, *s));
      case StepKind::kInt4Mm: return biased(at::_weight_int4pack_mm_for_cpu(x, w, group, *s));
      case StepKind::kFormula: return at::linear(x, w, bias);
      case StepKind::kTiles: return gemv_tiles(x, w, bias);
      case StepKind::kInt8Tiles: return gemv_int8_tiles(x, w, *s, bias);
      case StepKind::kInt8Grouped: return gemv_int8_grouped(x, w, *s, z, group, bias);
    }
    TORCH_CHECK(false, "a linear: unknown kind ", static_cast<int64_t>(kind));
  }
};

// One block's tensors; mlp is (gate, up, down) or (linear1, linear2).
struct Block {
  torch::Tensor norm1_w;
  std::optional<torch::Tensor> norm1_b;
  Linear q, k, v, o;
  std::optional<torch::Tensor> q_norm, k_norm;
  torch::Tensor norm2_w;
  std::optional<torch::Tensor> norm2_b;
  std::vector<Linear> mlp;
};

// What every block of the step shares.
struct Config {
  NormKind norm;
  Activation act;
  int64_t H, G, D;
  double eps, scale;
  bool gated, interleaved;
};

torch::Tensor normed(const Config& c, const torch::Tensor& x, const torch::Tensor& w,
                     const std::optional<torch::Tensor>& b) {
  if (c.norm == NormKind::kLayerNorm) return at::layer_norm(x, {x.size(-1)}, w, b, c.eps);
  return rms_norm(x, w, c.eps, c.norm == NormKind::kRmsUnitOffset);
}

// act(x), times up when given, as attnlab.layers.feedforward.activated computes it: the
// native kernel for silu and the tanh GELU where it has its vector loop, else ATen's.
torch::Tensor activated(const Config& c, const torch::Tensor& x,
                        const std::optional<torch::Tensor>& up = std::nullopt) {
  if ((c.act == Activation::kSilu || c.act == Activation::kGeluTanh) && has_vector_activation())
    return activation(x, up, static_cast<int64_t>(c.act));
  torch::Tensor h;
  switch (c.act) {
    case Activation::kSilu: h = at::silu(x); break;
    case Activation::kGeluTanh: h = at::gelu(x, "tanh"); break;
    case Activation::kGelu: h = at::gelu(x); break;
    case Activation::kRelu: h = at::relu(x); break;
  }
  return up ? at::mul(h, *up) : h;
}

// One block on x (B x E) whose caches hold `offset` positions; returns the new x.
torch::Tensor block(const Config& c, const Block& b, const torch::Tensor& x, int64_t offset,
                    const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                    const std::optional<torch::Tensor>& cos, const std::optional<torch::Tensor>& sin,
                    const std::optional<torch::Tensor>& mask) {
  const int64_t B = x.size(0);
  const auto h = normed(c, x, b.norm1_w, b.norm1_b);
  auto q = b.q(h).view({B, 1, c.H, c.D});
  auto k = b.k(h).view({B, 1, c.G, c.D});
  const auto v = b.v(h).view({B, 1, c.G, c.D});
  if (b.q_norm) {
    const bool unit = c.norm == NormKind::kRmsUnitOffset;
    q = rms_norm(q.reshape({-1, c.D}), *b.q_norm, c.eps, unit).view(q.sizes());
    k = rms_norm(k.reshape({-1, c.D}), *b.k_norm, c.eps, unit).view(k.sizes());
  }
  if (cos) {
    q = rotary(q, *cos, *sin, c.interleaved);
    k = rotary(k, *cos, *sin, c.interleaved);
  }
  k_cache.select(2, offset).copy_(k.select(1, 0));
  v_cache.select(2, offset).copy_(v.select(1, 0));
  const auto keys = k_cache.narrow(2, 0, offset + 1);
  const auto values = v_cache.narrow(2, 0, offset + 1);
  const auto z = decode_attention(q.transpose(1, 2), keys, values, mask, c.scale, false);
  auto out = at::add(x, b.o(z.transpose(1, 2).reshape({B, c.H * c.D})));

  const auto h2 = normed(c, out, b.norm2_w, b.norm2_b);
  const auto& mlp = b.mlp;
  const auto m = c.gated ? mlp[2](activated(c, mlp[0](h2), mlp[1](h2)))
                         : mlp[1](activated(c, mlp[0](h2)));
  return at::add(out, m);
}

// Where a tensor of the plan lay and what it held when the plan was built.
struct Seen {
  torch::Tensor t;
  const void* data;
  at::ScalarType dtype;

  explicit Seen(const torch::Tensor& t) : t(t), data(t.data_ptr()), dtype(t.scalar_type()) {}
  bool same() const { return t.data_ptr() == data && t.scalar_type() == dtype; }
};

// The blocks of a decoder's step and what they share, built once (see the file comment).
class StepPlan {
 public:
  StepPlan(std::vector<Block> blocks, NormKind norm, Activation act, int64_t H, int64_t G,
           int64_t D, double eps, double scale, bool gated, bool interleaved)
      : c_{norm, act, H, G, D, eps, scale, gated, interleaved}, blocks_(std::move(blocks)) {
    TORCH_CHECK(!blocks_.empty(), "blocks: expected at least one block");
    TORCH_CHECK(H > 0 && G > 0 && D > 0 && H % G == 0,
                "H, G, D: expected positive sizes with G dividing H, got ", H, ", ", G, ", ", D);
    for (const auto& b : blocks_) {
      TORCH_CHECK(b.mlp.size() == (gated ? 3u : 2u), "mlp: expected ",
                  gated ? "(gate, up, down)" : "(linear1, linear2)", ", got ", b.mlp.size(),
                  " products");
      TORCH_CHECK(b.q_norm.has_value() == b.k_norm.has_value(),
                  "q_norm, k_norm: expected both or neither");
      for (const auto* l : {&b.q, &b.k, &b.v, &b.o}) watch(*l);
      for (const auto& l : b.mlp) watch(l);
      for (const auto* t : {&b.norm1_b, &b.q_norm, &b.k_norm, &b.norm2_b})
        if (*t) seen_.emplace_back(**t);
      seen_.emplace_back(b.norm1_w);
      seen_.emplace_back(b.norm2_w);
    }
  }

  // x (B x E, contiguous, one new position a row) through every block, each block's keys and
  // values written at `offset` of its caches (B x G x >offset x D in x's dtype, last dim
  // contiguous); cos, sin: (B or 1) x 1 x R in x's dtype, or None (no RoPE); mask:
  // B x H x 1 x (offset + 1) bool (an expanded view is fine), or None. Returns None, having
  // written nothing, when a tensor of the plan was moved or changed dtype since it was built
  // (a weight re-stored, the model converted: the plan is stale) or a cache is not one the
  // step writes: then the modules must run.
  std::optional<torch::Tensor> run(const torch::Tensor& x, const std::vector<torch::Tensor>& k_caches,
                                   const std::vector<torch::Tensor>& v_caches, int64_t offset,
                                   const std::optional<torch::Tensor>& cos,
                                   const std::optional<torch::Tensor>& sin,
                                   const std::optional<torch::Tensor>& mask) const {
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: expected a contiguous B x E tensor");
    TORCH_CHECK(cos.has_value() == sin.has_value(), "cos, sin: expected both or neither");
    if (!current() || !fits(x, k_caches, offset) || !fits(x, v_caches, offset)) return std::nullopt;
    torch::Tensor h = x;
    for (size_t i = 0; i < blocks_.size(); ++i)
      h = block(c_, blocks_[i], h, offset, k_caches[i], v_caches[i], cos, sin, mask);
    return h;
  }

  // Whether every tensor of the plan still lies where it lay, in its dtype.
  bool current() const {
    for (const auto& s : seen_)
      if (!s.same()) return false;
    return true;
  }

  size_t size() const { return blocks_.size(); }

 private:
  void watch(const Linear& l) {
    seen_.emplace_back(l.w);
    for (const auto* t : {&l.s, &l.z, &l.bias})
      if (*t) seen_.emplace_back(**t);
  }

  bool fits(const torch::Tensor& x, const std::vector<torch::Tensor>& caches, int64_t offset) const {
    if (caches.size() != blocks_.size()) return false;
    for (const auto& t : caches)
      if (t.scalar_type() != x.scalar_type() || t.dim() != 4 || t.size(0) != x.size(0) ||
          t.size(1) != c_.G || t.size(3) != c_.D || t.size(2) <= offset || t.stride(3) != 1 ||
          !t.is_cpu())
        return false;
    return true;
  }

  Config c_;
  std::vector<Block> blocks_;
  std::vector<Seen> seen_;
};

}  // namespace

// The step's enums and StepPlan, added to the extension module (native_gemv.cpp's
// PYBIND11_MODULE calls this): Python takes every code from here.
void bind_step(py::module_& m) {
  py::enum_<StepKind>(m, "StepKind", "a product's kernel, named as attnlab's kernel catalogs name it")
      .value("native_gemv", StepKind::kFloat)
      .value("native_pairs", StepKind::kFloatPairs)
      .value("int8_native", StepKind::kInt8)
      .value("int4_native", StepKind::kInt4)
      .value("int4_native_pairs", StepKind::kInt4Pairs)
      .value("int8_mm", StepKind::kInt8Mm)
      .value("int4_mm", StepKind::kInt4Mm)
      .value("formula", StepKind::kFormula)
      .value("native_tiles", StepKind::kTiles)
      .value("int8_tiles", StepKind::kInt8Tiles)
      .value("int8_integers", StepKind::kInt8Integers)
      .value("int4_integers", StepKind::kInt4Integers)
      .value("int8_grouped", StepKind::kInt8Grouped);
  py::enum_<NormKind>(m, "NormKind", "a block's norm")
      .value("rms", NormKind::kRms)
      .value("rms_unit_offset", NormKind::kRmsUnitOffset)
      .value("layer_norm", NormKind::kLayerNorm);
  py::enum_<Activation>(m, "Activation", "an MLP's activation, named as attnlab.layers names it")
      .value("silu", Activation::kSilu)
      .value("gelu_tanh", Activation::kGeluTanh)
      .value("gelu", Activation::kGelu)
      .value("relu", Activation::kRelu);
  py::class_<Linear>(m, "StepLinear", "one product of a StepPlan")
      .def(py::init<StepKind, torch::Tensor, std::optional<torch::Tensor>,
                    std::optional<torch::Tensor>, int64_t, std::optional<torch::Tensor>>(),
           py::arg("kind"), py::arg("w"), py::arg("s"), py::arg("z"), py::arg("group"),
           py::arg("bias"))
      .def_readonly("kind", &Linear::kind);
  py::class_<Block>(m, "StepBlock", "one block of a StepPlan")
      .def(py::init([](torch::Tensor norm1_w, std::optional<torch::Tensor> norm1_b, Linear q,
                       Linear k, Linear v, Linear o, std::optional<torch::Tensor> q_norm,
                       std::optional<torch::Tensor> k_norm, torch::Tensor norm2_w,
                       std::optional<torch::Tensor> norm2_b, std::vector<Linear> mlp) {
             return Block{std::move(norm1_w), std::move(norm1_b), std::move(q), std::move(k),
                          std::move(v), std::move(o), std::move(q_norm), std::move(k_norm),
                          std::move(norm2_w), std::move(norm2_b), std::move(mlp)};
           }),
           py::arg("norm1_w"), py::arg("norm1_b"), py::arg("q"), py::arg("k"), py::arg("v"),
           py::arg("o"), py::arg("q_norm"), py::arg("k_norm"), py::arg("norm2_w"),
           py::arg("norm2_b"), py::arg("mlp"));
  py::class_<StepPlan>(m, "StepPlan", "a decoder's one-token step, built once")
      .def(py::init<std::vector<Block>, NormKind, Activation, int64_t, int64_t, int64_t, double,
                    double, bool, bool>(),
           py::arg("blocks"), py::arg("norm"), py::arg("activation"), py::arg("H"), py::arg("G"),
           py::arg("D"), py::arg("eps"), py::arg("scale"), py::arg("gated"),
           py::arg("interleaved"))
      .def("run", &StepPlan::run, py::arg("x"), py::arg("k_caches"), py::arg("v_caches"),
           py::arg("offset"), py::arg("cos"), py::arg("sin"), py::arg("mask"),
           // No Python object is touched inside: other Python threads run meanwhile.
           py::call_guard<py::gil_scoped_release>())
      .def("current", &StepPlan::current)
      .def("__len__", &StepPlan::size);
}
