// The selector registry: one row per way of choosing the coordinates a step sends.
//
// A row (kernels/src/selectors.cc) holds the selector's frozen id, its name, a one-line doc, the
// parameters it reads, whether it is unbiased with error feedback off, whether it reads the
// tensor's registered shape, and its CPU select function. The CUDA column lives in the CUDA
// library, keyed by the same ids (cuda.h: cuda::find_select), since this library must not link
// CUDA. Every
// other place derives from the rows: the names (selector_name / parse_selector), the `selector`
// knob's choices and doc (`sparsecard --help`, `sparsecarctl knobs`), the per-tensor override
// keys of the parameters (policies/overrides.h), the compressor's dispatch (one table lookup, no
// switch), the kernel benchmark rows and the Python bindings' `kernels.selectors()`.
//
// Adding a selector: its kernel, an id below, its row in selectors.cc, its test and docs.
// Adding a parameter: its SelectorParam value (at the end), its kSelectorParams row (naming its
// field), its SelectorParams field and the select functions that read it. Everything else derives
// from the row: its knob (daemon/config/knobs.cc: name, type, range, default, doc, live), its
// value in daemon::Config, policies::StaticSettings and policies::Plan (each holds one
// SelectorParams), its `tensor_overrides` key if per_tensor (policies/overrides.h), `--help` and
// `sparsecarctl knobs`.
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
#include <variant>

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

// The parameters selectors read; a row names the ones it reads (SelectorInfo::params). The order
// is the knob table's (the generated knobs follow kSelectorParams, and the `agreed` text nodes
// compare at the first step lists them in table order): add new ones at the end, never reorder.
// The values do not leave the process (plans carry SelectorParams, not these ids).
enum class SelectorParam : uint8_t {
  kDensity = 0,
  kThreshold = 1,
  kBlockSize = 2,
  kGroupNorm = 3,
  kHeads = 4,
  kMaskPeriod = 5,
  kHybridDensity = 6,
  kQuantile = 7,
  kApproxTolerance = 8,
  kRandomSeed = 9,
};
inline constexpr int kSelectorParamCount = 10;
constexpr uint32_t param_bit(SelectorParam p) { return uint32_t{1} << static_cast<unsigned>(p); }

enum class ParamType : uint8_t {
  kNumber,  // a finite double in [min, max]
  kUint,    // an unsigned integer in [min, max]
  kChoice,  // one of `choices`
};

// A parameter's default: its row's default_value (a kChoice's: 0, the index of its first choice).
// Defined below the rows; SelectorParams' fields start from it.
constexpr double param_default(SelectorParam p);

// The parameter values one selection reads: one field per row of kSelectorParams, which names the
// field and gives its default. policies::Plan carries them per tensor and step; daemon::Config
// and policies::StaticSettings hold the knobs' values in the same struct.
struct SelectorParams {
  double density = param_default(SelectorParam::kDensity);
  double threshold = param_default(SelectorParam::kThreshold);  // the kernels compare it as a float
  uint32_t block_size = static_cast<uint32_t>(param_default(SelectorParam::kBlockSize));
  GroupNorm group_norm = static_cast<GroupNorm>(static_cast<int>(param_default(SelectorParam::kGroupNorm)));
  uint32_t heads = static_cast<uint32_t>(param_default(SelectorParam::kHeads));
  uint32_t mask_period = static_cast<uint32_t>(param_default(SelectorParam::kMaskPeriod));
  double hybrid_density = param_default(SelectorParam::kHybridDensity);
  double quantile = param_default(SelectorParam::kQuantile);
  double approx_tolerance = param_default(SelectorParam::kApproxTolerance);
  // The random_seed knob in Config and StaticSettings; in a Plan (what select functions read) the
  // stream of its (tensor, step): derive_seed(random_seed, tensor, step).
  uint64_t seed = static_cast<uint64_t>(param_default(SelectorParam::kRandomSeed));
  bool operator==(const SelectorParams&) const = default;
};

// The field of SelectorParams a row stands for. A kNumber row names a double field, a kUint row
// an unsigned one, a kChoice row an enum whose values are the indices of its choices (checked
// in selectors.cc); a field of a new type adds its member-pointer type here.
using ParamField = std::variant<double SelectorParams::*, uint32_t SelectorParams::*, uint64_t SelectorParams::*,
                                GroupNorm SelectorParams::*>;

struct ParamInfo {
  SelectorParam param;
  const char* name;      // the knob's name and the per-tensor override key
  ParamType type;
  double min;            // closed range (kNumber, kUint)
  double max;
  double default_value;  // kNumber, kUint (a kChoice's default is the first of `choices`: 0)
  const char* choices;   // '|'-separated (kChoice), else ""
  bool per_tensor;       // a tensor_overrides key (false: job-wide)
  bool live;             // its knob may change while a job runs (through a decision epoch)
  const char* doc;
  ParamField field;
};

// One row per SelectorParam, in enum order (checked by a static_assert in selectors.cc). Every
// parameter's knob is `agreed` (it shapes the plans, which every node must make alike).
inline constexpr ParamInfo kSelectorParams[kSelectorParamCount] = {
    {.param = SelectorParam::kDensity, .name = "density", .type = ParamType::kNumber, .min = 1e-6, .max = 1.0,
     .default_value = 0.01, .choices = "", .per_tensor = true, .live = true,
     .doc = "fraction of coordinates (or groups, or blocks) kept per step",
     .field = &SelectorParams::density},
    {.param = SelectorParam::kThreshold, .name = "threshold", .type = ParamType::kNumber, .min = 1e-30, .max = 1e30,
     .default_value = 1e-3, .choices = "", .per_tensor = true, .live = true,
     .doc = "lambda of the hard-threshold selector: send |e_i| >= lambda",
     .field = &SelectorParams::threshold},
    {.param = SelectorParam::kBlockSize, .name = "block_size", .type = ParamType::kUint,
     .min = static_cast<double>(kMinBlock), .max = static_cast<double>(kMaxBlock), .default_value = 64,
     .choices = "", .per_tensor = true, .live = true,
     .doc = "block_topk, randblock: elements per contiguous block (the last block may be shorter)",
     .field = &SelectorParams::block_size},
    {.param = SelectorParam::kGroupNorm, .name = "group_norm", .type = ParamType::kChoice, .min = 0, .max = 0,
     .default_value = 0, .choices = "l2|l1", .per_tensor = true, .live = true,
     .doc = "how block/row/column/channel/head selectors rank their groups",
     .field = &SelectorParams::group_norm},
    {.param = SelectorParam::kHeads, .name = "heads", .type = ParamType::kUint, .min = 1, .max = 65536,
     .default_value = 8, .choices = "", .per_tensor = true, .live = true,
     .doc = "head_topk: attention heads, contiguous slices of a tensor's leading dimension",
     .field = &SelectorParams::heads},
    {.param = SelectorParam::kMaskPeriod, .name = "mask_period", .type = ParamType::kUint, .min = 100, .max = 1000,
     .default_value = 100, .choices = "", .per_tensor = true, .live = true,
     .doc = "periodic_mask: steps between recomputing the mask from accumulated |g|",
     .field = &SelectorParams::mask_period},
    {.param = SelectorParam::kHybridDensity, .name = "hybrid_density", .type = ParamType::kNumber, .min = 1e-6,
     .max = 1.0, .default_value = 0.001, .choices = "", .per_tensor = false, .live = true,
     .doc = "hybrid: global lambda keeps this fraction of the previous step's pooled elements (plus each tensor's "
            "top-k)",
     .field = &SelectorParams::hybrid_density},
    {.param = SelectorParam::kQuantile, .name = "quantile", .type = ParamType::kNumber, .min = 1e-6, .max = 1.0,
     .default_value = 0.99, .choices = "", .per_tensor = true, .live = true,
     .doc = "percentile selector: lambda = this quantile of |e| (sampled), so about 1 - quantile is sent",
     .field = &SelectorParams::quantile},
    {.param = SelectorParam::kApproxTolerance, .name = "approx_tolerance", .type = ParamType::kNumber, .min = 0.0,
     .max = 1.0, .default_value = 0.1, .choices = "", .per_tensor = true, .live = true,
     .doc = "topk_approx: relative miss |nnz - k| / k accepted from the sampled threshold before refining to exact",
     .field = &SelectorParams::approx_tolerance},
    {.param = SelectorParam::kRandomSeed, .name = "random_seed", .type = ParamType::kUint, .min = 0, .max = 1.8e19,
     .default_value = 0, .choices = "", .per_tensor = false, .live = true,
     .doc = "job seed of the random selectors' draws (per tensor and step: derive_seed(seed, tensor, step))",
     .field = &SelectorParams::seed},
};
constexpr const ParamInfo& selector_param(SelectorParam p) { return kSelectorParams[static_cast<int>(p)]; }
constexpr double param_default(SelectorParam p) { return selector_param(p).default_value; }

// A parameter's value in the form its row's type takes: a kNumber's is `number`; a kUint's is
// `integer`; a kChoice's is `integer`, the index of the choice in `choices` (0 = the first). Two
// members because a double does not hold every uint64_t (random_seed).
struct ParamValue {
  double number = 0;
  uint64_t integer = 0;
  bool operator==(const ParamValue&) const = default;
};
// Get and set the field of SelectorParams that row `p` names: the one accessor pair all generic
// code (knobs, overrides, plans) reads and writes parameters through. set_param takes a value in
// the row's range (the parsers check it).
ParamValue get_param(const SelectorParams& params, SelectorParam p);
void set_param(SelectorParams& params, SelectorParam p, ParamValue value);

// A kChoice row's choice number `index` ("" if it has none), and the index of `name` (false if
// none of its choices is `name`; *index unchanged).
std::string_view param_choice(const ParamInfo& p, uint64_t index);
bool parse_param_choice(const ParamInfo& p, std::string_view name, uint64_t* index);

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
