#include "daemon/pipeline/device_compressor.h"

#include <algorithm>
#include <cstring>

#include "sparsecar/common/log.h"
#include "sparsecar/kernels/codec.h"
#include "sparsecar/kernels/select.h"
#include "sparsecar/kernels/selectors.h"
#include "sparsecar/policies/observations.h"

namespace sparsecar {

namespace cu = kernels::cuda;

namespace {

constexpr size_t kAlign = 256;
// The budget controller's two magnitude histograms (measure_magnitudes): the GPU's bins are the
// observation's (the kernel's shift, 20, is checked against its bin count in elementwise.cu).
static_assert(cu::kMagnitudeHistogramBins == policies::kMagnitudeBins);
constexpr size_t kHistogramBytes = 2 * cu::kMagnitudeHistogramBins * sizeof(uint64_t);

size_t align_up(size_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

double seconds_since(const Clock& clock, Clock::time_point t0) {
  return std::chrono::duration<double>(clock.now() - t0).count();
}

template <class T>
Status alloc_device(T** out, size_t bytes) {
  SC_ASSIGN_OR_RETURN(void* p, cu::device_alloc(std::max<size_t>(bytes, kAlign)));
  *out = static_cast<T*>(p);
  return Status::Ok();
}

template <class T>
Status alloc_pinned(T** out, size_t bytes) {
  SC_ASSIGN_OR_RETURN(void* p, cu::host_alloc_pinned(std::max<size_t>(bytes, kAlign)));
  *out = static_cast<T*>(p);
  return Status::Ok();
}

// The largest payload of up to `capacity` pairs in any format the device encodes, fp32.
size_t payload_bound(size_t n, size_t capacity) {
  size_t bound = 0;
  for (kernels::Format f : {kernels::Format::kCoo, kernels::Format::kCooVarint, kernels::Format::kBitmap}) {
    bound = std::max(bound, cu::encode_bound_bytes(f, kernels::ValueType::kF32, n, capacity));
  }
  return align_up(bound);
}

}  // namespace

DeviceCompressor::DeviceCompressor(uint32_t id, const TensorSpec& spec, uint32_t world_size, const Clock& clock)
    : id_(id),
      spec_(spec),
      world_(std::max<uint32_t>(world_size, 1)),
      clock_(clock),
      n_(spec.count),
      capacity_(capacity(spec.count)) {}

DeviceCompressor::~DeviceCompressor() {
  if (device_ >= 0) {
    cu::set_device(device_).ignore();
    if (stream_ != nullptr) cu::synchronize(stream_).ignore();
  }
  for (void* p : {static_cast<void*>(residual_), static_cast<void*>(out_), static_cast<void*>(sum_),
                  static_cast<void*>(index_), static_cast<void*>(value_), static_cast<void*>(counters_),
                  static_cast<void*>(norms_), static_cast<void*>(hists_),
                  static_cast<void*>(payload_), static_cast<void*>(upload_), static_cast<void*>(verdicts_),
                  static_cast<void*>(stage_), select_ws_, encode_ws_, decode_ws_}) {
    cu::device_free(p);
  }
  for (void* p : {static_cast<void*>(host_counters_), static_cast<void*>(host_norms_),
                  static_cast<void*>(host_hists_), static_cast<void*>(host_payload_),
                  static_cast<void*>(host_upload_), static_cast<void*>(host_verdicts_),
                  static_cast<void*>(host_dense_)}) {
    cu::host_free_pinned(p);
  }
  cu::event_destroy(step_event_);
  for (auto& o : other_streams_) {
    cu::event_destroy(o.bridge);
    cu::stream_destroy(o.stream);
  }
  cu::stream_destroy(stream_);
}

size_t DeviceCompressor::capacity(uint64_t n) { return static_cast<size_t>(std::min<uint64_t>(n, n / 8 + 4096)); }

uint64_t DeviceCompressor::footprint_bytes(const TensorSpec& spec, uint32_t world_size) {
  const uint64_t n = spec.count;
  const uint64_t bound = payload_bound(n, capacity(n));
  // Pinned: the payload, the peers' uploads, the dense ring buffer, the budget's histograms.
  return bound * std::max<uint32_t>(world_size, 1) + n * sizeof(float) + kHistogramBytes + 5 * kAlign;
}

policies::Plan DeviceCompressor::device_plan(const policies::Plan& plan, std::string* why) {
  policies::Plan p = plan;
  std::string notes;
  auto note = [&](const std::string& s) { notes += (notes.empty() ? "" : "; ") + s; };
  if (!p.dense) {
    if (cu::find_select(p.selector) == nullptr) {
      const kernels::SelectorInfo* row = kernels::find_selector(p.selector);
      note(std::string("selector ") + (row ? std::string(row->name) : std::to_string(static_cast<unsigned>(p.selector))) +
           " has no CUDA function: top-k at the same density");
      p.selector = kernels::Selector::kTopk;
    }
    const kernels::SelectorInfo* row = kernels::find_selector(p.selector);
    if (row != nullptr && row->unbiased && p.error_feedback == policies::ErrorFeedback::kOff) {
      note("random values sent as they are (no 1/p scaling on the device yet)");
    }
    if (p.auto_format) {
      p.auto_format = false;
      p.format = kernels::Format::kCoo;
      note("format auto -> coo");
    } else if (!cu::has_device_codec(p.format)) {
      note(std::string("format ") + std::string(kernels::find_codec(p.format) ? kernels::find_codec(p.format)->name : "?") +
           " has no device codec: coo");
      p.format = kernels::Format::kCoo;
    }
    if (p.value_type != kernels::ValueType::kF32) {
      note("values fp32 (other value types are not sent from the device yet)");
      p.value_type = kernels::ValueType::kF32;
    }
  }
  if (p.error_feedback == policies::ErrorFeedback::kMomentum) {
    note("momentum correction -> plain error feedback");
    p.error_feedback = policies::ErrorFeedback::kResidual;
  }
  if (p.clip_norm > 0.0f) {
    note("no clipping");
    p.clip_norm = 0.0f;
  }
  if (p.lr_rescale != policies::LrRescale::kOff) {
    note("no lr rescaling");
    p.lr_rescale = policies::LrRescale::kOff;
  }
  if (why) *why = notes;
  return p;
}

DeviceCompressor::OtherStream* DeviceCompressor::other(int device) {
  for (auto& o : other_streams_) {
    if (o.device == device) return &o;
  }
  if (!cu::set_device(device).ok()) return nullptr;
  auto s = cu::stream_create();
  auto e = s.ok() ? cu::event_create() : Expected<void*>(s.status());
  cu::set_device(device_).ignore();
  if (!e.ok()) {
    if (s.ok()) cu::stream_destroy(*s);
    return nullptr;
  }
  other_streams_.push_back(OtherStream{device, *s, *e});
  // The copies between the two GPUs go peer to peer where the pair can (NVLink); without it the
  // driver stages them through host memory (2 x 2 H200: 19 ms a step for mlp50 instead of ~7).
  auto there = cu::enable_peer_access(device, device_);
  auto here = cu::enable_peer_access(device_, device);
  if (there.ok() && here.ok() && *there && *here) {
    SC_LOG_INFO("tensor {} '{}': GPU {} <-> GPU {} peer to peer", id_, spec_.name, device_, device);
  } else {
    SC_LOG_WARN("tensor {} '{}': GPU {} <-> GPU {} not peer to peer ({}): copies go through host memory", id_,
                spec_.name, device_, device,
                !there.ok() ? there.status().to_string() : !here.ok() ? here.status().to_string() : "not supported");
  }
  return &other_streams_.back();
}

Status DeviceCompressor::allocate(int device) {
  device_ = device;
  SC_RETURN_IF_ERROR(cu::set_device(device));
  SC_ASSIGN_OR_RETURN(stream_, cu::stream_create());
  SC_ASSIGN_OR_RETURN(step_event_, cu::event_create());
  payload_bound_ = payload_bound(n_, capacity_);
  SC_RETURN_IF_ERROR(alloc_device(&residual_, n_ * sizeof(float)));
  if (pending_restore_.size() == n_) {
    SC_RETURN_IF_ERROR(cu::copy_async(residual_, pending_restore_.data(), n_ * sizeof(float), stream_));
    SC_RETURN_IF_ERROR(cu::synchronize(stream_));
    pending_restore_.clear();
  } else {
    SC_RETURN_IF_ERROR(cu::zero_async(residual_, n_ * sizeof(float), stream_));
  }
  SC_RETURN_IF_ERROR(alloc_device(&out_, n_ * sizeof(float)));
  SC_RETURN_IF_ERROR(alloc_device(&index_, capacity_ * sizeof(uint32_t)));
  SC_RETURN_IF_ERROR(alloc_device(&value_, capacity_ * sizeof(float)));
  SC_RETURN_IF_ERROR(alloc_device(&counters_, 4 * sizeof(uint64_t)));
  SC_RETURN_IF_ERROR(alloc_device(&norms_, 2 * sizeof(double)));
  SC_RETURN_IF_ERROR(alloc_device(&payload_, payload_bound_));
  if (world_ > 1) SC_RETURN_IF_ERROR(alloc_device(&upload_, payload_bound_ * (world_ - 1)));
  SC_RETURN_IF_ERROR(alloc_device(&verdicts_, world_ * sizeof(cu::DecodeStatus)));
  select_ws_bytes_ = cu::select_workspace_bytes(n_, spec_.shape);
  SC_RETURN_IF_ERROR(alloc_device(&select_ws_, select_ws_bytes_));
  encode_ws_bytes_ = 0;
  for (kernels::Format f : {kernels::Format::kCoo, kernels::Format::kCooVarint, kernels::Format::kBitmap}) {
    encode_ws_bytes_ = std::max(encode_ws_bytes_, cu::encode_workspace_bytes(f, kernels::ValueType::kF32, capacity_));
  }
  SC_RETURN_IF_ERROR(alloc_device(&encode_ws_, encode_ws_bytes_));
  decode_ws_bytes_ = cu::decode_workspace_bytes(n_, payload_bound_, world_);
  SC_RETURN_IF_ERROR(alloc_device(&decode_ws_, decode_ws_bytes_));
  SC_RETURN_IF_ERROR(alloc_pinned(&host_counters_, 4 * sizeof(uint64_t)));
  SC_RETURN_IF_ERROR(alloc_pinned(&host_norms_, 2 * sizeof(double)));
  SC_RETURN_IF_ERROR(alloc_pinned(&host_payload_, payload_bound_));
  if (world_ > 1) SC_RETURN_IF_ERROR(alloc_pinned(&host_upload_, payload_bound_ * (world_ - 1)));
  SC_RETURN_IF_ERROR(alloc_pinned(&host_verdicts_, world_ * sizeof(cu::DecodeStatus)));
  SC_RETURN_IF_ERROR(cu::synchronize(stream_));
  SC_LOG_INFO("tensor {} '{}': compressed on GPU {} ({} elements, at most {} sent per step)", id_, spec_.name, device,
              n_, capacity_);
  return Status::Ok();
}

Status DeviceCompressor::ensure_histograms() {
  if (hists_ == nullptr) SC_RETURN_IF_ERROR(alloc_device(&hists_, kHistogramBytes));
  if (host_hists_ == nullptr) SC_RETURN_IF_ERROR(alloc_pinned(&host_hists_, kHistogramBytes));
  return Status::Ok();
}

Status DeviceCompressor::queue_histograms() {
  SC_RETURN_IF_ERROR(ensure_histograms());
  uint64_t* magnitude = hists_;
  uint64_t* gradient = hists_ + cu::kMagnitudeHistogramBins;
  SC_RETURN_IF_ERROR(cu::zero_async(hists_, kHistogramBytes, stream_));
  SC_RETURN_IF_ERROR(cu::magnitude_histogram_add(residual_, n_, nullptr, magnitude, stream_));
  SC_RETURN_IF_ERROR(cu::magnitude_histogram_add(value_, capacity_, counters_, magnitude, stream_));
  SC_RETURN_IF_ERROR(cu::magnitude_histogram_add(grad_, n_, nullptr, gradient, stream_));
  return cu::copy_async(host_hists_, hists_, kHistogramBytes, stream_);
}

std::span<const uint64_t> DeviceCompressor::last_magnitude_hist() const {
  if (!magnitudes_measured_) return {};
  return {host_hists_, cu::kMagnitudeHistogramBins};
}

std::span<const uint64_t> DeviceCompressor::last_gradient_hist() const {
  if (!magnitudes_measured_) return {};
  return {host_hists_ + cu::kMagnitudeHistogramBins, cu::kMagnitudeHistogramBins};
}

Status DeviceCompressor::ensure_dense_host() {
  if (host_dense_ != nullptr) return Status::Ok();
  return alloc_pinned(&host_dense_, n_ * sizeof(float));
}

Status DeviceCompressor::begin(std::span<const DeviceBuffer> inputs) {
  SC_CHECK(pending_ == Pending::kNone, "begin() while a step is pending");
  if (inputs.empty()) return invalid_argument("a device step without device buffers");
  if (inputs.size() > cu::kMaxSumInputs) {
    return invalid_argument(std::to_string(inputs.size()) + " local trainers; the device path sums at most " +
                            std::to_string(cu::kMaxSumInputs));
  }
  for (const DeviceBuffer& b : inputs) {
    if (b.data == nullptr || b.ready_event == nullptr || b.done_event == nullptr || b.device < 0) {
      return invalid_argument("a device buffer without memory, events or device");
    }
  }
  if (device_ < 0) {
    Status s = allocate(inputs[0].device);
    if (!s.ok()) return s.with_context("allocating tensor '" + spec_.name + "' on GPU " + std::to_string(inputs[0].device));
  }
  SC_RETURN_IF_ERROR(cu::set_device(device_));
  queued_.clear();
  uploaded_ = 0;
  last_grad_norm2_ = last_residual_norm2_ = -1;
  magnitudes_measured_ = false;
  for (const DeviceBuffer& b : inputs) {
    if (b.device == device_) SC_RETURN_IF_ERROR(cu::stream_wait_event(stream_, b.ready_event));
  }
  const bool local = std::all_of(inputs.begin(), inputs.end(), [&](const DeviceBuffer& b) { return b.device == device_; });
  if (inputs.size() == 1 && local) {
    grad_ = inputs[0].data;
    return Status::Ok();
  }
  if (sum_ == nullptr) SC_RETURN_IF_ERROR(alloc_device(&sum_, n_ * sizeof(float)));
  // Buffers on other GPUs are copied here first (a peer copy), then everything is summed at once.
  const size_t remote = static_cast<size_t>(
      std::count_if(inputs.begin(), inputs.end(), [&](const DeviceBuffer& b) { return b.device != device_; }));
  if (remote > stage_buffers_) {
    cu::device_free(stage_);
    stage_ = nullptr;
    stage_buffers_ = 0;
    SC_RETURN_IF_ERROR(alloc_device(&stage_, remote * n_ * sizeof(float)));
    stage_buffers_ = remote;
  }
  std::vector<const float*> src;
  size_t staged = 0;
  for (const DeviceBuffer& b : inputs) {
    if (b.device == device_) {
      src.push_back(b.data);
      continue;
    }
    // On the trainer's GPU: wait for `ready`, copy the buffer here, then stream_ waits for that.
    float* at = stage_ + staged++ * n_;
    OtherStream* o = other(b.device);
    if (o == nullptr) return internal_error("no stream on GPU " + std::to_string(b.device));
    SC_RETURN_IF_ERROR(cu::set_device(b.device));
    Status s = cu::stream_wait_event(o->stream, b.ready_event);
    if (s.ok()) s = cu::copy_async(at, b.data, n_ * sizeof(float), o->stream);
    if (s.ok()) s = cu::event_record(o->bridge, o->stream);
    SC_RETURN_IF_ERROR(cu::set_device(device_));
    SC_RETURN_IF_ERROR(s);
    SC_RETURN_IF_ERROR(cu::stream_wait_event(stream_, o->bridge));
    src.push_back(at);
  }
  SC_RETURN_IF_ERROR(cu::local_sum(sum_, src, n_, stream_));
  grad_ = sum_;
  return Status::Ok();
}

Expected<DeviceCompressor::Encoded> DeviceCompressor::compress(const policies::Plan& plan) {
  SC_CHECK(pending_ == Pending::kNone && grad_ != nullptr, "compress() outside a begun step");
  const cu::SelectFn select = cu::find_select(plan.selector);
  if (select == nullptr) return invalid_argument("compress() needs a plan from device_plan()");
  clear_residual_on_commit_ = plan.error_feedback == policies::ErrorFeedback::kOff;
  if (clear_residual_on_commit_) SC_RETURN_IF_ERROR(cu::zero_async(residual_, n_ * sizeof(float), stream_));
  kernels::SelectorParams params = plan.params;
  // Top-k rows: never more than the selection holds.
  const size_t want = kernels::topk_count(n_, params.density);
  if (want > capacity_) params.density = static_cast<double>(capacity_) / static_cast<double>(n_);
  cu::SelectArgs a;
  a.residual = residual_;
  a.grad = grad_;
  a.n = n_;
  a.params = &params;
  a.clear_sent = true;
  a.unbiased = false;
  a.out = cu::DeviceSelection{index_, value_, capacity_, counters_};
  a.ws = cu::Workspace{select_ws_, select_ws_bytes_};
  a.stream = stream_;
  a.shape = spec_.shape;
  if (measure_) SC_RETURN_IF_ERROR(cu::norm2(grad_, n_, norms_, stream_));  // before select adds it to the residual
  SC_RETURN_IF_ERROR(select(a));
  // From here the gradient is in the residual and the selection out of it: rollback() gives it back.
  pending_ = Pending::kSparse;
  const auto encode_started = clock_.now();
  kernels::EncodeParams ep;
  ep.format = plan.format;
  ep.value_type = kernels::ValueType::kF32;
  Status s = cu::encode(ep, n_, a.out, cu::DevicePayloadOut{payload_, payload_bound_, counters_ + 1, counters_ + 2},
                        cu::Workspace{encode_ws_, encode_ws_bytes_}, stream_);
  if (s.ok()) s = cu::copy_async(host_counters_, counters_, 3 * sizeof(uint64_t), stream_);
  if (s.ok() && measure_) s = cu::copy_async(host_norms_, norms_, sizeof(double), stream_);
  // The selection has run: the residual it leaves, what it took, and the local sum.
  if (s.ok() && measure_magnitudes_) s = queue_histograms();
  if (s.ok()) s = cu::synchronize(stream_);
  if (!s.ok()) {
    rollback();
    return s;
  }
  if (measure_) last_grad_norm2_ = host_norms_[0];
  magnitudes_measured_ = measure_magnitudes_;
  const uint64_t count = std::min<uint64_t>(host_counters_[0], capacity_);
  const uint64_t bytes = host_counters_[1];
  const uint64_t nnz = host_counters_[2];
  if (bytes > payload_bound_ || nnz != count) {
    rollback();
    return internal_error("device encoding wrote " + std::to_string(bytes) + " bytes for " + std::to_string(nnz) +
                          " of " + std::to_string(count) + " selected entries");
  }
  s = cu::copy_async(host_payload_, payload_, bytes, stream_);
  if (s.ok()) s = cu::synchronize(stream_);
  if (!s.ok()) {
    rollback();
    return s;
  }
  Encoded e;
  e.format = ep.format;
  e.value_type = ep.value_type;
  e.nnz = nnz;
  e.selected = count;
  e.payload = std::span<const std::byte>(host_payload_, bytes);
  e.encode_seconds = seconds_since(clock_, encode_started);
  queued_.reserve(world_);
  return e;
}

Status DeviceCompressor::add_payload(const GatheredPayload& g) {
  Queued q;
  q.from = g.from;
  q.payload.format = g.format;
  q.payload.value_type = g.value_type;
  q.payload.nnz = g.nnz;
  q.payload.bytes = g.payload.size();
  if (g.payload.data() == host_payload_) {
    q.payload.data = payload_;  // the own selection: already on the device
  } else {
    if (g.payload.size() > payload_bound_) {
      return data_loss(g.from + " sent a payload of " + std::to_string(g.payload.size()) +
                       " bytes; a tensor of " + std::to_string(n_) + " elements takes at most " +
                       std::to_string(payload_bound_));
    }
    if (uploaded_ + 1 >= world_) return internal_error("more peer payloads than peers");
    const size_t at = uploaded_++ * payload_bound_;
    std::memcpy(host_upload_ + at, g.payload.data(), g.payload.size());
    SC_RETURN_IF_ERROR(cu::copy_async(upload_ + at, host_upload_ + at, g.payload.size(), stream_));
    q.payload.data = upload_ + at;
  }
  queued_.push_back(std::move(q));
  return Status::Ok();
}

Status DeviceCompressor::finish_sparse(uint32_t average_over) {
  std::vector<cu::DevicePayload> payloads;
  for (const Queued& q : queued_) payloads.push_back(q.payload);
  SC_RETURN_IF_ERROR(cu::zero_async(out_, n_ * sizeof(float), stream_));
  SC_RETURN_IF_ERROR(cu::decode_accumulate(payloads, out_, n_, average_over, verdicts_,
                                           cu::Workspace{decode_ws_, decode_ws_bytes_}, stream_));
  SC_RETURN_IF_ERROR(cu::copy_async(host_verdicts_, verdicts_, payloads.size() * sizeof(cu::DecodeStatus), stream_));
  SC_RETURN_IF_ERROR(cu::synchronize(stream_));
  for (size_t j = 0; j < payloads.size(); ++j) {
    Status v = cu::decode_status(payloads[j], n_, host_verdicts_[j]);
    if (!v.ok()) return v.with_context("decoding from " + queued_[j].from);
  }
  return Status::Ok();
}

Status DeviceCompressor::queue_dense_sum(const policies::Plan& plan) {
  SC_CHECK(pending_ == Pending::kNone && grad_ != nullptr, "a dense step outside a begun step");
  clear_residual_on_commit_ = false;
  if (plan.error_feedback == policies::ErrorFeedback::kOff) {
    SC_RETURN_IF_ERROR(cu::zero_async(residual_, n_ * sizeof(float), stream_));
  }
  // out = residual + sum (a float64 sum of two floats rounds like the float addition).
  const float* pair[2] = {residual_, grad_};
  if (measure_) {
    SC_RETURN_IF_ERROR(cu::norm2(grad_, n_, norms_, stream_));
    SC_RETURN_IF_ERROR(cu::copy_async(host_norms_, norms_, sizeof(double), stream_));
  }
  return cu::local_sum(out_, pair, n_, stream_);
}

Status DeviceCompressor::dense_summed() {
  SC_RETURN_IF_ERROR(cu::synchronize(stream_));
  if (measure_) last_grad_norm2_ = host_norms_[0];
  pending_ = Pending::kDense;
  return Status::Ok();
}

Expected<std::span<float>> DeviceCompressor::dense_input(const policies::Plan& plan) {
  SC_RETURN_IF_ERROR(ensure_dense_host());
  SC_RETURN_IF_ERROR(queue_dense_sum(plan));
  SC_RETURN_IF_ERROR(cu::copy_async(host_dense_, out_, n_ * sizeof(float), stream_));
  SC_RETURN_IF_ERROR(dense_summed());
  return std::span<float>(host_dense_, n_);
}

Status DeviceCompressor::dense_share(const policies::Plan& plan, uint32_t average_over) {
  SC_RETURN_IF_ERROR(queue_dense_sum(plan));
  if (average_over > 1) SC_RETURN_IF_ERROR(cu::scale(out_, n_, 1.0f / static_cast<float>(average_over), stream_));
  return dense_summed();
}

Status DeviceCompressor::finish_dense(uint32_t average_over) {
  if (average_over > 0) {
    const float inv = 1.0f / static_cast<float>(average_over);
    for (size_t i = 0; i < n_; ++i) host_dense_[i] *= inv;
  }
  SC_RETURN_IF_ERROR(cu::copy_async(out_, host_dense_, n_ * sizeof(float), stream_));
  return cu::synchronize(stream_);
}

void DeviceCompressor::commit() {
  if (pending_ == Pending::kDense || (pending_ == Pending::kSparse && clear_residual_on_commit_)) {
    Status s = cu::zero_async(residual_, n_ * sizeof(float), stream_);
    if (!s.ok()) SC_LOG_ERROR("tensor '{}': clearing the device residual failed: {}", spec_.name, s.to_string());
  }
  pending_ = Pending::kNone;
}

void DeviceCompressor::rollback() {
  Status s;
  if (pending_ == Pending::kSparse) {
    s = cu::scatter_add(cu::DeviceSelection{index_, value_, capacity_, counters_}, residual_, n_, stream_);
  } else if (pending_ == Pending::kDense) {
    const float* pair[2] = {residual_, grad_};
    s = cu::local_sum(residual_, pair, n_, stream_);
  }
  if (!s.ok()) SC_LOG_ERROR("tensor '{}': giving the step back to the device residual failed: {}", spec_.name, s.to_string());
  pending_ = Pending::kNone;
  magnitudes_measured_ = false;  // a failed step's histograms describe no step
}

Status DeviceCompressor::read_residual(std::vector<float>* out) {
  out->assign(n_, 0.0f);
  if (device_ < 0) {
    if (pending_restore_.size() == n_) *out = pending_restore_;
    return Status::Ok();
  }
  SC_RETURN_IF_ERROR(cu::set_device(device_));
  SC_RETURN_IF_ERROR(cu::copy_async(out->data(), residual_, n_ * sizeof(float), stream_));
  return cu::synchronize(stream_);
}

Status DeviceCompressor::write_residual(std::span<const float> values) {
  if (values.size() != n_) return invalid_argument("a residual of " + std::to_string(values.size()) + " elements for a tensor of " + std::to_string(n_));
  if (device_ < 0) {
    pending_restore_.assign(values.begin(), values.end());
    return Status::Ok();
  }
  SC_RETURN_IF_ERROR(cu::set_device(device_));
  SC_RETURN_IF_ERROR(cu::copy_async(residual_, values.data(), n_ * sizeof(float), stream_));
  return cu::synchronize(stream_);
}

Status DeviceCompressor::release_untouched(std::span<const DeviceBuffer> buffers) {
  Status first;
  for (const DeviceBuffer& b : buffers) {
    if (b.done_event == nullptr || b.device < 0) continue;
    Status s = cu::set_device(b.device);
    if (s.ok()) s = cu::event_record(b.done_event, nullptr);
    if (first.ok() && !s.ok()) first = std::move(s);
  }
  return first;
}

Status DeviceCompressor::end(std::span<const DeviceBuffer> outputs, bool ok) {
  grad_ = nullptr;
  queued_.clear();
  uploaded_ = 0;
  if (device_ < 0) return release_untouched(outputs);  // nothing of this step ran on a GPU
  Status first;
  auto keep = [&](Status s) {
    if (first.ok() && !s.ok()) first = std::move(s);
  };
  keep(cu::set_device(device_));
  for (const DeviceBuffer& b : outputs) {
    if (b.device != device_) continue;
    if (ok) keep(cu::copy_async(b.data, out_, n_ * sizeof(float), stream_));
    if (b.done_event != nullptr) keep(cu::event_record(b.done_event, stream_));
  }
  keep(cu::event_record(step_event_, stream_));
  // Other GPUs' buffers: written and released on a stream of their own GPU, after stream_'s work.
  for (const DeviceBuffer& b : outputs) {
    if (b.device == device_) continue;
    OtherStream* o = other(b.device);
    if (o == nullptr) {
      keep(internal_error("no stream on GPU " + std::to_string(b.device)));
      continue;
    }
    keep(cu::set_device(b.device));
    keep(cu::stream_wait_event(o->stream, step_event_));
    if (ok) keep(cu::copy_async(b.data, out_, n_ * sizeof(float), o->stream));
    if (b.done_event != nullptr) keep(cu::event_record(b.done_event, o->stream));
    keep(cu::set_device(device_));
  }
  // After the trainers are released: the residual the step leaves, for the controllers.
  const bool measured = ok && measure_ && first.ok();
  if (measured) {
    keep(cu::norm2(residual_, n_, norms_ + 1, stream_));
    keep(cu::copy_async(host_norms_ + 1, norms_ + 1, sizeof(double), stream_));
  }
  keep(cu::synchronize(stream_));
  for (auto& o : other_streams_) keep(cu::synchronize(o.stream));
  last_residual_norm2_ = measured && first.ok() ? host_norms_[1] : -1;
  return first;
}

}  // namespace sparsecar
