// The selector registry's rows (selectors.h) and the adapters that give every selector kernel
// the one signature the rows hold. A row is the only place that says which kernel a selector
// name means and how the plan's parameters feed it.
#include "sparsecar/kernels/selectors.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <type_traits>

#include "sparsecar/kernels/select.h"
#include "sparsecar/kernels/structured.h"

namespace sparsecar::kernels {
namespace {

static_assert([] {
  for (int i = 0; i < kSelectorParamCount; ++i) {
    if (static_cast<int>(kSelectorParams[i].param) != i) return false;
  }
  return true;
}(), "kSelectorParams must list every SelectorParam in enum order");

// A row's field has the C++ type its ParamType says (get_param / set_param rely on it), an
// unsigned field holds its whole range, and a kChoice field is an enum.
template <typename T>
constexpr bool field_fits(const ParamInfo& p) {
  if constexpr (std::is_floating_point_v<T>) {
    return p.type == ParamType::kNumber;
  } else if constexpr (std::is_enum_v<T>) {
    return p.type == ParamType::kChoice;
  } else {
    return p.type == ParamType::kUint && std::is_unsigned_v<T> && p.min >= 0 &&
           p.max <= static_cast<double>(std::numeric_limits<T>::max());
  }
}
static_assert([] {
  for (const ParamInfo& p : kSelectorParams) {
    const bool fits = std::visit(
        [&](auto field) { return field_fits<std::remove_reference_t<decltype(SelectorParams{}.*field)>>(p); },
        p.field);
    if (!fits) return false;
  }
  return true;
}(), "a kSelectorParams row's field must have the type of its ParamType (and hold its range)");

size_t keep_of(size_t n, const SelectInput& in) { return topk_count(n, in.params->density); }

// The fallback of every shaped row whose shape does not fit: exact top-k at the same density.
Expected<size_t> exact_topk(const SelectInput& in, const SelectOutput& out) {
  return topk_exact(in.x, keep_of(in.x.size(), in), in.scratch, out.index, out.value);
}

// ---- element selectors -------------------------------------------------------------------------

Expected<size_t> select_topk(const SelectInput& in, const SelectOutput& out) {
  return topk_exact(in.x, keep_of(in.x.size(), in), in.scratch, out.index, out.value, in.pool, out.capacity);
}

Expected<size_t> select_topk_approx(const SelectInput& in, const SelectOutput& out) {
  return topk_approx(in.x, keep_of(in.x.size(), in), in.params->approx_tolerance, in.scratch, out.index,
                     out.value, out.capacity, in.pool);
}

Expected<size_t> select_threshold(const SelectInput& in, const SelectOutput& out) {
  return threshold_select(in.x, static_cast<float>(in.params->threshold), out.index, out.value, out.capacity,
                          in.pool);
}

float threshold_lambda(std::span<const float>, std::span<const float>, const SelectorParams& p,
                       std::span<std::byte>) {
  return static_cast<float>(p.threshold);
}

Expected<size_t> select_percentile(const SelectInput& in, const SelectOutput& out) {
  return threshold_select(in.x, magnitude_quantile(in.x, in.params->quantile, in.scratch), out.index, out.value,
                          out.capacity, in.pool);
}

float percentile_lambda(std::span<const float> residual, std::span<const float> grad, const SelectorParams& p,
                        std::span<std::byte> scratch) {
  return magnitude_quantile(residual, p.quantile, scratch, grad);
}

Expected<size_t> select_randomk(const SelectInput& in, const SelectOutput& out) {
  return randomk_select(in.x, in.params->density, in.params->seed, in.unbiased, out.index, out.value,
                        out.capacity);
}

Expected<size_t> select_importance(const SelectInput& in, const SelectOutput& out) {
  return importance_select(in.x, keep_of(in.x.size(), in), in.params->seed, in.unbiased, out.index, out.value,
                           out.capacity);
}

// ---- structured selectors (structured.h) --------------------------------------------------------

size_t groups_kept(size_t groups, const SelectInput& in) { return topk_count(groups, in.params->density); }

Expected<size_t> select_block_topk(const SelectInput& in, const SelectOutput& out) {
  const size_t n = in.x.size();
  const size_t block = in.params->block_size;
  return block_topk(in.x, block, groups_kept((n + block - 1) / std::max<size_t>(block, 1), in),
                    in.params->group_norm, in.scratch, out.index, out.value);
}

Expected<size_t> select_row_topk(const SelectInput& in, const SelectOutput& out) {
  if (in.shape.size() != 2) return exact_topk(in, out);
  return row_topk(in.x, in.shape[0], in.shape[1], groups_kept(in.shape[0], in), in.params->group_norm,
                  in.scratch, out.index, out.value);
}

Expected<size_t> select_column_topk(const SelectInput& in, const SelectOutput& out) {
  if (in.shape.size() != 2) return exact_topk(in, out);
  return column_topk(in.x, in.shape[0], in.shape[1], groups_kept(in.shape[1], in), in.params->group_norm,
                     in.scratch, out.index, out.value);
}

Expected<size_t> select_channel_topk(const SelectInput& in, const SelectOutput& out) {
  if (in.shape.size() != 4) return exact_topk(in, out);
  const std::array<uint64_t, 4> dims = {in.shape[0], in.shape[1], in.shape[2], in.shape[3]};
  return channel_topk(in.x, dims, groups_kept(in.shape[0], in), in.params->group_norm, in.scratch, out.index,
                      out.value);
}

Expected<size_t> select_head_topk(const SelectInput& in, const SelectOutput& out) {
  const uint32_t heads = in.params->heads;
  if (in.shape.empty() || heads < 2 || in.shape[0] % heads != 0) return exact_topk(in, out);
  return head_topk(in.x, in.shape[0], heads, groups_kept(heads, in), in.params->group_norm, in.scratch,
                   out.index, out.value);
}

// The mask is the top-k of |g| accumulated since the last mask, recomputed on the first step and
// then every mask_period calls; every call sends x at the mask.
Expected<size_t> select_periodic_mask(const SelectInput& in, const SelectOutput& out) {
  SelectorState* st = in.state;
  const size_t n = in.x.size();
  if (st == nullptr || st->importance.size() != n || st->mask.size() != n || st->mask_values.size() != n) {
    return invalid_argument("periodic_mask: no per-tensor state of " + std::to_string(n) + " elements");
  }
  importance_accumulate(st->importance, in.grad);
  if (!st->has_mask || st->steps_since_mask >= std::max<uint32_t>(in.params->mask_period, 1)) {
    auto k = topk_exact(st->importance, keep_of(n, in), in.scratch, st->mask.data(), st->mask_values.data());
    if (!k.ok()) return k.status();
    st->mask_size = *k;
    st->has_mask = true;
    st->steps_since_mask = 0;
    std::fill(st->importance.begin(), st->importance.end(), 0.0f);
  }
  ++st->steps_since_mask;
  std::copy(st->mask.begin(), st->mask.begin() + static_cast<std::ptrdiff_t>(st->mask_size), out.index);
  gather(in.x, std::span<const uint32_t>(st->mask.data(), st->mask_size), out.value);
  return st->mask_size;
}

Expected<size_t> select_hybrid(const SelectInput& in, const SelectOutput& out) {
  const size_t k = keep_of(in.x.size(), in);
  if (std::isinf(in.pooled_lambda)) return topk_exact(in.x, k, in.scratch, out.index, out.value);
  return topk_or_threshold(in.x, k, in.pooled_lambda, in.scratch, out.index, out.value);
}

Expected<size_t> select_randblock(const SelectInput& in, const SelectOutput& out) {
  return randblock_select(in.x, in.params->block_size, in.params->density, in.params->seed, in.unbiased, out.index,
                          out.value, out.capacity);
}

// ---- the rows ------------------------------------------------------------------------------------

using P = SelectorParam;
constexpr uint32_t kGroup = param_bit(P::kDensity) | param_bit(P::kGroupNorm);

// Every field is written out in every row (no silently defaulted column).
constexpr SelectorInfo kRows[] = {
    {.id = Selector::kNone,
     .name = "none",
     .doc = "dense: every coordinate (compression off)",
     .params = 0,
     .unbiased = false, .needs_shape = false, .stateful = false, .pooled_lambda = false,
     .cpu = nullptr, .fused_lambda = nullptr},
    {.id = Selector::kTopk,
     .name = "topk",
     .doc = "exactly the k = density * n largest |e_i| (ties to the lower index, NaN first)",
     .params = param_bit(P::kDensity),
     .unbiased = false, .needs_shape = false, .stateful = false, .pooled_lambda = false,
     .cpu = select_topk, .fused_lambda = nullptr},
    {.id = Selector::kThreshold,
     .name = "threshold",
     .doc = "|e_i| >= threshold (k varies per step)",
     .params = param_bit(P::kThreshold),
     .unbiased = false, .needs_shape = false, .stateful = false, .pooled_lambda = false,
     .cpu = select_threshold, .fused_lambda = threshold_lambda},
    {.id = Selector::kTopkApprox,
     .name = "topk_approx",
     .doc = "|e_i| >= a threshold estimated from a sample (DGC); refined to exact top-k when nnz misses k by "
            "more than approx_tolerance",
     .params = param_bit(P::kDensity) | param_bit(P::kApproxTolerance),
     .unbiased = false, .needs_shape = false, .stateful = false, .pooled_lambda = false,
     .cpu = select_topk_approx, .fused_lambda = nullptr},
    {.id = Selector::kPercentile,
     .name = "percentile",
     .doc = "|e_i| >= the quantile of |e| (sampled)",
     .params = param_bit(P::kQuantile),
     .unbiased = false, .needs_shape = false, .stateful = false, .pooled_lambda = false,
     .cpu = select_percentile, .fused_lambda = percentile_lambda},
    {.id = Selector::kRandomk,
     .name = "randomk",
     .doc = "each i with probability density, the same coordinates on every node (seeded by random_seed, "
            "tensor, step); x/p with error_feedback=off",
     .params = param_bit(P::kDensity) | param_bit(P::kRandomSeed),
     .unbiased = true, .needs_shape = false, .stateful = false, .pooled_lambda = false,
     .cpu = select_randomk, .fused_lambda = nullptr},
    {.id = Selector::kImportance,
     .name = "importance",
     .doc = "i with probability min(1, c|e_i|), c set so k = density * n are expected; x/p with "
            "error_feedback=off",
     .params = param_bit(P::kDensity) | param_bit(P::kRandomSeed),
     .unbiased = true, .needs_shape = false, .stateful = false, .pooled_lambda = false,
     .cpu = select_importance, .fused_lambda = nullptr},
    {.id = Selector::kBlockTopk,
     .name = "block_topk",
     .doc = "the best contiguous blocks of block_size elements by group_norm",
     .params = kGroup | param_bit(P::kBlockSize),
     .unbiased = false, .needs_shape = false, .stateful = false, .pooled_lambda = false,
     .cpu = select_block_topk, .fused_lambda = nullptr},
    {.id = Selector::kRowTopk,
     .name = "row_topk",
     .doc = "the best rows of a 2-D tensor",
     .params = kGroup,
     .unbiased = false, .needs_shape = true, .stateful = false, .pooled_lambda = false,
     .cpu = select_row_topk, .fused_lambda = nullptr},
    {.id = Selector::kColumnTopk,
     .name = "column_topk",
     .doc = "the best columns of a 2-D tensor",
     .params = kGroup,
     .unbiased = false, .needs_shape = true, .stateful = false, .pooled_lambda = false,
     .cpu = select_column_topk, .fused_lambda = nullptr},
    {.id = Selector::kChannelTopk,
     .name = "channel_topk",
     .doc = "the best output channels of a 4-D conv weight [c_out, c_in, kh, kw]",
     .params = kGroup,
     .unbiased = false, .needs_shape = true, .stateful = false, .pooled_lambda = false,
     .cpu = select_channel_topk, .fused_lambda = nullptr},
    {.id = Selector::kHeadTopk,
     .name = "head_topk",
     .doc = "the best attention heads: `heads` slices of the leading dimension",
     .params = kGroup | param_bit(P::kHeads),
     .unbiased = false, .needs_shape = true, .stateful = false, .pooled_lambda = false,
     .cpu = select_head_topk, .fused_lambda = nullptr},
    {.id = Selector::kPeriodicMask,
     .name = "periodic_mask",
     .doc = "a top-k mask of |g| accumulated over mask_period steps, reused in between (per node)",
     .params = param_bit(P::kDensity) | param_bit(P::kMaskPeriod),
     .unbiased = false, .needs_shape = false, .stateful = true, .pooled_lambda = false,
     .cpu = select_periodic_mask, .fused_lambda = nullptr},
    {.id = Selector::kHybrid,
     .name = "hybrid",
     .doc = "per-tensor top-k plus a per-node lambda keeping hybrid_density of the previous step's pooled |e|",
     .params = param_bit(P::kDensity) | param_bit(P::kHybridDensity),
     .unbiased = false, .needs_shape = false, .stateful = false, .pooled_lambda = true,
     .cpu = select_hybrid, .fused_lambda = nullptr},
    {.id = Selector::kRandblock,
     .name = "randblock",
     .doc = "each contiguous block of block_size elements with probability density, the same blocks on every "
            "node (seeded by random_seed, tensor, step); x/p with error_feedback=off",
     .params = param_bit(P::kDensity) | param_bit(P::kBlockSize) | param_bit(P::kRandomSeed),
     .unbiased = true, .needs_shape = false, .stateful = false, .pooled_lambda = false,
     .cpu = select_randblock, .fused_lambda = nullptr},
};

static_assert([] {
  for (size_t i = 0; i < std::size(kRows); ++i) {
    if (static_cast<size_t>(kRows[i].id) != i) return false;
    if ((kRows[i].cpu == nullptr) != (kRows[i].id == Selector::kNone)) return false;
  }
  return true;
}(), "selector rows must be in id order, ids 0..N-1, each with a CPU function (none aside)");

}  // namespace

ParamValue get_param(const SelectorParams& params, SelectorParam p) {
  return std::visit(
      [&](auto field) {
        ParamValue v;
        if constexpr (std::is_floating_point_v<std::remove_cvref_t<decltype(params.*field)>>) {
          v.number = params.*field;
        } else {
          v.integer = static_cast<uint64_t>(params.*field);
        }
        return v;
      },
      selector_param(p).field);
}

void set_param(SelectorParams& params, SelectorParam p, ParamValue value) {
  std::visit(
      [&](auto field) {
        using T = std::remove_cvref_t<decltype(params.*field)>;
        if constexpr (std::is_floating_point_v<T>) {
          params.*field = static_cast<T>(value.number);
        } else {
          params.*field = static_cast<T>(value.integer);
        }
      },
      selector_param(p).field);
}

std::string_view param_choice(const ParamInfo& p, uint64_t index) {
  std::string_view rest(p.choices);
  for (uint64_t i = 0; !rest.empty(); ++i) {
    const size_t bar = rest.find('|');
    if (i == index) return rest.substr(0, bar);
    if (bar == std::string_view::npos) break;
    rest.remove_prefix(bar + 1);
  }
  return "";
}

bool parse_param_choice(const ParamInfo& p, std::string_view name, uint64_t* index) {
  std::string_view rest(p.choices);
  for (uint64_t i = 0; !rest.empty(); ++i) {
    const size_t bar = rest.find('|');
    if (rest.substr(0, bar) == name) {
      *index = i;
      return true;
    }
    if (bar == std::string_view::npos) break;
    rest.remove_prefix(bar + 1);
  }
  return false;
}

std::span<const SelectorInfo> selector_registry() { return kRows; }

const SelectorInfo* find_selector(Selector s) {
  const auto i = static_cast<size_t>(s);
  return i < std::size(kRows) ? &kRows[i] : nullptr;
}

const SelectorInfo* find_selector(std::string_view name) {
  for (const SelectorInfo& row : kRows) {
    if (name == row.name) return &row;
  }
  return nullptr;
}

std::string selector_choices() {
  std::string out;
  for (const SelectorInfo& row : kRows) {
    if (row.id == Selector::kNone) continue;
    if (!out.empty()) out += '|';
    out += row.name;
  }
  return out;
}

std::string_view selector_name(Selector s) {
  const SelectorInfo* row = find_selector(s);
  return row != nullptr ? row->name : "unknown";
}

bool parse_selector(std::string_view text, Selector* out) {
  const SelectorInfo* row = find_selector(text);
  if (row == nullptr) return false;
  *out = row->id;
  return true;
}

size_t selector_scratch_bytes(size_t n, std::span<const uint64_t> shape) {
  // Groups of the finest grouping any row can make: blocks of the smallest size, rows, columns,
  // channels or heads (each at most n).
  size_t groups = (n + kMinBlock - 1) / kMinBlock;
  for (uint64_t d : shape) groups = std::max<size_t>(groups, static_cast<size_t>(d));
  if (shape.size() == 2 && shape[0] > 0) groups = std::max<size_t>(groups, n / shape[0]);
  return std::max(group_scratch_bytes(groups), topk_scratch_bytes(n));
}

}  // namespace sparsecar::kernels
