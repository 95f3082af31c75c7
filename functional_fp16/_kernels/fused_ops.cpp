// The fused steps' CPU calls in C++: the per-tensor work of an op call, done once in a loop.
//
// The ops functional_fp16::sgd_step / adam_step / grad_stats are defined, with
// their schemas, fake kernels and vmap rules, in Python (_fused/op_library.py).
// On the CPU their Python kernel calls these private ops, which do what costs
// a Python loop per tensor: check every tensor (device, dtype, shape, strides,
// density, the vmap members' layout), allocate the outputs, collect the data
// pointers, decide the step and call the C kernels of fused_step.c (linked into
// the same library). A check that fails raises; the Python kernel then runs its
// own checks, which name the argument and the leaf.
//
// Per group k of G (leaf l of L belongs to group l / (L / G); with `members`
// stacked states per tensor, member b's leaves are groups b * G0 .. ), as in
// step_schema.py.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

extern "C" {
void ff_grad_stats(int64_t n_leaves, int64_t n_groups, void *const *grads, const int64_t *numel,
                   const int32_t *gdt, const float *inv, int32_t want_sq, int32_t threads,
                   float *peak_out, double *sq_out);
void ff_sgd_update(int64_t n_leaves, int64_t n_groups, void *const *g, float *const *m,
                   float *const *b, void *const *p, float *const *mo, float *const *bo,
                   void *const *po, const int64_t *numel, const int32_t *gdt, const int32_t *pdt,
                   const float *inv, const float *clip_div, const float *clip_mul,
                   const float *lr, const uint8_t *apply, const uint8_t *require,
                   const uint8_t *started, float weight_decay, float momentum,
                   float take_started, int32_t nesterov, int32_t threads, uint8_t *decided_out);
void ff_adam_update(int64_t n_leaves, int64_t n_groups, void *const *g, float *const *m,
                    float *const *a, float *const *v, void *const *p, float *const *mo,
                    float *const *ao, float *const *vo, void *const *po, const int64_t *numel,
                    const int32_t *gdt, const int32_t *pdt, const float *inv,
                    const float *clip_div, const float *clip_mul, const float *lr,
                    const uint8_t *apply, const float *inv_c1, const float *sqrt_c2, float l2,
                    float w, float b2, float c2, float eps, float wd, int32_t threads);
}

namespace {

using at::Tensor;
using TensorList = std::vector<Tensor>;
using OptTensor = std::optional<Tensor>;

int32_t code_of(const Tensor &t) {
  switch (t.scalar_type()) {
    case at::kFloat: return 0;
    case at::kHalf: return 1;
    case at::kBFloat16: return 2;
    default: return -1;
  }
}

// Members of a leaf tensor as consecutive blocks along its first dimension.
bool members_outermost(const Tensor &t, int64_t members) {
  if (members == 1) return true;
  return t.dim() >= 1 && t.size(0) == members &&
         (t.numel() == 0 || t.stride(0) * members == t.numel());
}

// The leaves of one list: pointers, element counts and dtype codes, member-major.
struct Leaves {
  std::vector<void *> ptr;
  std::vector<int64_t> numel;
  std::vector<int32_t> code;
  void add(const std::vector<const Tensor *> &ts, int64_t members) {
    for (int64_t b = 0; b < members; ++b)
      for (const Tensor *t : ts) {
        const int64_t n = t->numel() / members;
        ptr.push_back(static_cast<char *>(t->data_ptr()) + b * n * t->element_size());
        numel.push_back(n);
        code.push_back(code_of(*t));
      }
  }
};

void check_grads(const TensorList &g, int64_t members) {
  TORCH_CHECK(!g.empty(), "grads is empty");
  for (const Tensor &t : g) {
    TORCH_CHECK(t.defined() && t.device().is_cpu() && code_of(t) >= 0, "grads: a bad leaf");
    TORCH_CHECK(t.is_non_overlapping_and_dense(), "grads: a leaf that is not dense");
    TORCH_CHECK(members_outermost(t, members), "grads: members not outermost");
  }
}

// Every xs[i] is a CPU tensor of dtype float32 (or a stored dtype) laid out like like[i].
void check_like(const TensorList &xs, const std::vector<const Tensor *> &like, bool f32_only,
                const char *name) {
  TORCH_CHECK(xs.size() == like.size(), name, ": wrong count");
  for (size_t i = 0; i < xs.size(); ++i) {
    const Tensor &x = xs[i];
    TORCH_CHECK(x.defined() && x.device().is_cpu(), name, ": a bad leaf");
    const int32_t c = code_of(x);
    TORCH_CHECK(f32_only ? c == 0 : c >= 0, name, ": a bad dtype");
    TORCH_CHECK(x.sizes() == like[i]->sizes() && x.strides() == like[i]->strides(), name,
                ": a leaf of another layout");
  }
}

void check_group(const OptTensor &x, int64_t groups, bool is_bool, const char *name) {
  if (!x.has_value()) return;
  const Tensor &t = *x;
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == (is_bool ? at::kBool : at::kFloat) &&
                  t.dim() == 1 && t.size(0) == groups && t.is_contiguous(),
              name, ": a bad per-group scalar");
}

int64_t check_lr(const Tensor &lr, int64_t n_leaves, int64_t members) {
  TORCH_CHECK(members >= 1, "members must be positive");
  TORCH_CHECK(lr.dim() == 1 && lr.numel() >= 1 && lr.numel() % members == 0 &&
                  n_leaves % (lr.numel() / members) == 0,
              "lr: not one entry per group");
  check_group(lr, lr.numel(), false, "lr");
  return lr.numel();
}

template <typename T>
const T *ptr_or_null(const OptTensor &x) {
  return x.has_value() ? x->data_ptr<T>() : nullptr;
}

// Refuses two written tensors that share memory (the donated step writes in place).
void check_disjoint(const std::vector<const Tensor *> &ts) {
  std::vector<std::pair<uintptr_t, uintptr_t>> spans;
  spans.reserve(ts.size());
  for (const Tensor *t : ts) {
    const uintptr_t start = reinterpret_cast<uintptr_t>(t->data_ptr());
    const uintptr_t size = static_cast<uintptr_t>(t->numel() * t->element_size());
    if (size) spans.emplace_back(start, start + size);
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i)
    TORCH_CHECK(spans[i].first >= spans[i - 1].second, "written tensors share memory");
}

std::vector<const Tensor *> refs(const TensorList &xs) {
  std::vector<const Tensor *> out;
  out.reserve(xs.size());
  for (const Tensor &x : xs) out.push_back(&x);
  return out;
}

// The working copies' inputs: params where separate, else the master itself.
std::vector<const Tensor *> working(const TensorList &master, const TensorList &params,
                                    const std::vector<bool> &separate) {
  std::vector<const Tensor *> out;
  size_t j = 0;
  for (size_t i = 0; i < master.size(); ++i)
    out.push_back(separate[i] ? &params.at(j++) : &master[i]);
  return out;
}

// Outputs like `like`: the given fresh tensors (checked) or new ones.
TensorList outputs(const std::vector<const Tensor *> &like, const TensorList &fresh,
                   size_t &next) {
  TensorList out;
  out.reserve(like.size());
  for (const Tensor *t : like) {
    if (!fresh.empty()) {
      TORCH_CHECK(next < fresh.size(), "fresh: too few tensors");
      const Tensor &f = fresh[next++];
      TORCH_CHECK(f.device().is_cpu() && f.scalar_type() == t->scalar_type() &&
                      f.sizes() == t->sizes() && f.strides() == t->strides(),
                  "fresh: a tensor of another layout");
      out.push_back(f);
    } else {
      out.push_back(at::empty_strided(t->sizes(), t->strides(), t->options()));
    }
  }
  return out;
}

// Per group: isfinite(fl32(peak * inv)) and require, as grads_finite decides.
Tensor decide(const TensorList &grads, const OptTensor &inv, const OptTensor &require,
              int64_t groups, int64_t members, int32_t threads) {
  Leaves g;
  g.add(refs(grads), members);
  Tensor peak = at::empty({groups}, grads[0].options().dtype(at::kFloat));
  ff_grad_stats(static_cast<int64_t>(g.ptr.size()), groups, g.ptr.data(), g.numel.data(),
                g.code.data(), ptr_or_null<float>(inv), 0, threads, peak.data_ptr<float>(),
                nullptr);
  Tensor finite = at::empty({groups}, grads[0].options().dtype(at::kBool));
  const float *pk = peak.data_ptr<float>();
  const float *iv = ptr_or_null<float>(inv);
  const bool *rq = ptr_or_null<bool>(require);
  bool *out = finite.data_ptr<bool>();
  for (int64_t k = 0; k < groups; ++k) {
    const float scaled = iv ? pk[k] * iv[k] : pk[k];
    out[k] = std::isfinite(scaled) && (rq == nullptr || rq[k]);
  }
  return finite;
}

// The decision a step is given: apply (and require), copied.
Tensor given(const Tensor &apply, const OptTensor &require) {
  Tensor out = apply.clone();
  if (require.has_value()) {
    bool *o = out.data_ptr<bool>();
    const bool *r = require->data_ptr<bool>();
    for (int64_t k = 0; k < out.numel(); ++k) o[k] = o[k] && r[k];
  }
  return out;
}

// Checks shared by both steps; returns the number of groups.
int64_t check_common(const TensorList &grads, const TensorList &master, const TensorList &params,
                     const std::vector<bool> &separate, const OptTensor &inv,
                     const OptTensor &clip_div, const OptTensor &clip_mul, const Tensor &lr,
                     const OptTensor &apply, const OptTensor &require, int64_t members) {
  check_grads(grads, members);
  const auto g = refs(grads);
  check_like(master, g, true, "master");
  TORCH_CHECK(separate.size() == grads.size(), "separate: wrong count");
  std::vector<const Tensor *> own;
  for (size_t i = 0; i < grads.size(); ++i)
    if (separate[i]) own.push_back(g[i]);
  check_like(params, own, false, "params");
  const int64_t groups = check_lr(lr, static_cast<int64_t>(grads.size()), members);
  check_group(inv, groups, false, "inv");
  check_group(clip_div, groups, false, "clip_div");
  check_group(clip_mul, groups, false, "clip_mul");
  TORCH_CHECK(clip_div.has_value() == clip_mul.has_value(), "clip_div and clip_mul together");
  check_group(apply, groups, true, "apply");
  check_group(require, groups, true, "require");
  return groups;
}

std::tuple<TensorList, TensorList, TensorList, Tensor> sgd(
    const TensorList &grads, const TensorList &master, const TensorList &trace,
    const TensorList &params, const c10::List<bool> &separate_list, const TensorList &fresh,
    const OptTensor &inv, const OptTensor &clip_div, const OptTensor &clip_mul, const Tensor &lr,
    const OptTensor &apply, const OptTensor &require, const OptTensor &started,
    double weight_decay, double momentum, double take_started, bool nesterov, int64_t members,
    int64_t threads, bool donated) {
  const std::vector<bool> separate(separate_list.begin(), separate_list.end());
  const int64_t groups = check_common(grads, master, params, separate, inv, clip_div, clip_mul,
                                      lr, apply, require, members);
  const bool on = momentum != 0.0;
  const auto g = refs(grads);
  if (on) {
    check_like(trace, g, true, "trace");
    TORCH_CHECK(started.has_value(), "started is required with momentum");
  } else {
    TORCH_CHECK(trace.empty(), "trace must be empty without momentum");
  }
  check_group(started, groups, true, "started");
  const auto p_in = working(master, params, separate);
  TensorList m_out, t_out, p_new;
  std::vector<const Tensor *> p_out;
  if (donated) {
    std::vector<const Tensor *> written = g;
    for (const Tensor &t : master) written.push_back(&t);
    for (const Tensor &t : trace) written.push_back(&t);
    for (const Tensor &t : params) written.push_back(&t);
    check_disjoint(written);
    m_out = master, t_out = trace, p_new = params;
  } else {
    size_t next = 0;
    m_out = outputs(refs(master), fresh, next);
    t_out = outputs(refs(trace), fresh, next);
    p_new = outputs(refs(params), fresh, next);
    TORCH_CHECK(fresh.empty() || next == fresh.size(), "fresh: too many tensors");
  }
  size_t j = 0;
  for (size_t i = 0; i < master.size(); ++i) p_out.push_back(separate[i] ? &p_new[j++] : &m_out[i]);
  Tensor finite;
  OptTensor decided_out;
  const uint8_t *apply_ptr = nullptr;
  const uint8_t *require_ptr = nullptr;
  if (apply.has_value()) {
    finite = given(*apply, require);
    apply_ptr = reinterpret_cast<const uint8_t *>(finite.data_ptr<bool>());
  } else if (!donated) {  // a speculative pure step: the kernel decides and undoes
    finite = at::empty({groups}, grads[0].options().dtype(at::kBool));
    decided_out = finite;
    require_ptr = reinterpret_cast<const uint8_t *>(ptr_or_null<bool>(require));
  } else {
    finite = decide(grads, inv, require, groups, members, static_cast<int32_t>(threads));
    apply_ptr = reinterpret_cast<const uint8_t *>(finite.data_ptr<bool>());
  }
  Leaves G, M, T, P, MO, TO, PO;
  G.add(g, members), M.add(refs(master), members), P.add(p_in, members);
  MO.add(refs(m_out), members), PO.add(p_out, members);
  if (on) T.add(refs(trace), members), TO.add(refs(t_out), members);
  ff_sgd_update(static_cast<int64_t>(G.ptr.size()), groups, G.ptr.data(),
                reinterpret_cast<float *const *>(M.ptr.data()),
                on ? reinterpret_cast<float *const *>(T.ptr.data()) : nullptr, P.ptr.data(),
                reinterpret_cast<float *const *>(MO.ptr.data()),
                on ? reinterpret_cast<float *const *>(TO.ptr.data()) : nullptr, PO.ptr.data(),
                G.numel.data(), G.code.data(), PO.code.data(), ptr_or_null<float>(inv),
                ptr_or_null<float>(clip_div), ptr_or_null<float>(clip_mul), lr.data_ptr<float>(),
                apply_ptr, require_ptr,
                on ? reinterpret_cast<const uint8_t *>(started->data_ptr<bool>()) : nullptr,
                static_cast<float>(weight_decay), static_cast<float>(momentum),
                static_cast<float>(take_started), nesterov && on ? 1 : 0,
                static_cast<int32_t>(threads),
                decided_out.has_value()
                    ? reinterpret_cast<uint8_t *>(decided_out->data_ptr<bool>())
                    : nullptr);
  return {m_out, t_out, p_new, finite};
}

std::tuple<TensorList, TensorList, TensorList, TensorList, Tensor> adam(
    const TensorList &grads, const TensorList &master, const TensorList &mu, const TensorList &nu,
    const TensorList &params, const c10::List<bool> &separate_list, const TensorList &fresh,
    const OptTensor &inv, const OptTensor &clip_div, const OptTensor &clip_mul, const Tensor &lr,
    const OptTensor &apply, const OptTensor &require, const Tensor &inv_c1, const Tensor &sqrt_c2,
    double l2, double w, double b2, double c2, double eps, double decoupled, int64_t members,
    int64_t threads, bool donated) {
  const std::vector<bool> separate(separate_list.begin(), separate_list.end());
  const int64_t groups = check_common(grads, master, params, separate, inv, clip_div, clip_mul,
                                      lr, apply, require, members);
  const auto g = refs(grads);
  check_like(mu, g, true, "mu");
  check_like(nu, g, true, "nu");
  check_group(inv_c1, groups, false, "inv_c1");
  check_group(sqrt_c2, groups, false, "sqrt_c2");
  const auto p_in = working(master, params, separate);
  TensorList m_out, a_out, v_out, p_new;
  if (donated) {
    std::vector<const Tensor *> written = g;
    for (const TensorList *l : {&master, &mu, &nu, &params})
      for (const Tensor &t : *l) written.push_back(&t);
    check_disjoint(written);
    m_out = master, a_out = mu, v_out = nu, p_new = params;
  } else {
    size_t next = 0;
    m_out = outputs(refs(master), fresh, next);
    a_out = outputs(refs(mu), fresh, next);
    v_out = outputs(refs(nu), fresh, next);
    p_new = outputs(refs(params), fresh, next);
    TORCH_CHECK(fresh.empty() || next == fresh.size(), "fresh: too many tensors");
  }
  std::vector<const Tensor *> p_out;
  size_t j = 0;
  for (size_t i = 0; i < master.size(); ++i) p_out.push_back(separate[i] ? &p_new[j++] : &m_out[i]);
  Tensor finite = apply.has_value()
                      ? given(*apply, require)
                      : decide(grads, inv, require, groups, members, static_cast<int32_t>(threads));
  Leaves G, M, A, V, P, MO, AO, VO, PO;
  G.add(g, members), M.add(refs(master), members), A.add(refs(mu), members);
  V.add(refs(nu), members), P.add(p_in, members), MO.add(refs(m_out), members);
  AO.add(refs(a_out), members), VO.add(refs(v_out), members), PO.add(p_out, members);
  ff_adam_update(static_cast<int64_t>(G.ptr.size()), groups, G.ptr.data(),
                 reinterpret_cast<float *const *>(M.ptr.data()),
                 reinterpret_cast<float *const *>(A.ptr.data()),
                 reinterpret_cast<float *const *>(V.ptr.data()), P.ptr.data(),
                 reinterpret_cast<float *const *>(MO.ptr.data()),
                 reinterpret_cast<float *const *>(AO.ptr.data()),
                 reinterpret_cast<float *const *>(VO.ptr.data()), PO.ptr.data(), G.numel.data(),
                 G.code.data(), PO.code.data(), ptr_or_null<float>(inv),
                 ptr_or_null<float>(clip_div), ptr_or_null<float>(clip_mul), lr.data_ptr<float>(),
                 reinterpret_cast<const uint8_t *>(finite.data_ptr<bool>()),
                 inv_c1.data_ptr<float>(), sqrt_c2.data_ptr<float>(), static_cast<float>(l2),
                 static_cast<float>(w), static_cast<float>(b2), static_cast<float>(c2),
                 static_cast<float>(eps), static_cast<float>(decoupled),
                 static_cast<int32_t>(threads));
  return {m_out, a_out, v_out, p_new, finite};
}

std::tuple<Tensor, Tensor> grad_stats(const TensorList &grads, const OptTensor &inv,
                                      int64_t groups, int64_t members, bool sum_squares,
                                      int64_t threads) {
  check_grads(grads, members);
  TORCH_CHECK(groups >= 1 && groups % members == 0 &&
                  static_cast<int64_t>(grads.size()) % (groups / members) == 0,
              "groups do not split the leaves");
  check_group(inv, groups, false, "inv");
  Leaves g;
  g.add(refs(grads), members);
  Tensor peak = at::empty({groups}, grads[0].options().dtype(at::kFloat));
  Tensor sq = at::zeros({groups}, grads[0].options().dtype(at::kDouble));
  ff_grad_stats(static_cast<int64_t>(g.ptr.size()), groups, g.ptr.data(), g.numel.data(),
                g.code.data(), ptr_or_null<float>(inv), sum_squares ? 1 : 0,
                static_cast<int32_t>(threads), peak.data_ptr<float>(),
                sum_squares ? sq.data_ptr<double>() : nullptr);
  return {peak, sq};
}

}  // namespace

TORCH_LIBRARY(functional_fp16_cpu, m) {
  m.def(
      "sgd(Tensor[] grads, Tensor[] master, Tensor[] trace, Tensor[] params, bool[] separate, "
      "Tensor[] fresh, Tensor? inv, Tensor? clip_div, Tensor? clip_mul, Tensor lr, "
      "Tensor? apply, Tensor? require, Tensor? started, float weight_decay, float momentum, "
      "float take_started, bool nesterov, int members, int threads, bool donated) "
      "-> (Tensor[], Tensor[], Tensor[], Tensor)");
  m.def(
      "adam(Tensor[] grads, Tensor[] master, Tensor[] mu, Tensor[] nu, Tensor[] params, "
      "bool[] separate, Tensor[] fresh, Tensor? inv, Tensor? clip_div, Tensor? clip_mul, "
      "Tensor lr, Tensor? apply, Tensor? require, Tensor inv_c1, Tensor sqrt_c2, float l2, "
      "float w, float b2, float c2, float eps, float decoupled, int members, int threads, "
      "bool donated) -> (Tensor[], Tensor[], Tensor[], Tensor[], Tensor)");
  m.def(
      "grad_stats(Tensor[] grads, Tensor? inv, int groups, int members, bool sum_squares, "
      "int threads) -> (Tensor, Tensor)");
  m.impl("sgd", c10::DispatchKey::CPU, TORCH_FN(sgd));
  m.impl("adam", c10::DispatchKey::CPU, TORCH_FN(adam));
  m.impl("grad_stats", c10::DispatchKey::CPU, TORCH_FN(grad_stats));
}
