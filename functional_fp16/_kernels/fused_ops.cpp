// The fused steps' CPU calls in C++: the per-tensor work of an op call, done once in a loop.
//
// The ops functional_fp16::sgd_step / adam_step / <name>_step / grad_stats are defined, with
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
// step_schema.py. Every step returns its decision per group and, where it decided
// itself (apply not given), per leaf whether the unscaled gradient is finite (empty
// where it was given apply).

#include "fused_step.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/cos.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/zeros.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <cstring>
#include <deque>
#include <list>
#include <mutex>
#include <unordered_map>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
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
                   float take_started, int32_t nesterov, int32_t split, int32_t threads,
                   uint8_t *decided_out, uint8_t *leaf_finite_out);
void ff_adam_update(int64_t n_leaves, int64_t n_groups, void *const *g, float *const *m,
                    float *const *a, float *const *v, void *const *p, float *const *mo,
                    float *const *ao, float *const *vo, void *const *po, const int64_t *numel,
                    const int32_t *gdt, const int32_t *pdt, const float *inv,
                    const float *clip_div, const float *clip_mul, const float *lr,
                    const uint8_t *apply, const float *inv_c1, const float *sqrt_c2, float l2,
                    float w, float b2, float c2, float eps, float wd, int32_t split,
                    int32_t threads);
}

// Python's C API, declared weakly: defined where the library is loaded into a Python
// process, null where it is not (a C++ program: then no tensor has a Python object).
extern "C" {
__attribute__((weak)) int Py_IsInitialized(void);
__attribute__((weak)) int PyGILState_Ensure(void);  // returns a PyGILState_STATE
__attribute__((weak)) void PyGILState_Release(int);
}

// Whether the library found Python's GIL functions when it was loaded (then the ops
// release their inputs in one hold of the GIL; see ReleasingInputsTogether).
extern "C" int ff_releases_together(void) {
  return Py_IsInitialized != nullptr && PyGILState_Ensure != nullptr &&
         PyGILState_Release != nullptr;
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
    const size_t n = ptr.size() + ts.size() * static_cast<size_t>(members);
    ptr.reserve(n), numel.reserve(n), code.reserve(n);
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

// Refuses a written tensor that shares memory with another argument (the donated step
// writes in place): `ts` holds `n_read` tensors that are only read (the gradients, which
// may share memory with each other), then the written ones.
void check_disjoint(const std::vector<const Tensor *> &ts, size_t n_read) {
  struct Span {
    uintptr_t start, end;
    bool written;
  };
  std::vector<Span> spans;
  spans.reserve(ts.size());
  for (size_t i = 0; i < ts.size(); ++i) {
    const uintptr_t start = reinterpret_cast<uintptr_t>(ts[i]->data_ptr());
    const uintptr_t size = static_cast<uintptr_t>(ts[i]->numel() * ts[i]->element_size());
    if (size) spans.push_back({start, start + size, i >= n_read});
  }
  // By start alone: two spans that start alike overlap, in either order.
  std::sort(spans.begin(), spans.end(), [](const Span &a, const Span &b) { return a.start < b.start; });
  uintptr_t end_any = 0, end_written = 0;  // the furthest end so far, of any and of written
  for (const Span &s : spans) {
    TORCH_CHECK(s.start >= (s.written ? end_any : end_written), "written tensors share memory");
    end_any = std::max(end_any, s.end);
    if (s.written) end_written = std::max(end_written, s.end);
  }
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

// The memory of the functional steps' outputs: freed blocks kept for the next step.
//
// A pure update returns a new state in fresh memory every step. Allocated
// tensor by tensor through the dispatcher, that costs more than the update of
// a small tree; for large leaves glibc maps and faults fresh pages every step.
// The outputs come from this allocator instead (see `outputs`: a state part's
// small leaves share one block, a larger leaf takes one of its own): a block freed
// (when the last storage in it is gone) goes back to a free list by size, and the
// next request of that size takes it, as CUDA's caching allocator does. At most
// twice the bytes of the largest call are kept free, so a loop
// `state = fp16_update(state, grads)` keeps about one dropped state. A block freed
// when that much is kept already makes room by releasing the oldest free blocks: the
// blocks of a state dropped long ago (another model's, an earlier tree's sizes) never
// stop the current loop's from being kept.
class BlockCache final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    void *p = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = free_.find(n);
      if (it != free_.end()) {  // the newest of that size (no size's list is left empty)
        auto block = it->second.back();
        it->second.pop_back();
        if (it->second.empty()) free_.erase(it);
        p = block->second;
        order_.erase(block);
        cached_ -= n;
      }
    }
    if (p == nullptr) p = c10::alloc_cpu(std::max<size_t>(n, 1));
    return {p, new Block{n, p}, &BlockCache::release, c10::Device(c10::DeviceType::CPU)};
  }

  void copy_data(void *dest, const void *src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  // A call will hand out `bytes`: keep up to twice the largest such call free.
  void expect(size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    limit_ = std::max(limit_, 2 * bytes);
  }

 private:
  struct Block {
    size_t size;
    void *ptr;
  };

  static void release(void *ctx);

  using Free = std::list<std::pair<size_t, void *>>;  // (bytes, memory)

  std::mutex mutex_;
  Free order_;  // the free blocks, oldest first
  std::unordered_map<size_t, std::deque<Free::iterator>> free_;  // by size, oldest first
  size_t cached_ = 0;
  size_t limit_ = 0;

  friend BlockCache &block_cache();
  // Called by a storage's deleter: never throws. Where keeping the block would need
  // memory that is not there, the block is freed instead.
  void give_back(Block *b) noexcept {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (b->size <= limit_) {
        try {
          auto &slot = free_[b->size];
          order_.emplace_back(b->size, b->ptr);
          try {
            slot.push_back(std::prev(order_.end()));
          } catch (...) {
            order_.pop_back();
            throw;
          }
          cached_ += b->size;
          b->ptr = nullptr;
        } catch (...) {
          auto it = free_.find(b->size);
          if (it != free_.end() && it->second.empty()) free_.erase(it);
        }
        while (cached_ > limit_) {  // the oldest free blocks go (never the one just kept)
          auto [bytes, ptr] = order_.front();
          auto it = free_.find(bytes);
          it->second.pop_front();  // the oldest of its size: the same block
          if (it->second.empty()) free_.erase(it);
          order_.pop_front();
          cached_ -= bytes;
          c10::free_cpu(ptr);
        }
      }
    }
    if (b->ptr != nullptr) c10::free_cpu(b->ptr);
    delete b;
  }
};

BlockCache &block_cache() {
  static BlockCache *instance = new BlockCache();  // never destroyed: blocks may outlive teardown
  return *instance;
}

void BlockCache::release(void *ctx) { block_cache().give_back(static_cast<Block *>(ctx)); }

// The small leaves of one state part: one block from the block cache that their
// storages are carved from, given back when the last of them is freed.
struct PartBlock {
  c10::DataPtr block;
  std::atomic<size_t> users;
};

void release_leaf(void *ctx) {
  auto *part = static_cast<PartBlock *>(ctx);
  if (part->users.fetch_sub(1, std::memory_order_acq_rel) == 1) delete part;
}

// Leaves of at least this many bytes take a block of their own; smaller ones share their
// part's. A leaf kept alive keeps its part's small leaves' block, so what a kept leaf can
// hold beyond itself is bounded by the part's small leaves.
constexpr size_t kCarvedBelow = 256 * 1024;
constexpr size_t kAlign = 64;

// Outputs like `like`, in parts of the given counts (the master's leaves, each state's,
// the params'), made without a dispatcher call. Each output has a storage of its own
// holding exactly its bytes at offset 0, as one from `torch.empty` (outputs of a functional
// op never alias each other, and a checkpoint stores each leaf's bytes, no more); an
// empty one has no memory. The storages come from the block cache: a large leaf's a block
// of its own, a part's small leaves' carved, 64-byte aligned, from one block of the part
// (one look-up a part instead of one a leaf, and the leaves side by side in memory).
TensorList outputs(const std::vector<const Tensor *> &like, const std::vector<size_t> &parts) {
  const c10::Device cpu(c10::DeviceType::CPU);
  auto padded = [](size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; };
  auto carved = [](size_t bytes) { return bytes > 0 && bytes < kCarvedBelow; };
  std::vector<size_t> bytes(like.size());
  size_t total = 0;
  for (size_t i = 0; i < like.size(); ++i) {
    TORCH_INTERNAL_ASSERT(like[i]->is_non_overlapping_and_dense());
    bytes[i] = static_cast<size_t>(like[i]->numel()) * like[i]->element_size();
    total += padded(bytes[i]);
  }
  BlockCache &cache = block_cache();
  cache.expect(total);
  TensorList out;
  out.reserve(like.size());
  size_t first = 0;
  for (size_t count : parts) {
    TORCH_CHECK(first + count <= like.size(), "outputs: parts beyond the tensors");
    size_t small = 0;
    for (size_t i = first; i < first + count; ++i)
      if (carved(bytes[i])) small += padded(bytes[i]);
    // The part's block is held by `hold` (one user) while its leaves are made; each
    // carved leaf adds a user before its storage takes it, so a throw frees what it must.
    PartBlock *part = small ? new PartBlock{cache.allocate(small), 1} : nullptr;
    std::unique_ptr<PartBlock, void (*)(PartBlock *)> hold(part, [](PartBlock *b) {
      if (b != nullptr) release_leaf(b);
    });
    char *base = part ? static_cast<char *>(part->block.get()) : nullptr;
    for (size_t i = first; i < first + count; ++i) {
      const Tensor *t = like[i];
      c10::DataPtr data(nullptr, cpu);  // empty: no memory
      if (carved(bytes[i])) {
        part->users.fetch_add(1, std::memory_order_relaxed);
        data = c10::DataPtr(base, part, &release_leaf, cpu);
        base += padded(bytes[i]);
      } else if (bytes[i] > 0) {
        data = cache.allocate(bytes[i]);
      }
      c10::Storage storage(c10::Storage::use_byte_size_t(), bytes[i], std::move(data), &cache,
                           false);
      auto impl = c10::make_intrusive<c10::TensorImpl>(std::move(storage), t->key_set(), t->dtype());
      impl->set_sizes_and_strides(t->sizes(), t->strides());
      out.emplace_back(std::move(impl));
    }
    first += count;
  }
  TORCH_CHECK(first == like.size(), "outputs: parts short of the tensors");
  return out;
}

// A pure step's new tensors like `lists` (the master, each optimiser state, the params,
// ...), one list of outputs for each. A list of whole runs of `n` (the master, a state
// list holding several states state-major) is a part per run, any other one part.
std::vector<TensorList> fresh_like(size_t n, std::initializer_list<const TensorList *> lists) {
  std::vector<const Tensor *> like;
  std::vector<size_t> parts;
  for (const TensorList *l : lists) {
    for (const Tensor &t : *l) like.push_back(&t);
    if (n > 0 && l->size() % n == 0)
      parts.insert(parts.end(), l->size() / n, n);
    else
      parts.push_back(l->size());
  }
  const TensorList all = outputs(like, parts);
  std::vector<TensorList> out;
  auto from = all.begin();
  for (const TensorList *l : lists) {
    out.emplace_back(from, from + static_cast<std::ptrdiff_t>(l->size()));
    from += static_cast<std::ptrdiff_t>(l->size());
  }
  return out;
}

// A step's decision: per group whether it applies, and per leaf (members * L of them,
// member-major) whether its unscaled gradient is finite; empty where the step was given
// its decision and did not look.
struct Decided {
  Tensor finite;
  Tensor leaves;
};

// Per leaf l of group k: isfinite(fl32(peak_l * inv[k])); per group: the AND of its
// leaves' flags and require, as grads_finite decides (rounding is monotonic, so the AND
// is isfinite(fl32(max peak * inv))).
Decided decide(const TensorList &grads, const OptTensor &inv, const OptTensor &require,
               int64_t groups, int64_t members, int32_t threads) {
  Leaves g;
  g.add(refs(grads), members);
  const int64_t n = static_cast<int64_t>(g.ptr.size());
  Tensor peak = at::empty({n}, grads[0].options().dtype(at::kFloat));
  ff_grad_stats(n, groups, g.ptr.data(), g.numel.data(), g.code.data(), ptr_or_null<float>(inv),
                0, threads, peak.data_ptr<float>(), nullptr);
  Tensor finite = at::empty({groups}, grads[0].options().dtype(at::kBool));
  Tensor leaves = at::empty({n}, grads[0].options().dtype(at::kBool));
  const float *pk = peak.data_ptr<float>();
  const float *iv = ptr_or_null<float>(inv);
  const bool *rq = ptr_or_null<bool>(require);
  bool *out = finite.data_ptr<bool>();
  bool *lf = leaves.data_ptr<bool>();
  const int64_t per_group = n / groups;
  for (int64_t k = 0; k < groups; ++k) out[k] = rq == nullptr || rq[k];
  for (int64_t l = 0; l < n; ++l) {
    const int64_t k = l / per_group;
    const float scaled = iv ? pk[l] * iv[k] : pk[l];
    lf[l] = std::isfinite(scaled);
    out[k] = out[k] && lf[l];
  }
  return {finite, leaves};
}

// The decision a step is given: apply (and require), copied; no leaf flags.
Decided given(const Tensor &apply, const OptTensor &require) {
  Tensor out = apply.clone();
  if (require.has_value()) {
    bool *o = out.data_ptr<bool>();
    const bool *r = require->data_ptr<bool>();
    for (int64_t k = 0; k < out.numel(); ++k) o[k] = o[k] && r[k];
  }
  return {out, at::empty({0}, apply.options())};
}

// Whether the master list holds int16 residuals of a split master (master_split.py).
bool is_split(const TensorList &master) {
  return !master.empty() && master[0].scalar_type() == at::kShort;
}

// Checks shared by both steps; returns the number of groups.
int64_t check_common(const TensorList &grads, const TensorList &master, const TensorList &params,
                     const std::vector<bool> &separate, const OptTensor &inv,
                     const OptTensor &clip_div, const OptTensor &clip_mul, const Tensor &lr,
                     const OptTensor &apply, const OptTensor &require, int64_t members) {
  check_grads(grads, members);
  const auto g = refs(grads);
  TORCH_CHECK(separate.size() == grads.size(), "separate: wrong count");
  if (is_split(master)) {  // int16 residuals beside float16 working copies
    TORCH_CHECK(master.size() == g.size(), "master: wrong count");
    for (size_t i = 0; i < master.size(); ++i) {
      const Tensor &x = master[i];
      TORCH_CHECK(x.defined() && x.device().is_cpu() && x.scalar_type() == at::kShort &&
                      x.sizes() == g[i]->sizes() && x.strides() == g[i]->strides(),
                  "master: a bad residual");
      TORCH_CHECK(separate[i], "master: a split master needs every working copy");
    }
    for (const Tensor &p : params)
      TORCH_CHECK(p.scalar_type() == at::kHalf, "params: a split master needs float16 params");
  } else {
    check_like(master, g, true, "master");
  }
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

std::tuple<TensorList, TensorList, TensorList, Tensor, Tensor> sgd(
    const TensorList &grads, const TensorList &master, const TensorList &trace,
    const TensorList &params, const c10::List<bool> &separate_list,
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
    check_disjoint(written, g.size());
    m_out = master, t_out = trace, p_new = params;
  } else {
    auto fresh = fresh_like(master.size(), {&master, &trace, &params});
    m_out = std::move(fresh[0]), t_out = std::move(fresh[1]), p_new = std::move(fresh[2]);
  }
  size_t j = 0;
  for (size_t i = 0; i < master.size(); ++i) p_out.push_back(separate[i] ? &p_new[j++] : &m_out[i]);
  Decided d;
  bool speculative = false;
  const uint8_t *apply_ptr = nullptr;
  const uint8_t *require_ptr = nullptr;
  if (apply.has_value()) {
    d = given(*apply, require);
    apply_ptr = reinterpret_cast<const uint8_t *>(d.finite.data_ptr<bool>());
  } else if (!donated) {  // a speculative pure step: the kernel decides and undoes
    speculative = true;
    d.finite = at::empty({groups}, grads[0].options().dtype(at::kBool));
    d.leaves = at::empty({static_cast<int64_t>(grads.size()) * members},
                         grads[0].options().dtype(at::kBool));
    require_ptr = reinterpret_cast<const uint8_t *>(ptr_or_null<bool>(require));
  } else {
    d = decide(grads, inv, require, groups, members, static_cast<int32_t>(threads));
    apply_ptr = reinterpret_cast<const uint8_t *>(d.finite.data_ptr<bool>());
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
                is_split(master) ? 1 : 0, static_cast<int32_t>(threads),
                speculative ? reinterpret_cast<uint8_t *>(d.finite.data_ptr<bool>()) : nullptr,
                speculative ? reinterpret_cast<uint8_t *>(d.leaves.data_ptr<bool>()) : nullptr);
  if (donated) return {{}, {}, {}, d.finite, d.leaves};  // written in place
  return {m_out, t_out, p_new, d.finite, d.leaves};
}

std::tuple<TensorList, TensorList, TensorList, TensorList, Tensor, Tensor> adam(
    const TensorList &grads, const TensorList &master, const TensorList &mu, const TensorList &nu,
    const TensorList &params, const c10::List<bool> &separate_list,
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
    check_disjoint(written, g.size());
    m_out = master, a_out = mu, v_out = nu, p_new = params;
  } else {
    auto fresh = fresh_like(master.size(), {&master, &mu, &nu, &params});
    m_out = std::move(fresh[0]), a_out = std::move(fresh[1]), v_out = std::move(fresh[2]);
    p_new = std::move(fresh[3]);
  }
  std::vector<const Tensor *> p_out;
  size_t j = 0;
  for (size_t i = 0; i < master.size(); ++i) p_out.push_back(separate[i] ? &p_new[j++] : &m_out[i]);
  const Decided d =
      apply.has_value()
          ? given(*apply, require)
          : decide(grads, inv, require, groups, members, static_cast<int32_t>(threads));
  const Tensor &finite = d.finite;
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
                 is_split(master) ? 1 : 0, static_cast<int32_t>(threads));
  if (donated) return {{}, {}, {}, {}, finite, d.leaves};  // written in place
  return {m_out, a_out, v_out, p_new, finite, d.leaves};
}

// Any step of fused_step.h's convention, found by name: `states` holds the
// optimiser's per-parameter states state-major (state j of leaf l at
// j * n_leaves + l), `scalars` its per-group float32 scalars, `hyper` its fixed
// hyperparameters in declared order.
std::tuple<TensorList, TensorList, TensorList, Tensor, Tensor> step(
    c10::string_view name, const TensorList &grads, const TensorList &master,
    const TensorList &states, const TensorList &params, const c10::List<bool> &separate_list,
    const OptTensor &inv, const OptTensor &clip_div, const OptTensor &clip_mul, const Tensor &lr,
    const OptTensor &apply, const OptTensor &require, const TensorList &scalars,
    c10::ArrayRef<double> hyper, int64_t members, int64_t threads, bool donated) {
  const std::string key(name);
  const ff_step_fn fn = ff_step_entry(key.c_str());
  TORCH_CHECK(fn != nullptr, "no fused step named ", key);
  const std::vector<bool> separate(separate_list.begin(), separate_list.end());
  const int64_t groups = check_common(grads, master, params, separate, inv, clip_div, clip_mul,
                                      lr, apply, require, members);
  const auto g = refs(grads);
  const size_t n = grads.size();
  TORCH_CHECK(states.size() % n == 0, "states: not a whole number of lists");
  const size_t n_states = states.size() / n;
  int32_t min_states = 0, max_states = 0, n_hyper = 0;
  TORCH_CHECK(ff_step_arity(key.c_str(), &min_states, &max_states, &n_hyper) && n_hyper >= 0,
              "no step named ", key, " takes this op's arguments");
  TORCH_CHECK(static_cast<int64_t>(n_states) >= min_states &&
                  static_cast<int64_t>(n_states) <= max_states,
              "states: ", n_states, " lists, expected ", min_states, " to ", max_states);
  TORCH_CHECK(static_cast<int64_t>(hyper.size()) == n_hyper, "hyper: ", hyper.size(),
              " values, expected ", n_hyper);
  for (size_t j = 0; j < n_states; ++j) {
    const TensorList slice(states.begin() + j * n, states.begin() + (j + 1) * n);
    check_like(slice, g, true, "states");
  }
  for (const Tensor &t : scalars) check_group(t, groups, false, "scalars");
  const auto p_in = working(master, params, separate);
  TensorList m_out, s_out, p_new;
  if (donated) {
    std::vector<const Tensor *> written = g;
    for (const TensorList *l : {&master, &states, &params})
      for (const Tensor &t : *l) written.push_back(&t);
    check_disjoint(written, g.size());
    m_out = master, s_out = states, p_new = params;
  } else {
    auto fresh = fresh_like(n, {&master, &states, &params});
    m_out = std::move(fresh[0]), s_out = std::move(fresh[1]), p_new = std::move(fresh[2]);
  }
  std::vector<const Tensor *> p_out;
  size_t k = 0;
  for (size_t i = 0; i < n; ++i) p_out.push_back(separate[i] ? &p_new[k++] : &m_out[i]);
  const Decided d =
      apply.has_value()
          ? given(*apply, require)
          : decide(grads, inv, require, groups, members, static_cast<int32_t>(threads));
  const Tensor &finite = d.finite;
  Leaves G, M, P, MO, PO;
  G.add(g, members), M.add(refs(master), members), P.add(p_in, members);
  MO.add(refs(m_out), members), PO.add(p_out, members);
  std::vector<Leaves> S(n_states), SO(n_states);
  std::vector<float *const *> s_ptr, so_ptr;
  for (size_t j = 0; j < n_states; ++j) {
    std::vector<const Tensor *> in, out;
    for (size_t i = 0; i < n; ++i) in.push_back(&states[j * n + i]), out.push_back(&s_out[j * n + i]);
    S[j].add(in, members), SO[j].add(out, members);
    s_ptr.push_back(reinterpret_cast<float *const *>(S[j].ptr.data()));
    so_ptr.push_back(reinterpret_cast<float *const *>(SO[j].ptr.data()));
  }
  std::vector<const float *> sc;
  for (const Tensor &t : scalars) sc.push_back(t.data_ptr<float>());
  ff_step_args x{};
  x.n_leaves = static_cast<int64_t>(G.ptr.size());
  x.n_groups = groups;
  x.n_states = static_cast<int32_t>(n_states);
  x.n_scalars = static_cast<int32_t>(scalars.size());
  x.n_hyper = static_cast<int32_t>(hyper.size());
  x.threads = static_cast<int32_t>(threads);
  x.g = G.ptr.data();
  x.m = reinterpret_cast<float *const *>(M.ptr.data());
  x.s = s_ptr.data();
  x.p = P.ptr.data();
  x.mo = reinterpret_cast<float *const *>(MO.ptr.data());
  x.so = so_ptr.data();
  x.po = PO.ptr.data();
  x.numel = G.numel.data();
  x.gdt = G.code.data();
  x.pdt = PO.code.data();
  x.inv = ptr_or_null<float>(inv);
  x.clip_div = ptr_or_null<float>(clip_div);
  x.clip_mul = ptr_or_null<float>(clip_mul);
  x.lr = lr.data_ptr<float>();
  x.apply = reinterpret_cast<const uint8_t *>(finite.data_ptr<bool>());
  x.scalars = sc.data();
  x.hyper = hyper.data();
  x.split = is_split(master) ? 1 : 0;
  fn(&x);
  if (donated) return {{}, {}, {}, finite, d.leaves};  // written in place
  return {m_out, s_out, p_new, finite, d.leaves};
}

// The storage code of a moment tensor (fused_step.c's ST_*): float32, float16, bfloat16,
// or uint8 (E4M3 block codes); -1 for anything else.
int32_t stored_code(const Tensor &t) {
  switch (t.scalar_type()) {
    case at::kFloat: return 0;
    case at::kHalf: return 1;
    case at::kBFloat16: return 2;
    case at::kByte: return 3;
    default: return -1;
  }
}

// Any step with stored states (fused_step.c's stored steps, found by name: "adam_stored",
// "lion_stored"): `states` holds its per-parameter states state-major (state j of leaf
// l at j * n_leaves + l), each float32, float16, bfloat16 or uint8 E4M3 codes laid out like
// the leaf; `scales` the float32 block scales of the coded ones, state-major and in leaf
// order, each (members x) rows x blocks per row; `root` the state coded through its square
// root (-1: none); `scalars` the optimiser's per-group float32 scalars, `count` each
// group's step count (int64), `hyper` its fixed hyperparameters in declared order.
std::tuple<TensorList, TensorList, TensorList, TensorList, Tensor, Tensor> stored_step(
    c10::string_view name, const TensorList &grads, const TensorList &master,
    const TensorList &states, const TensorList &scales, const TensorList &params,
    const c10::List<bool> &separate_list, const OptTensor &inv, const OptTensor &clip_div,
    const OptTensor &clip_mul, const Tensor &lr, const OptTensor &apply,
    const OptTensor &require, const TensorList &scalars, const Tensor &count,
    c10::ArrayRef<double> hyper, int64_t block_size, int64_t rounding, int64_t root,
    c10::ArrayRef<int64_t> salt_ids, int64_t members, int64_t threads, bool donated) {
  const std::string key(name);
  const ff_step_fn fn = ff_step_entry(key.c_str());
  TORCH_CHECK(fn != nullptr, "no fused step named ", key);
  const std::vector<bool> separate(separate_list.begin(), separate_list.end());
  const int64_t groups = check_common(grads, master, params, separate, inv, clip_div, clip_mul,
                                      lr, apply, require, members);
  const auto g = refs(grads);
  const size_t n = grads.size();
  TORCH_CHECK(block_size >= 1 && (block_size & (block_size - 1)) == 0, "block_size");
  TORCH_CHECK(rounding == 0 || rounding == 1, "rounding");
  TORCH_CHECK(salt_ids.size() == n, "salt_ids: one per leaf");
  TORCH_CHECK(!states.empty() && states.size() % n == 0 && states.size() / n <= 2,
              "states: one or two lists of one per leaf");
  const size_t n_states = states.size() / n;
  TORCH_CHECK(root == -1 || root == static_cast<int64_t>(n_states) - 1, "root");
  for (const Tensor &t : scalars) check_group(t, groups, false, "scalars");
  TORCH_CHECK(count.device().is_cpu() && count.scalar_type() == at::kLong && count.dim() == 1 &&
                  count.size(0) == groups && count.is_contiguous(),
              "count: a bad per-group scalar");
  std::vector<int64_t> rows(n, 1);
  // scale_of[j][i]: the index in `scales` of state j's leaf i's (-1: not coded)
  std::vector<std::vector<int64_t>> scale_of(n_states, std::vector<int64_t>(n, -1));
  size_t next = 0;
  for (size_t j = 0; j < n_states; ++j) {
    for (size_t i = 0; i < n; ++i) {
      const Tensor &x = states[j * n + i], &gi = grads[i];
      TORCH_CHECK(x.defined() && x.device().is_cpu() && stored_code(x) >= 0,
                  "states: a bad leaf");
      TORCH_CHECK(x.sizes() == gi.sizes() && x.strides() == gi.strides(),
                  "states: a leaf of another layout");
      if (stored_code(x) != 3) continue;
      TORCH_CHECK(next < scales.size(), "scales: fewer than the coded states");
      const Tensor &sc = scales[next];
      TORCH_CHECK(sc.defined() && sc.device().is_cpu() && sc.scalar_type() == at::kFloat &&
                      sc.is_contiguous(), "scales: a bad leaf");
      const int64_t lead = members == 1 ? 0 : 1;
      TORCH_CHECK(gi.dim() >= lead + 2 && gi.is_contiguous(), "codes: not a dense matrix");
      const int64_t r = gi.size(lead);
      const int64_t len = r ? gi.numel() / members / r : 0;
      TORCH_CHECK(sc.numel() == members * r * ((len + block_size - 1) / block_size),
                  "scales: not one per block");
      TORCH_CHECK(rows[i] == 1 || rows[i] == r, "codes: rows");
      rows[i] = r;
      scale_of[j][i] = static_cast<int64_t>(next++);
    }
  }
  TORCH_CHECK(next == scales.size(), "scales: more than the coded states");
  const auto p_in = working(master, params, separate);
  TensorList m_out, s_out, sc_out, p_new;
  if (donated) {
    std::vector<const Tensor *> written = g;
    for (const TensorList *l : {&master, &states, &scales, &params})
      for (const Tensor &t : *l) written.push_back(&t);
    check_disjoint(written, g.size());
    m_out = master, s_out = states, sc_out = scales, p_new = params;
  } else {
    auto fresh = fresh_like(n, {&master, &states, &scales, &params});
    m_out = std::move(fresh[0]), s_out = std::move(fresh[1]), sc_out = std::move(fresh[2]);
    p_new = std::move(fresh[3]);
  }
  std::vector<const Tensor *> p_out;
  size_t k = 0;
  for (size_t i = 0; i < n; ++i) p_out.push_back(separate[i] ? &p_new[k++] : &m_out[i]);
  const Decided d =
      apply.has_value()
          ? given(*apply, require)
          : decide(grads, inv, require, groups, members, static_cast<int32_t>(threads));
  Leaves G, M, P, MO, PO;
  G.add(g, members), M.add(refs(master), members), P.add(p_in, members);
  MO.add(refs(m_out), members), PO.add(p_out, members);
  std::vector<Leaves> S(n_states), SO(n_states);
  std::vector<std::vector<int32_t>> codes(n_states);
  std::vector<std::vector<float *>> sc_in(n_states), sc_o(n_states);
  std::vector<int64_t> rows_all;
  for (size_t j = 0; j < n_states; ++j) {
    std::vector<const Tensor *> in, out;
    for (size_t i = 0; i < n; ++i) in.push_back(&states[j * n + i]), out.push_back(&s_out[j * n + i]);
    S[j].add(in, members), SO[j].add(out, members);
  }
  for (int64_t b = 0; b < members; ++b)
    for (size_t i = 0; i < n; ++i) {
      rows_all.push_back(rows[i]);
      for (size_t j = 0; j < n_states; ++j) {
        codes[j].push_back(stored_code(states[j * n + i]));
        float *pin = nullptr, *pout = nullptr;
        if (scale_of[j][i] >= 0) {
          const Tensor &t = scales[scale_of[j][i]], &o = sc_out[scale_of[j][i]];
          pin = t.data_ptr<float>() + b * (t.numel() / members);
          pout = o.data_ptr<float>() + b * (o.numel() / members);
        }
        sc_in[j].push_back(pin), sc_o[j].push_back(pout);
      }
    }
  std::vector<float *const *> s_ptr, so_ptr;
  std::vector<float *const *> sc_ptr, sco_ptr;
  std::vector<const int32_t *> sdt;
  for (size_t j = 0; j < n_states; ++j) {
    s_ptr.push_back(reinterpret_cast<float *const *>(S[j].ptr.data()));
    so_ptr.push_back(reinterpret_cast<float *const *>(SO[j].ptr.data()));
    sc_ptr.push_back(sc_in[j].data()), sco_ptr.push_back(sc_o[j].data());
    sdt.push_back(codes[j].data());
  }
  std::vector<const float *> sc;
  for (const Tensor &t : scalars) sc.push_back(t.data_ptr<float>());
  ff_step_args x{};
  x.n_leaves = static_cast<int64_t>(G.ptr.size());
  x.n_groups = groups;
  x.n_states = static_cast<int32_t>(n_states);
  x.n_scalars = static_cast<int32_t>(scalars.size());
  x.n_hyper = static_cast<int32_t>(hyper.size());
  x.threads = static_cast<int32_t>(threads);
  x.g = G.ptr.data();
  x.m = reinterpret_cast<float *const *>(M.ptr.data());
  x.s = s_ptr.data();
  x.p = P.ptr.data();
  x.mo = reinterpret_cast<float *const *>(MO.ptr.data());
  x.so = so_ptr.data();
  x.po = PO.ptr.data();
  x.numel = G.numel.data();
  x.gdt = G.code.data();
  x.pdt = PO.code.data();
  x.inv = ptr_or_null<float>(inv);
  x.clip_div = ptr_or_null<float>(clip_div);
  x.clip_mul = ptr_or_null<float>(clip_mul);
  x.lr = lr.data_ptr<float>();
  x.apply = reinterpret_cast<const uint8_t *>(d.finite.data_ptr<bool>());
  x.scalars = sc.data();
  x.hyper = hyper.data();
  x.sdt = sdt.data();
  x.sc = sc_ptr.data();
  x.sco = sco_ptr.data();
  x.rows = rows_all.data();
  x.salt_ids = salt_ids.data();
  x.counts = count.data_ptr<int64_t>();
  x.block_size = block_size;
  x.n_members = members;
  x.rounding = static_cast<int32_t>(rounding);
  x.root = root >= 0 ? 1 : 0;
  x.split = is_split(master) ? 1 : 0;
  fn(&x);
  if (donated) return {{}, {}, {}, {}, d.finite, d.leaves};  // written in place
  return {m_out, s_out, sc_out, p_new, d.finite, d.leaves};
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
  Tensor peak = at::empty({static_cast<int64_t>(g.ptr.size())}, grads[0].options().dtype(at::kFloat));
  Tensor sq = at::zeros({groups}, grads[0].options().dtype(at::kDouble));
  ff_grad_stats(static_cast<int64_t>(g.ptr.size()), groups, g.ptr.data(), g.numel.data(),
                g.code.data(), ptr_or_null<float>(inv), sum_squares ? 1 : 0,
                static_cast<int32_t>(threads), peak.data_ptr<float>(),
                sum_squares ? sq.data_ptr<double>() : nullptr);
  return {peak, sq};
}

// ---------------------------------------------------------------------------
// The bookkeeping of one update (precision/bookkeeping.py has the reference and the math),
// elementwise over any shape: every tensor has the finite flag's numel, dense.
// ---------------------------------------------------------------------------

// fl32(s * f) from the exact product: directly for a power-of-two factor, else through
// a double (as loss_scale._times computes it).
static inline float times(float s, double f, bool pow2) {
  return pow2 ? s * static_cast<float>(f) : static_cast<float>(static_cast<double>(s) * f);
}

static inline int32_t wrap_add(int32_t a, int32_t b) {
  return static_cast<int32_t>(static_cast<uint32_t>(a) + static_cast<uint32_t>(b));
}

static void check_like(const Tensor &x, const Tensor &like, at::ScalarType dt, const char *what) {
  TORCH_CHECK(x.device() == like.device() && x.scalar_type() == dt && x.numel() == like.numel() &&
                  x.is_contiguous(),
              what, ": expected a dense ", c10::toString(dt), " tensor of ", like.numel(),
              " elements on ", like.device());
}

// config: growth_factor, backoff_factor, growth_interval, min_scale, max_scale, hysteresis.
// kind 0: a dynamic scale (scale fields: scale, growth count, hysteresis count); 1: a
// fixed one (the scale alone, kept).
std::tuple<std::vector<Tensor>, std::vector<Tensor>, Tensor, Tensor, std::vector<Tensor>> bookkeeping(
    const Tensor &finite, const TensorList &scale, const TensorList &stats, const Tensor &step,
    const TensorList &counters, c10::ArrayRef<double> config, int64_t kind) {
  TORCH_CHECK(finite.scalar_type() == at::kBool && finite.is_contiguous(), "finite: a dense bool tensor");
  TORCH_CHECK(kind == 0 || kind == 1, "kind: 0 or 1");
  TORCH_CHECK(scale.size() == (kind == 0 ? 3u : 1u), "scale: 3 tensors (dynamic) or 1 (fixed)");
  TORCH_CHECK(stats.size() == 4, "stats: 4 counters");
  TORCH_CHECK(config.size() == 6, "config: 6 numbers");
  check_like(scale[0], finite, at::kFloat, "scale");
  for (size_t i = 1; i < scale.size(); ++i) check_like(scale[i], finite, at::kInt, "scale counters");
  for (const auto &t : stats) check_like(t, finite, at::kInt, "stats");
  check_like(step, finite, at::kInt, "step");
  for (const auto &t : counters) {
    TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kBool, "counters: int32 or bool");
    check_like(t, finite, t.scalar_type(), "counters");
  }
  auto fresh = [](const Tensor &t) { return at::empty_like(t, at::MemoryFormat::Contiguous); };
  std::vector<Tensor> scale_out, stats_out, counters_out;
  for (const auto &t : scale) scale_out.push_back(fresh(t));
  for (const auto &t : stats) stats_out.push_back(fresh(t));
  for (const auto &t : counters) counters_out.push_back(fresh(t));
  Tensor step_out = fresh(step);
  Tensor inv_out = fresh(scale[0]);  // fl32(1 / fl64(s')): the next update's unscale factor

  const double gf = config[0], bf = config[1], max_scale = config[4];
  const double interval = config[2];  // compared exactly with an int32 count
  TORCH_CHECK(kind == 1 || (config[5] >= 1 && config[5] <= INT32_MAX), "hysteresis: an int32 >= 1");
  const int32_t hysteresis = static_cast<int32_t>(config[5]);
  int e = 0;
  const bool gf_pow2 = std::frexp(gf, &e) == 0.5, bf_pow2 = std::frexp(bf, &e) == 0.5;
  const double f32_max = 3.4028234663852886e38, f32_overflow = 3.4028235677973366e38;
  const bool unbounded = max_scale >= f32_overflow;  // no float32 bound: an overflow keeps s
  const float cap = static_cast<float>(std::min(max_scale, f32_max));
  const float floor_ = static_cast<float>(config[3]);

  const bool *fin = finite.data_ptr<bool>();
  const float *s_in = scale[0].data_ptr<float>();
  float *s_out = scale_out[0].data_ptr<float>();
  const int32_t *gc_in = kind == 0 ? scale[1].data_ptr<int32_t>() : nullptr;
  const int32_t *hc_in = kind == 0 ? scale[2].data_ptr<int32_t>() : nullptr;
  int32_t *gc_out = kind == 0 ? scale_out[1].data_ptr<int32_t>() : nullptr;
  int32_t *hc_out = kind == 0 ? scale_out[2].data_ptr<int32_t>() : nullptr;
  const int32_t *st_in[4];
  int32_t *st_out[4];
  for (int k = 0; k < 4; ++k) {
    st_in[k] = stats[k].data_ptr<int32_t>();
    st_out[k] = stats_out[k].data_ptr<int32_t>();
  }
  const int32_t *step_in = step.data_ptr<int32_t>();
  int32_t *step_new = step_out.data_ptr<int32_t>();
  float *inv = inv_out.data_ptr<float>();
  const int64_t n = finite.numel();
  for (int64_t i = 0; i < n; ++i) {
    const bool f = fin[i];
    const float s = s_in[i];
    float s_new = s;
    if (kind == 0) {
      const int32_t count = wrap_add(gc_in[i], 1), hc = hc_in[i];
      const bool grow = static_cast<double>(count) >= interval;
      float grown = times(s, gf, gf_pow2);
      if (unbounded)
        grown = std::isfinite(grown) ? grown : s;
      else
        grown = grown < cap ? grown : cap;
      const int32_t hyst_over = std::max(wrap_add(hc, -1), 0);
      float backed = times(s, bf, bf_pow2);
      backed = backed > floor_ ? backed : floor_;
      s_new = f ? (grow ? grown : s) : (hyst_over <= 0 ? backed : s);
      gc_out[i] = f ? (grow ? 0 : count) : 0;
      hc_out[i] = f ? (grow ? hysteresis : hc) : hyst_over;
    }
    s_out[i] = s_new;
    inv[i] = static_cast<float>(1.0 / static_cast<double>(s_new));
    st_out[0][i] = wrap_add(st_in[0][i], f ? 0 : 1);
    st_out[1][i] = wrap_add(st_in[1][i], s_new > s ? 1 : 0);
    st_out[2][i] = wrap_add(st_in[2][i], s_new < s ? 1 : 0);
    st_out[3][i] = f ? wrap_add(st_in[3][i], 1) : 0;
    step_new[i] = wrap_add(step_in[i], 1);
    for (size_t k = 0; k < counters.size(); ++k) {
      if (counters[k].scalar_type() == at::kBool) {
        counters_out[k].data_ptr<bool>()[i] = counters[k].data_ptr<bool>()[i] || f;
      } else {
        const int32_t c = counters[k].data_ptr<int32_t>()[i];
        counters_out[k].data_ptr<int32_t>()[i] = f && c < INT32_MAX ? c + 1 : c;
      }
    }
  }
  return {scale_out, stats_out, step_out, inv_out, counters_out};
}


// ---------------------------------------------------------------------------
// The scalars a step needs before it runs (_fused/step_scalars.py has the reference and
// the math): the decision from the leaves' peaks, the clip factors from the sum of
// squares, and each declared schedule's value, per member.
// ---------------------------------------------------------------------------

// torch.pow(x, e) for a float64 tensor and a Python float e, as ATen's CPU kernel takes it.
static double pow_scalar(double x, double e) {
  if (e == 0.0) return 1.0;
  if (e == 1.0) return x;
  if (e == 0.5) return std::sqrt(x);
  if (e == -0.5) return 1.0 / std::sqrt(x);
  if (e == -1.0) return 1.0 / x;
  if (e == 2.0) return x * x;
  if (e == 3.0) return x * x * x;
  if (e == -2.0) return 1.0 / (x * x);
  return std::pow(x, e);
}

static inline double clamp_to(double x, double lo, double hi) { return std::min(std::max(x, lo), hi); }

// torch.cos of a 0-d float64 CPU tensor: ATen's own kernel (its vectorised cosine, which
// differs from the C library's in the last bit for some arguments), so that the schedule
// is bitwise its definition.
static double aten_cos(double x) {
  return at::cos(at::scalar_tensor(x, at::TensorOptions().dtype(at::kDouble))).item<double>();
}

// One declared schedule at step t (an int32 count as float64): the float64 operations of
// transforms/schedules.py in their order, rounded once to float32. `p` walks the program.
static float schedule_at(const double *&p, const double *end, double t, int32_t raw) {
  TORCH_CHECK(p < end, "programs: a schedule ends early");
  const int kind = static_cast<int>(*p++);
  auto take = [&](int n) {
    TORCH_CHECK(p + n <= end, "programs: a schedule ends early");
    const double *q = p;
    p += n;
    return q;
  };
  switch (kind) {
    case 0: {  // constant(v)
      const double *a = take(1);
      return static_cast<float>(a[0]);
    }
    case 1: {  // linear(v0, v1, T, tb)
      const double *a = take(4);
      const double u = clamp_to(t - a[3], 0.0, a[2]);
      return static_cast<float>(a[0] + (a[1] - a[0]) * (u / a[2]));
    }
    case 2: {  // polynomial(v0, v1, power, T, tb)
      const double *a = take(5);
      const double u = clamp_to(t - a[4], 0.0, a[3]);
      return static_cast<float>((a[0] - a[1]) * pow_scalar(1.0 - u / a[3], a[2]) + a[1]);
    }
    case 3: {  // exponential(v0, T, rate, tb, staircase, has_end, end)
      const double *a = take(7);
      const double u = t - a[3];
      double q = u / a[1];
      if (a[4] != 0.0) q = std::floor(q);
      double v = 0.0;
      if (a[0] != 0.0) v = u <= 0.0 ? a[0] : a[0] * (a[2] == 1.0 ? 1.0 : std::pow(a[2], q));
      if (a[5] != 0.0) v = a[2] < 1.0 ? std::max(v, a[6]) : std::min(v, a[6]);
      return static_cast<float>(v);
    }
    case 4: {  // piecewise(v0, n, bounds[n], values[n])
      const double *a = take(2);
      const int64_t n = static_cast<int64_t>(a[1]);
      TORCH_CHECK(n >= 0, "programs: a piecewise schedule with ", n, " boundaries");
      const double *b = take(static_cast<int>(2 * n));
      double v = a[0];
      for (int64_t i = 0; i < n; ++i) v = t >= b[i] ? b[n + i] : v;
      return static_cast<float>(v);
    }
    case 5: {  // cosine(v0, T, alpha, exponent)
      const double *a = take(4);
      const double u = clamp_to(t, 0.0, a[1]);
      const double c = 0.5 * (1.0 + aten_cos(u * 3.141592653589793 / a[1]));
      return static_cast<float>(a[0] * ((1.0 - a[2]) * pow_scalar(c, a[3]) + a[2]));
    }
    case 7: {  // the count after this step as PyTorch's fused Adam keeps it: fl32(fl32(t) + 1)
      return static_cast<float>(t) + 1.0f;
    }
    case 8:    // Adam's 1 / (1 - b1^t'), t' the count after this step (saturating)
    case 9: {  // Adam's sqrt(1 - b2^t')
      const double *a = take(1);
      const double after = static_cast<double>(raw < INT32_MAX ? raw + 1 : raw);
      const double c = 1.0 - std::pow(a[0], after);
      return static_cast<float>(kind == 8 ? 1.0 / c : std::sqrt(c));
    }
    case 10: {  // the unscale factor fl32(1 / fl64(s)) of a float32 scale given as its bits
      float s;
      std::memcpy(&s, &raw, sizeof s);
      return static_cast<float>(1.0 / static_cast<double>(s));
    }
    case 6: {  // join(n, boundaries[n - 1], n schedules)
      const double *a = take(1);
      const int64_t n = static_cast<int64_t>(a[0]);
      TORCH_CHECK(n >= 1, "programs: a join of ", n, " schedules");
      const double *b = take(static_cast<int>(n - 1));
      const int32_t step = static_cast<int32_t>(t);
      float v = schedule_at(p, end, t, step);
      for (int64_t i = 1; i < n; ++i) {
        const int32_t shifted = step - static_cast<int32_t>(b[i - 1]);
        const float w = schedule_at(p, end, static_cast<double>(shifted), shifted);
        v = static_cast<double>(step) >= b[i - 1] ? w : v;
      }
      return v;
    }
    default:
      TORCH_CHECK(false, "programs: unknown schedule kind ", kind);
  }
  return 0.0f;
}

// peak: members * L float32 (or empty: no decision); inv, require, sum_sq: members each
// (or undefined); counts: int32, members each; programs: per count, its sign, then its
// schedule.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, std::vector<Tensor>> step_scalars(
    const c10::optional<Tensor> &peak, const c10::optional<Tensor> &inv,
    const c10::optional<Tensor> &require, const c10::optional<Tensor> &sum_sq, double max_norm,
    const TensorList &counts, c10::ArrayRef<double> programs, int64_t members) {
  TORCH_CHECK(members >= 1, "members: at least 1");
  auto dense = [&](const c10::optional<Tensor> &x, at::ScalarType dt, int64_t n, const char *what) {
    if (!x.has_value() || !x->defined()) return;
    TORCH_CHECK(x->device().is_cpu() && x->scalar_type() == dt && x->numel() == n && x->is_contiguous(),
                what, ": expected a dense ", c10::toString(dt), " tensor of ", n, " elements on the CPU");
  };
  const bool deciding = peak.has_value() && peak->defined();
  const int64_t n_peak = deciding ? peak->numel() : 0;
  TORCH_CHECK(n_peak % members == 0, "peak: ", n_peak, " values for ", members, " members");
  dense(peak, at::kFloat, n_peak, "peak");
  dense(inv, at::kFloat, members, "inv");
  dense(require, at::kBool, members, "require");
  dense(sum_sq, at::kDouble, members, "sum_sq");
  for (const auto &c : counts) {
    TORCH_CHECK(c.device().is_cpu() && c.scalar_type() == at::kInt && c.numel() == members &&
                    c.is_contiguous(),
                "counts: dense int32 tensors of ", members, " elements on the CPU");
  }
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  Tensor leaves = at::empty({n_peak}, at::TensorOptions().dtype(at::kBool));
  Tensor finite = at::empty({deciding ? members : 0}, at::TensorOptions().dtype(at::kBool));
  Tensor skip = at::empty({deciding ? members : 0}, f32);  // found_inf: 1 where skipped
  const bool clipping = sum_sq.has_value() && sum_sq->defined();
  Tensor div = at::empty({clipping ? members : 0}, f32), mul = at::empty({clipping ? members : 0}, f32);
  std::vector<Tensor> lrs;
  for (size_t k = 0; k < counts.size(); ++k) lrs.push_back(at::empty({members}, f32));

  const int64_t per = n_peak / members;
  const float *pk = deciding ? peak->data_ptr<float>() : nullptr;
  const float *iv = inv.has_value() && inv->defined() ? inv->data_ptr<float>() : nullptr;
  const bool *rq = require.has_value() && require->defined() ? require->data_ptr<bool>() : nullptr;
  for (int64_t m = 0; m < members && deciding; ++m) {
    bool all = true;
    for (int64_t l = 0; l < per; ++l) {
      const float x = pk[m * per + l];
      const bool ok = std::isfinite(iv ? x * iv[m] : x);
      leaves.data_ptr<bool>()[m * per + l] = ok;
      all = all && ok;
    }
    const bool applied = all && (rq ? rq[m] : true);
    finite.data_ptr<bool>()[m] = applied;
    skip.data_ptr<float>()[m] = applied ? 0.0f : 1.0f;
  }
  if (clipping) {
    const float cap = static_cast<float>(max_norm);
    const double *sq = sum_sq->data_ptr<double>();
    for (int64_t m = 0; m < members; ++m) {
      const float norm = static_cast<float>(std::sqrt(sq[m]));
      const bool inside = norm < cap;
      div.data_ptr<float>()[m] = inside ? 1.0f : norm;
      mul.data_ptr<float>()[m] = inside ? 1.0f : cap;
    }
  }
  const double *p = programs.data(), *end = programs.data() + programs.size();
  for (size_t k = 0; k < counts.size(); ++k) {
    TORCH_CHECK(p < end, "programs: ", counts.size(), " schedules expected");
    const double sign = *p++;
    const double *start = p;
    for (int64_t m = 0; m < members; ++m) {
      p = start;
      const int32_t raw = counts[k].data_ptr<int32_t>()[m];
      const float v = schedule_at(p, end, static_cast<double>(raw), raw);
      lrs[k].data_ptr<float>()[m] = v * static_cast<float>(sign);
    }
  }
  TORCH_CHECK(p == end, "programs: more numbers than the schedules take");
  return {leaves, finite, skip, div, mul, lrs};
}

// A tensor's dispatch keys but those of autograd (and ADInplaceOrView): the same for a
// tensor made in inference mode and one made outside it; a batched, functional, negative
// or subclass tensor has other keys.
static int64_t keys_of(const Tensor &x) {
  return static_cast<int64_t>((x.key_set() - c10::autograd_dispatch_keyset_with_ADInplaceOrView).raw_repr());
}

// The metadata gradients must have to be read as they are, leaf by leaf, as int64 numbers
// (CPU): [dim, sizes..., strides..., dtype, device type, device index, dispatch keys] of
// `shaped[i]`'s sizes, dtype, device and keys with `strided[i]`'s strides (the params and
// the master). Made once per state structure; `leaves_match` compares gradients with it.
Tensor leaves_layout(const TensorList &shaped, const TensorList &strided) {
  TORCH_CHECK(shaped.size() == strided.size(), "leaves_layout: lists of different lengths");
  std::vector<int64_t> out;
  for (size_t i = 0; i < shaped.size(); ++i) {
    const Tensor &x = shaped[i], &y = strided[i];
    TORCH_CHECK(x.dim() == y.dim(), "leaves_layout: leaves of different dimensions");
    out.push_back(x.dim());
    for (int64_t d = 0; d < x.dim(); ++d) out.push_back(x.size(d));
    for (int64_t d = 0; d < y.dim(); ++d) out.push_back(y.stride(d));
    out.push_back(static_cast<int64_t>(x.scalar_type()));
    out.push_back(static_cast<int64_t>(x.device().type()));
    out.push_back(static_cast<int64_t>(x.device().index()));
    out.push_back(keys_of(x));
  }
  Tensor t = at::empty({static_cast<int64_t>(out.size())}, at::TensorOptions().dtype(at::kLong));
  if (!out.empty()) std::memcpy(t.data_ptr<int64_t>(), out.data(), out.size() * sizeof(int64_t));
  return t;
}

// Whether every tensor of `xs` has the metadata `layout` holds for its leaf (see
// `leaves_layout`) and needs no gradient: the same sizes, strides, dtype, device and
// dispatch keys (so no batched, functional or subclass tensor), dense and strided.
bool leaves_match(const TensorList &xs, const Tensor &layout) {
  TORCH_CHECK(layout.scalar_type() == at::kLong && layout.is_contiguous() && layout.is_cpu(),
              "leaves_match: layout must be a dense int64 CPU tensor");
  const int64_t *p = layout.data_ptr<int64_t>(), *end = p + layout.numel();
  for (const Tensor &x : xs) {
    if (p == end || x.requires_grad() || x.layout() != at::kStrided || *p++ != x.dim()) return false;
    if (end - p < 2 * x.dim() + 4) return false;
    for (int64_t d = 0; d < x.dim(); ++d)
      if (*p++ != x.size(d)) return false;
    for (int64_t d = 0; d < x.dim(); ++d)
      if (*p++ != x.stride(d)) return false;
    if (*p++ != static_cast<int64_t>(x.scalar_type())) return false;
    if (*p++ != static_cast<int64_t>(x.device().type())) return false;
    if (*p++ != static_cast<int64_t>(x.device().index())) return false;
    if (*p++ != keys_of(x)) return false;
  }
  return p == end;
}

// Whether releasing `inputs` gives back a Python object: some tensor among them (alone,
// optional or in a list) has one.
bool holds_python_objects(const std::vector<c10::IValue> &inputs) {
  const auto has = [](const Tensor &t) {
    return t.defined() && t.unsafeGetTensorImpl()->pyobj_slot()->load_pyobj() != nullptr;
  };
  for (const c10::IValue &v : inputs) {
    if (v.isTensor() && has(v.toTensor())) return true;
    if (v.isTensorList())
      for (const c10::IValue &t : v.toListRef())
        if (has(t.toTensor())) return true;
  }
  return false;
}

// The ops' kernels, boxed: each runs the unboxed kernel `Fn` on the stack and then
// releases the inputs' references together, under one hold of the GIL.
//
// A call from Python converts each argument list into the stack with the GIL held, runs
// the kernel with the GIL released, and drops the arguments from the stack there. A
// tensor with a Python object whose last C++ reference is dropped gives its object back
// (`c10::TensorImpl::decref_pyobject`), which takes the GIL: once per tensor, about
// 0.17 us each, 100 us for the 600 tensors of one step. PyTorch's own bindings
// release their argument vectors after taking the GIL back; here the kernel keeps the
// inputs until it has run and releases them in one hold of the GIL. It takes the GIL
// only where releasing them would: where some input tensor has a Python object (a call
// from C++ on tensors Python never saw takes no GIL). A kernel that throws releases them
// as the dispatcher would, a tensor at a time.
template <class Fn>
struct ReleasingInputsTogether final : c10::OperatorKernel {
  void operator()(const c10::OperatorHandle &op, c10::DispatchKeySet keys,
                  torch::jit::Stack *stack) {
    static const c10::KernelFunction kernel = c10::KernelFunction::makeFromUnboxedFunction(Fn());
    const size_t n = op.schema().arguments().size();
    std::vector<c10::IValue> inputs(stack->end() - static_cast<std::ptrdiff_t>(n), stack->end());
    kernel.callBoxed(op, keys, stack);
    if (ff_releases_together() && Py_IsInitialized() && holds_python_objects(inputs)) {
      const int state = PyGILState_Ensure();
      inputs.clear();
      PyGILState_Release(state);
    }
  }
};

template <class Fn>
torch::CppFunction releasing_inputs_together(Fn) {
  return torch::CppFunction::makeFromBoxedFunctor(std::make_unique<ReleasingInputsTogether<Fn>>());
}

}  // namespace

// Checks of metadata alone, for tensors of any device (one kernel for every dispatch key,
// CompositeImplicitAutograd): no kernel of the CPU's, so their namespace is their own.
TORCH_LIBRARY(functional_fp16_layout, m) {
  m.def("leaves_layout(Tensor[] shaped, Tensor[] strided) -> Tensor",
        releasing_inputs_together(TORCH_FN(leaves_layout)));
  m.def("leaves_match(Tensor[] xs, Tensor layout) -> bool",
        releasing_inputs_together(TORCH_FN(leaves_match)));
}

TORCH_LIBRARY(functional_fp16_cpu, m) {
  m.def(
      "sgd(Tensor[] grads, Tensor[] master, Tensor[] trace, Tensor[] params, bool[] separate, "
      "Tensor? inv, Tensor? clip_div, Tensor? clip_mul, Tensor lr, "
      "Tensor? apply, Tensor? require, Tensor? started, float weight_decay, float momentum, "
      "float take_started, bool nesterov, int members, int threads, bool donated) "
      "-> (Tensor[], Tensor[], Tensor[], Tensor, Tensor)");
  m.def(
      "adam(Tensor[] grads, Tensor[] master, Tensor[] mu, Tensor[] nu, Tensor[] params, "
      "bool[] separate, Tensor? inv, Tensor? clip_div, Tensor? clip_mul, "
      "Tensor lr, Tensor? apply, Tensor? require, Tensor inv_c1, Tensor sqrt_c2, float l2, "
      "float w, float b2, float c2, float eps, float decoupled, int members, int threads, "
      "bool donated) -> (Tensor[], Tensor[], Tensor[], Tensor[], Tensor, Tensor)");
  m.def(
      "step(str name, Tensor[] grads, Tensor[] master, Tensor[] states, Tensor[] params, "
      "bool[] separate, Tensor? inv, Tensor? clip_div, Tensor? clip_mul, Tensor lr, "
      "Tensor? apply, Tensor? require, Tensor[] scalars, float[] hyper, int members, "
      "int threads, bool donated) -> (Tensor[], Tensor[], Tensor[], Tensor, Tensor)");
  m.def(
      "stored_step(str name, Tensor[] grads, Tensor[] master, Tensor[] states, "
      "Tensor[] scales, Tensor[] params, bool[] separate, Tensor? inv, Tensor? clip_div, "
      "Tensor? clip_mul, Tensor lr, Tensor? apply, Tensor? require, Tensor[] scalars, "
      "Tensor count, float[] hyper, int block_size, int rounding, int root, int[] salt_ids, "
      "int members, int threads, bool donated) -> (Tensor[], Tensor[], Tensor[], Tensor[], "
      "Tensor, Tensor)");
  m.def(
      "grad_stats(Tensor[] grads, Tensor? inv, int groups, int members, bool sum_squares, "
      "int threads) -> (Tensor, Tensor)");
  m.impl("sgd", c10::DispatchKey::CPU, releasing_inputs_together(TORCH_FN(sgd)));
  m.impl("adam", c10::DispatchKey::CPU, releasing_inputs_together(TORCH_FN(adam)));
  m.impl("step", c10::DispatchKey::CPU, releasing_inputs_together(TORCH_FN(step)));
  m.impl("stored_step", c10::DispatchKey::CPU, releasing_inputs_together(TORCH_FN(stored_step)));
  m.def(
      "bookkeeping(Tensor finite, Tensor[] scale, Tensor[] stats, Tensor step, "
      "Tensor[] counters, float[] config, int kind) -> (Tensor[], Tensor[], Tensor, Tensor, Tensor[])");
  m.impl("grad_stats", c10::DispatchKey::CPU, releasing_inputs_together(TORCH_FN(grad_stats)));
  m.impl("bookkeeping", c10::DispatchKey::CPU, releasing_inputs_together(TORCH_FN(bookkeeping)));
  m.def(
      "step_scalars(Tensor? peak, Tensor? inv, Tensor? require, Tensor? sum_sq, float max_norm, "
      "Tensor[] counts, float[] programs, int members) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor[])");
  m.impl("step_scalars", c10::DispatchKey::CPU, releasing_inputs_together(TORCH_FN(step_scalars)));
}
