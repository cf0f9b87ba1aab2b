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
// Each product runs the kernel that the module itself would run for these rows (the module's
// plan names it; the caller passes its kind and stored tensors): attnlab's GEMVs, PyTorch's
// packed int8/int4 ops or linear here, any other kernel called back in Python; norms, RoPE and the attention are native_decode.cpp's
// kernels, the residual adds and activations ATen's. A decoding step spends ~1-2 ms in
// Python frames and small ATen calls around 7 products per block otherwise (4 layers, 2
// cores), which is what this file saves.
#include <torch/extension.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace py = pybind11;

torch::Tensor gemv(const torch::Tensor& x, const torch::Tensor& w, const std::optional<torch::Tensor>& bias,
                   bool pairs);
torch::Tensor gemv_int8(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& s,
                        const std::optional<torch::Tensor>& bias, bool integers);
torch::Tensor gemv_int4(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& s,
                        const torch::Tensor& z, int64_t group_size, const std::optional<torch::Tensor>& bias,
                        bool pairs, bool integers);
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

// The kinds of product, as attnlab.kernels.native.STEP_KINDS names them: attnlab's GEMVs,
// PyTorch's packed int8/int4 ops (then the bias added after, as the Python kernels add it),
// the formula (linear) and the AMX tile kernels.
// kCall: any other kernel, called back in Python (the weight slot holds the callable).
enum Kind : int64_t {
  kFloat = 0, kFloatPairs = 1, kInt8 = 2, kInt4 = 3, kInt4Pairs = 4, kInt8Mm = 5, kInt4Mm = 6,
  kFormula = 7, kCall = 8, kTiles = 9, kInt8Tiles = 10, kInt8Integers = 11,
  kInt4Integers = 12
};
// The norms and activations, likewise.
enum Norm : int64_t { kRms = 0, kRmsUnitOffset = 1, kLayerNorm = 2 };
enum Act : int64_t { kSilu = 0, kGeluTanh = 1, kGelu = 2, kRelu = 3 };

std::optional<torch::Tensor> optional_tensor(py::handle h) {
  if (h.is_none()) return std::nullopt;
  return py::cast<torch::Tensor>(h);
}

// (kind, weight or codes (kCall: the callable x -> y), scales or None, zeros or None, group
// size, bias or None).
struct Linear {
  int64_t kind;
  torch::Tensor w;
  py::object call;
  std::optional<torch::Tensor> s, z, bias;
  int64_t group;

  explicit Linear(py::handle h) {
    auto t = py::cast<py::tuple>(h);
    TORCH_CHECK(t.size() == 6, "a linear: expected (kind, weight, scales, zeros, group, bias)");
    kind = py::cast<int64_t>(t[0]);
    if (kind == kCall) call = py::reinterpret_borrow<py::object>(t[1]);
    else w = py::cast<torch::Tensor>(t[1]);
    s = optional_tensor(t[2]);
    z = optional_tensor(t[3]);
    group = py::cast<int64_t>(t[4]);
    bias = optional_tensor(t[5]);
  }

  torch::Tensor biased(const torch::Tensor& y) const { return bias ? at::add(y, *bias) : y; }

  torch::Tensor operator()(const torch::Tensor& x) const {
    switch (kind) {
      case kFloat: return gemv(x, w, bias, false);
      case kFloatPairs: return gemv(x, w, bias, true);
      case kInt8: return gemv_int8(x, w, s.value(), bias, false);
      case kInt8Integers: return gemv_int8(x, w, s.value(), bias, true);
      case kInt4: return gemv_int4(x, w, s.value(), z.value(), group, bias, false, false);
      case kInt4Pairs: return gemv_int4(x, w, s.value(), z.value(), group, bias, true, false);
      case kInt4Integers: return gemv_int4(x, w, s.value(), z.value(), group, bias, false, true);
      case kInt8Mm: return biased(at::_weight_int8pack_mm(x, w, s.value()));
      case kInt4Mm: return biased(at::_weight_int4pack_mm_for_cpu(x, w, group, s.value()));
      case kFormula: return at::linear(x, w, bias);
      case kCall: return py::cast<torch::Tensor>(call(x));
      case kTiles: return gemv_tiles(x, w, bias);
      case kInt8Tiles: return gemv_int8_tiles(x, w, s.value(), bias);
    }
    TORCH_CHECK(false, "a linear: unknown kind ", kind);
  }
};

struct Config {
  int64_t norm, act, H, G, D, offset;
  double eps, scale;
  bool gated, interleaved;
};

torch::Tensor normed(const Config& c, const torch::Tensor& x, const torch::Tensor& w,
                     const std::optional<torch::Tensor>& b) {
  if (c.norm == kLayerNorm) return at::layer_norm(x, {x.size(-1)}, w, b, c.eps);
  return rms_norm(x, w, c.eps, c.norm == kRmsUnitOffset);
}

// act(x), times up when given, as attnlab.layers.feedforward.activated computes it: the
// native kernel for silu and the tanh GELU where it has its vector loop, else ATen's.
torch::Tensor activated(const Config& c, const torch::Tensor& x,
                        const std::optional<torch::Tensor>& up = std::nullopt) {
  if ((c.act == kSilu || c.act == kGeluTanh) && has_vector_activation())
    return activation(x, up, c.act);  // the same codes as native.ACTIVATIONS
  torch::Tensor h;
  switch (c.act) {
    case kSilu: h = at::silu(x); break;
    case kGeluTanh: h = at::gelu(x, "tanh"); break;
    case kGelu: h = at::gelu(x); break;
    case kRelu: h = at::relu(x); break;
    default: TORCH_CHECK(false, "act: unknown activation ", c.act);
  }
  return up ? at::mul(h, *up) : h;
}

// One block on x (B x E) whose cache holds c.offset positions; returns the new x.
torch::Tensor block(const Config& c, const torch::Tensor& x, const py::tuple& layer,
                    const std::optional<torch::Tensor>& cos, const std::optional<torch::Tensor>& sin,
                    const std::optional<torch::Tensor>& mask) {
  TORCH_CHECK(layer.size() == 13, "a layer: expected 13 entries");
  const int64_t B = x.size(0);
  const auto n1w = py::cast<torch::Tensor>(layer[0]);
  const auto n1b = optional_tensor(layer[1]);
  const Linear q_proj(layer[2]), k_proj(layer[3]), v_proj(layer[4]), o_proj(layer[5]);
  const auto q_norm = optional_tensor(layer[6]), k_norm = optional_tensor(layer[7]);
  const auto n2w = py::cast<torch::Tensor>(layer[8]);
  const auto n2b = optional_tensor(layer[9]);
  const auto mlp = py::cast<py::tuple>(layer[10]);
  const auto k_cache = py::cast<torch::Tensor>(layer[11]);
  const auto v_cache = py::cast<torch::Tensor>(layer[12]);

  const auto h = normed(c, x, n1w, n1b);
  auto q = q_proj(h).view({B, 1, c.H, c.D});
  auto k = k_proj(h).view({B, 1, c.G, c.D});
  const auto v = v_proj(h).view({B, 1, c.G, c.D});
  if (q_norm) {
    q = rms_norm(q.reshape({-1, c.D}), *q_norm, c.eps, c.norm == kRmsUnitOffset).view(q.sizes());
    k = rms_norm(k.reshape({-1, c.D}), *k_norm, c.eps, c.norm == kRmsUnitOffset).view(k.sizes());
  }
  if (cos) {
    q = rotary(q, *cos, *sin, c.interleaved);
    k = rotary(k, *cos, *sin, c.interleaved);
  }
  k_cache.select(2, c.offset).copy_(k.select(1, 0));
  v_cache.select(2, c.offset).copy_(v.select(1, 0));
  const auto keys = k_cache.narrow(2, 0, c.offset + 1);
  const auto values = v_cache.narrow(2, 0, c.offset + 1);
  const auto z = decode_attention(q.transpose(1, 2), keys, values, mask, c.scale, false);
  auto out = at::add(x, o_proj(z.transpose(1, 2).reshape({B, c.H * c.D})));

  const auto h2 = normed(c, out, n2w, n2b);
  torch::Tensor m;
  if (c.gated) {
    TORCH_CHECK(mlp.size() == 3, "mlp: expected (gate, up, down)");
    const Linear gate(mlp[0]), up(mlp[1]), down(mlp[2]);
    m = down(activated(c, gate(h2), up(h2)));
  } else {
    TORCH_CHECK(mlp.size() == 2, "mlp: expected (linear1, linear2)");
    const Linear first(mlp[0]), second(mlp[1]);
    m = second(activated(c, first(h2)));
  }
  return at::add(out, m);
}

}  // namespace

// x (B x E, one new position a row) through every layer of `layers`; see the file comment.
// cos, sin: (B or 1) x 1 x R in x's dtype, or None (no RoPE); mask: B x H x 1 x (offset + 1)
// bool (an expanded view is fine), or None.
torch::Tensor decode_layers(const torch::Tensor& x, const py::list& layers, const py::tuple& config,
                            const std::optional<torch::Tensor>& cos,
                            const std::optional<torch::Tensor>& sin,
                            const std::optional<torch::Tensor>& mask) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: expected a contiguous B x E tensor");
  TORCH_CHECK(config.size() == 10, "config: expected 10 entries");
  const Config c{py::cast<int64_t>(config[0]), py::cast<int64_t>(config[1]),
                 py::cast<int64_t>(config[2]), py::cast<int64_t>(config[3]),
                 py::cast<int64_t>(config[4]), py::cast<int64_t>(config[5]),
                 py::cast<double>(config[6]), py::cast<double>(config[7]),
                 py::cast<bool>(config[8]), py::cast<bool>(config[9])};
  torch::Tensor h = x;
  for (const auto& layer : layers) h = block(c, h, py::cast<py::tuple>(layer), cos, sin, mask);
  return h;
}
