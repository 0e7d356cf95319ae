// The selector registry: one row per way of choosing the coordinates a step sends.
//
// A row (kernels/src/selectors.cc) holds the selector's frozen id, its name, a one-line doc, the
// parameters it reads, whether it is unbiased with error feedback off, whether it reads the
// tensor's registered shape, and its CPU select function (plus a slot for the CUDA one). Every
// other place derives from the rows: the names (selector_name / parse_selector), the `selector`
// knob's choices and doc (`sparsecard --help`, `sparsecarctl knobs`), the per-tensor override
// keys of the parameters (policies/overrides.h), the compressor's dispatch (one table lookup, no
// switch), the kernel benchmark rows and the Python bindings' `kernels.selectors()`.
//
// Adding a selector: its kernel, an id below, its row in selectors.cc, its test and docs.
// Adding a parameter also needs its fields in policies::Plan/StaticSettings/TensorOverride and
// daemon::Config, and its knob row (knobs.cc) naming its StaticSettings field (not derived yet).
//
// Ids are frozen like every enum of types.h (names travel in knob changes and metrics labels; an
// id may travel in a plan): add new ones at the end; never renumber or reuse one.
//
// Thread-safety: the tables are immutable; select functions are pure over caller-owned buffers
// (a stateful row's state is owned by the caller too, one per tensor).
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>

#include "sparsecar/common/status.h"
#include "sparsecar/kernels/structured.h"

namespace sparsecar::kernels {

class ThreadPool;  // parallel.h

// How the kept coordinates are chosen. Frozen ids (see above); the meaning of each is its row's
// doc in selectors.cc.
enum class Selector : uint16_t {
  kNone = 0,  // dense: every coordinate (compression off); no select function
  kTopk = 1,
  kThreshold = 2,
  kTopkApprox = 3,
  kPercentile = 4,
  kRandomk = 5,
  kImportance = 6,
  kBlockTopk = 7,
  kRowTopk = 8,
  kColumnTopk = 9,
  kChannelTopk = 10,
  kHeadTopk = 11,
  kPeriodicMask = 12,
  kHybrid = 13,
  kRandblock = 14,
};

// ---- parameters --------------------------------------------------------------------------------

// The parameters selectors read; a row names the ones it reads (SelectorInfo::params).
enum class SelectorParam : uint8_t {
  kDensity = 0,
  kThreshold = 1,
  kQuantile = 2,
  kApproxTolerance = 3,
  kBlockSize = 4,
  kGroupNorm = 5,
  kHeads = 6,
  kMaskPeriod = 7,
  kHybridDensity = 8,
  kRandomSeed = 9,
};
inline constexpr int kSelectorParamCount = 10;
constexpr uint32_t param_bit(SelectorParam p) { return uint32_t{1} << static_cast<unsigned>(p); }

enum class ParamType : uint8_t {
  kNumber,  // a finite double in [min, max]
  kUint,    // an unsigned integer in [min, max]
  kChoice,  // one of `choices`
};

struct ParamInfo {
  SelectorParam param;
  const char* name;      // the knob's name and the per-tensor override key
  ParamType type;
  double min;            // closed range (kNumber, kUint)
  double max;
  double default_value;  // kNumber, kUint (a kChoice's default is the first of `choices`)
  const char* choices;   // '|'-separated (kChoice), else ""
  bool per_tensor;       // a tensor_overrides key (false: job-wide)
  const char* doc;
};

// One row per SelectorParam, in enum order (checked by a static_assert in selectors.cc).
inline constexpr ParamInfo kSelectorParams[kSelectorParamCount] = {
    {SelectorParam::kDensity, "density", ParamType::kNumber, 1e-6, 1.0, 0.01, "", true,
     "fraction of coordinates (or groups, or blocks) kept per step"},
    {SelectorParam::kThreshold, "threshold", ParamType::kNumber, 1e-30, 1e30, 1e-3, "", true,
     "lambda of the hard-threshold selector: send |e_i| >= lambda"},
    {SelectorParam::kQuantile, "quantile", ParamType::kNumber, 1e-6, 1.0, 0.99, "", true,
     "percentile selector: lambda = this quantile of |e| (sampled), so about 1 - quantile is sent"},
    {SelectorParam::kApproxTolerance, "approx_tolerance", ParamType::kNumber, 0.0, 1.0, 0.1, "", true,
     "topk_approx: relative miss |nnz - k| / k accepted from the sampled threshold before refining to exact"},
    {SelectorParam::kBlockSize, "block_size", ParamType::kUint, static_cast<double>(kMinBlock),
     static_cast<double>(kMaxBlock), 64, "", true,
     "block_topk, randblock: elements per contiguous block (the last block may be shorter)"},
    {SelectorParam::kGroupNorm, "group_norm", ParamType::kChoice, 0, 0, 0, "l2|l1", true,
     "how block/row/column/channel/head selectors rank their groups"},
    {SelectorParam::kHeads, "heads", ParamType::kUint, 1, 65536, 8, "", true,
     "head_topk: attention heads, contiguous slices of a tensor's leading dimension"},
    {SelectorParam::kMaskPeriod, "mask_period", ParamType::kUint, 100, 1000, 100, "", true,
     "periodic_mask: steps between recomputing the mask from accumulated |g|"},
    {SelectorParam::kHybridDensity, "hybrid_density", ParamType::kNumber, 1e-6, 1.0, 0.001, "", false,
     "hybrid: global lambda keeps this fraction of the previous step's pooled elements (plus each tensor's top-k)"},
    {SelectorParam::kRandomSeed, "random_seed", ParamType::kUint, 0, 1.8e19, 0, "", false,
     "job seed of the random selectors' draws (per tensor and step: derive_seed(seed, tensor, step))"},
};
constexpr const ParamInfo& selector_param(SelectorParam p) { return kSelectorParams[static_cast<int>(p)]; }

// The parameter values one selection reads (policies::Plan carries them per tensor and step).
struct SelectorParams {
  double density = 0.01;
  float threshold = 1e-3f;
  double quantile = 0.99;
  double approx_tolerance = 0.1;
  uint32_t block_size = 64;
  GroupNorm group_norm = GroupNorm::kL2;
  uint32_t heads = 8;
  uint32_t mask_period = 100;
  double hybrid_density = 0.001;
  uint64_t seed = 0;  // the stream of this (tensor, step): derive_seed(random_seed, tensor, step)
};

// ---- select functions --------------------------------------------------------------------------

// Per-tensor state of a stateful row (periodic_mask), owned by the caller. Its buffers hold one
// entry per element of the tensor each; the caller allocates them before the first call of a
// stateful row (zeroed, has_mask false) and keeps the struct between steps.
struct SelectorState {
  std::span<float> importance;    // accumulated |g| since the last mask
  std::span<uint32_t> mask;       // the current mask's indices, increasing
  std::span<float> mask_values;   // scratch for the values of the mask's top-k
  size_t mask_size = 0;
  bool has_mask = false;
  uint64_t steps_since_mask = 0;
};

struct SelectInput {
  std::span<const float> x;          // what to select from: the residual after this step's fold
  std::span<const float> grad;       // this step's local sum (periodic_mask's importance)
  std::span<const uint64_t> shape;   // the registered shape (empty: unknown)
  const SelectorParams* params = nullptr;
  bool unbiased = false;             // error feedback off: rows with .unbiased write x / p
  std::span<std::byte> scratch;      // selector_scratch_bytes(x.size(), shape)
  ThreadPool* pool = nullptr;        // optional: large kernels split over it
  SelectorState* state = nullptr;    // rows with .stateful
  float pooled_lambda = std::numeric_limits<float>::infinity();  // rows with .pooled_lambda
};

struct SelectOutput {
  uint32_t* index = nullptr;  // capacity entries each; pairs in increasing index order
  float* value = nullptr;
  size_t capacity = 0;        // the daemon passes x.size()
};

// Returns the number of pairs written, or an error (nothing selected).
using CpuSelectFn = Expected<size_t> (*)(const SelectInput& in, const SelectOutput& out);
// The CUDA backend's entry (device pointers, a stream); declared by the CUDA kernels when they
// come. No row has one yet.
struct CudaSelectInput;
using CudaSelectFn = Expected<size_t> (*)(const CudaSelectInput& in);
// Hard-threshold rows: lambda for one fused pass of EF + threshold over residual + grad (read
// without writing); the compressor takes that path when error feedback is plain and unclipped.
using FusedLambdaFn = float (*)(std::span<const float> residual, std::span<const float> grad,
                                const SelectorParams& params, std::span<std::byte> scratch);

struct SelectorInfo {
  Selector id;
  const char* name;           // config files, flags, override values, metrics labels
  const char* doc;            // one line: what it keeps
  uint32_t params;            // param_bit()s of the parameters it reads
  bool unbiased;              // with error feedback off it writes x / p (E[sent] = x), which the
                              // compressor subtracts from the residual instead of clearing it
  bool needs_shape;           // reads the registered shape (falls back to top-k when it does not fit)
  bool stateful;              // keeps per-tensor state between steps (SelectorState)
  bool pooled_lambda;         // reads the node's pooled lambda; the caller adds x to the pool
  CpuSelectFn cpu;            // null only for kNone
  CudaSelectFn cuda;          // null: no CUDA backend
  FusedLambdaFn fused_lambda;  // null: no fused EF + threshold path
};

// Every row in id order, kNone first (ids are 0 .. size - 1).
std::span<const SelectorInfo> selector_registry();
// The row of `s`, or null for a value no row has.
const SelectorInfo* find_selector(Selector s);
// The row named `name`, or null.
const SelectorInfo* find_selector(std::string_view name);
// "topk|threshold|...": every row's name but none's, in id order (the `selector` knob's choices).
std::string selector_choices();

std::string_view selector_name(Selector s);  // "unknown" for a value no row has
// false (and *out unchanged) if no row has that name.
bool parse_selector(std::string_view text, Selector* out);

// Bytes of scratch any row's select function needs for a tensor of n elements and this shape:
// the top-k scratch or the largest group count's (blocks of kMinBlock, rows, columns, ...).
size_t selector_scratch_bytes(size_t n, std::span<const uint64_t> shape);

}  // namespace sparsecar::kernels
