#include "daemon/pipeline/observations.h"

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <memory>
#include <sstream>
#include <utility>

#include "daemon/pipeline/controller_runner.h"
#include "daemon/pipeline/settings.h"
#include "daemon/transport/text_message.h"
#include "daemon/transport/wire.h"
#include "sparsecar/kernels/ef.h"
#include "sparsecar/policies/link_model.h"
#include "sparsecar/common/log.h"

namespace sparsecar {
namespace {

constexpr size_t kMaxMetricNames = 64;
constexpr size_t kMaxTensorLines = 1 << 20;
constexpr size_t kMaxLinkSamples = 4096;  // per observation (a transport keeps 1024)

// Controllers that run on rank 0 (and so need measurements): the registry's job-level rows.
const policies::ControllerSet kRank0Controllers = policies::job_level_controllers();

}  // namespace

std::string format_observation(const policies::NodeObservation& o) {
  std::string out;
  char buf[256];
  auto line = [&](const char* key, double v) {
    std::snprintf(buf, sizeof buf, "%s %.17g\n", key, v);
    out += buf;
  };
  line("rank", o.rank);
  line("step", static_cast<double>(o.step));
  line("elements", static_cast<double>(o.elements));
  line("nnz", static_cast<double>(o.nnz));
  line("bytes_sent", static_cast<double>(o.bytes_sent));
  line("dense_bytes", static_cast<double>(o.dense_bytes));
  line("exchange_s", o.exchange_s);
  line("encode_s", o.encode_s);
  line("decode_s", o.decode_s);
  line("reduce_s", o.reduce_s);
  line("link_bytes", static_cast<double>(o.link_bytes));
  line("link_s", o.link_s);
  line("grad_norm2", o.grad_norm2);
  line("residual_norm2", o.residual_norm2);
  line("compute_s", o.compute_s);
  if (o.period_s > 0) line("period_s", o.period_s);  // added with step controller v3; older parsers skip it
  if (o.device_elements > 0) line("device_elements", static_cast<double>(o.device_elements));  // v9, likewise
  if (o.trainer_elements > 0) line("trainer_elements", static_cast<double>(o.trainer_elements));  // likewise
  if (o.has_loss) line("loss", o.loss);
  if (o.has_loss_target) line("loss_target", o.loss_target);
  if (o.magnitude_elements > 0 && o.magnitude_hist.size() == policies::kMagnitudeBins &&
      o.gradient_hist.size() == policies::kMagnitudeBins) {
    // Added in v2 of the budget controller; older parsers skip these keys (one value each).
    line("magnitude_elements", static_cast<double>(o.magnitude_elements));
    line("threshold", o.threshold);
    auto bins = [&](const char* prefix, const std::vector<uint64_t>& hist) {
      for (uint32_t b = 0; b < policies::kMagnitudeBins; ++b) {
        if (hist[b] == 0) continue;
        std::snprintf(buf, sizeof buf, "%s%u %llu\n", prefix, b, static_cast<unsigned long long>(hist[b]));
        out += buf;
      }
    };
    bins("mh", o.magnitude_hist);
    bins("gh", o.gradient_hist);
  }
  for (const auto& l : o.link_samples) {
    std::snprintf(buf, sizeof buf, "lk %u %llu %.9g\n", l.peer, static_cast<unsigned long long>(l.bytes), l.seconds);
    out += buf;
  }
  for (const auto& t : o.tensors) {
    std::snprintf(buf, sizeof buf, "tensor %u %llu %llu %.9g\n", t.tensor_id, static_cast<unsigned long long>(t.elements),
                  static_cast<unsigned long long>(t.nnz), t.repeat_fraction);
    out += buf;
  }
  return out;
}

Expected<policies::NodeObservation> parse_observation(std::string_view text) {
  policies::NodeObservation o;
  std::istringstream is{std::string(text)};
  std::string key;
  size_t tensors = 0;
  while (is >> key) {
    if (key == "tensor") {
      policies::TensorStepObservation t;
      // Read as signed so that "-1" is refused rather than wrapped.
      int64_t id = 0, elements = 0, nnz = 0;
      if (!(is >> id >> elements >> nnz >> t.repeat_fraction) || ++tensors > kMaxTensorLines || id < 0 ||
          id > INT32_MAX || elements < 0 || nnz < 0 || nnz > elements || !(t.repeat_fraction >= -1.0) ||
          !(t.repeat_fraction <= 1.0)) {  // -1: unknown
        return data_loss("observation: bad tensor line");
      }
      t.tensor_id = static_cast<uint32_t>(id);
      t.elements = static_cast<uint64_t>(elements);
      t.nnz = static_cast<uint64_t>(nnz);
      o.tensors.push_back(t);
      continue;
    }
    if (key == "lk") {  // a link sample: sender rank, bytes, seconds
      int64_t peer = 0, bytes = 0;
      double seconds = 0;
      if (!(is >> peer >> bytes >> seconds) || o.link_samples.size() >= kMaxLinkSamples || peer < 0 ||
          peer > INT32_MAX || bytes <= 0 || !std::isfinite(seconds) || !(seconds > 0) || seconds > 3600) {
        return data_loss("observation: bad link sample line");
      }
      o.link_samples.push_back({.peer = static_cast<uint32_t>(peer), .bytes = static_cast<uint64_t>(bytes),
                                .seconds = seconds});
      continue;
    }
    double v = 0;
    if (!(is >> v) || !std::isfinite(v)) return data_loss("observation: bad value for '" + key + "'");
    // Counts and times come from a peer: a negative or out-of-range value (a cast of it would be
    // undefined) is refused, not converted.
    const bool signed_value = key == "loss" || key == "loss_target" || key == "compute_s";  // compute_s < 0: unknown
    if (!signed_value && v < 0) return data_loss("observation: negative value for '" + key + "'");
    auto count = [&](uint64_t max) -> Expected<uint64_t> {
      if (v > static_cast<double>(max)) return data_loss("observation: value for '" + key + "' out of range");
      return static_cast<uint64_t>(v);
    };
    constexpr uint64_t kMaxCount = uint64_t{1} << 53;  // exact in a double
    if (key == "rank") {
      SC_ASSIGN_OR_RETURN(uint64_t rank, count(UINT32_MAX));
      o.rank = static_cast<uint32_t>(rank);
    } else if (key == "step") {
      SC_ASSIGN_OR_RETURN(o.step, count(kMaxCount));
    } else if (key == "elements") {
      SC_ASSIGN_OR_RETURN(o.elements, count(kMaxCount));
    } else if (key == "device_elements") {
      SC_ASSIGN_OR_RETURN(o.device_elements, count(kMaxCount));
    } else if (key == "trainer_elements") {
      SC_ASSIGN_OR_RETURN(o.trainer_elements, count(kMaxCount));
    } else if (key == "nnz") {
      SC_ASSIGN_OR_RETURN(o.nnz, count(kMaxCount));
    } else if (key == "bytes_sent") {
      SC_ASSIGN_OR_RETURN(o.bytes_sent, count(kMaxCount));
    } else if (key == "dense_bytes") {
      SC_ASSIGN_OR_RETURN(o.dense_bytes, count(kMaxCount));
    } else if (key == "exchange_s") {
      o.exchange_s = v;
    } else if (key == "encode_s") {
      o.encode_s = v;
    } else if (key == "decode_s") {
      o.decode_s = v;
    } else if (key == "reduce_s") {
      o.reduce_s = v;
    } else if (key == "link_bytes") {
      SC_ASSIGN_OR_RETURN(o.link_bytes, count(kMaxCount));
    } else if (key == "link_s") {
      o.link_s = v;
    } else if (key == "grad_norm2") {
      o.grad_norm2 = v;
    } else if (key == "residual_norm2") {
      o.residual_norm2 = v;
    } else if (key == "compute_s") {
      o.compute_s = v;
    } else if (key == "period_s") {
      if (v > 3600) return data_loss("observation: value for 'period_s' out of range");
      o.period_s = v;
    } else if (key == "loss") {
      o.loss = v;
      o.has_loss = true;
    } else if (key == "loss_target") {
      o.loss_target = v;
      o.has_loss_target = true;
    } else if (key == "magnitude_elements") {
      SC_ASSIGN_OR_RETURN(o.magnitude_elements, count(kMaxCount));
    } else if (key == "threshold") {
      o.threshold = v;
    } else if (key.size() > 2 && (key.starts_with("mh") || key.starts_with("gh"))) {
      // "mh<bin> <count>": a bin of the magnitude (mh) or gradient (gh) histogram.
      uint32_t bin = 0;
      const auto [end, ec] = std::from_chars(key.data() + 2, key.data() + key.size(), bin);
      if (ec != std::errc{} || end != key.data() + key.size() || bin >= policies::kMagnitudeBins) {
        return data_loss("observation: bad histogram bin '" + key + "'");
      }
      auto& hist = key[0] == 'm' ? o.magnitude_hist : o.gradient_hist;
      if (hist.empty()) hist.assign(policies::kMagnitudeBins, 0);
      SC_ASSIGN_OR_RETURN(hist[bin], count(kMaxCount));
    }  // unknown keys: from a newer peer; ignored
  }
  if (o.device_elements > o.elements) return data_loss("observation: device_elements exceeds elements");
  if (o.trainer_elements > o.elements) return data_loss("observation: trainer_elements exceeds elements");
  if (o.magnitude_elements == 0) {
    o.magnitude_hist.clear();  // bins without their population: unusable
    o.gradient_hist.clear();
  } else {
    if (o.magnitude_hist.empty()) o.magnitude_hist.assign(policies::kMagnitudeBins, 0);
    if (o.gradient_hist.empty()) o.gradient_hist.assign(policies::kMagnitudeBins, 0);
  }
  return o;
}

double trainer_compute_s(const std::map<std::string, double>& metrics) {
  // name, scale to seconds; the first one reported wins.
  static constexpr std::pair<const char*, double> kNames[] = {
      {"compute_time", 1.0}, {"compute_time_ms", 1e-3}, {"step_time_ms", 1e-3}, {"hook_compute_time", 1.0}};
  for (const auto& [name, scale] : kNames) {
    auto it = metrics.find(name);
    if (it == metrics.end()) continue;
    const double s = it->second * scale;
    // A time no step takes is no time: unknown (the observation's parser refuses > 1 h periods too).
    return std::isfinite(s) && s >= 0 && s <= 3600 ? s : -1;
  }
  return -1;
}

double StepPeriod::on_finish(uint64_t step, Clock::time_point now, uint32_t lease) {
  const bool follows = has_last_ && step > last_step_ && step - last_step_ <= uint64_t{lease_} + 1 && now > last_;
  const double seconds =
      follows ? std::chrono::duration<double>(now - last_).count() / static_cast<double>(step - last_step_) : 0.0;
  has_last_ = true;
  last_step_ = step;
  lease_ = lease;
  last_ = now;
  return seconds;
}

ObservationCollector::ObservationCollector(uint32_t rank, uint64_t job_id, Transport* transport,
                                           ControllerRunner* runner, const Clock& clock, Metrics* metrics)
    : rank_(rank),
      job_id_(job_id),
      transport_(transport),
      runner_(runner),
      clock_(clock),
      probe_(rank, job_id, transport, metrics, clock) {}

void ObservationCollector::on_metric(const std::string& name, double value, uint64_t step) {
  std::optional<policies::StartHint> hint;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // The trainer's dense first steps (the DDP hook reports "dense_wait_s" then "dense_step_s" of
    // one step, before its first submit): rank 0's controllers weigh them before the first step.
    // "momentum_correction" (1: the hook corrects momentum) comes before them: it prices a
    // sparse step for the whole job (step_dense_worth_corrected), on every node (the probe's pace).
    if (name == "momentum_correction") {
      corrected_ = value > 0.5;
    } else if (name == "dense_wait_s") {
      dense_wait_ = {step, value};
    } else if (name == "dense_step_s" && dense_wait_ && dense_wait_->first == step) {
      hint = policies::StartHint{step, value, dense_wait_->second, corrected_};
      hint_wait_s_ = dense_wait_->second;
      hint_step_s_ = value;
      dense_wait_.reset();
    }
    if (metrics_.size() < kMaxMetricNames || metrics_.count(name) != 0) metrics_[name] = value;
  }
  if (hint && runner_ != nullptr) runner_->start_hint(*hint);
}

void ObservationCollector::on_reset() {
  current_.reset();
  ready_.clear();  // the finished job's: the next job's steps start again at 0
  period_.reset();
  if (const std::string probes = probe_.job_summary(); !probes.empty()) SC_LOG_INFO("{}", probes);
  probe_.reset();
  probe_facts_.reset();
  records_ = 0;
  last_selected_.clear();
  {
    std::lock_guard<std::mutex> lock(mu_);
    dense_wait_.reset();
    hint_wait_s_ = hint_step_s_ = 0;
    corrected_ = false;
  }
  if (runner_) runner_->reset();
}

void ObservationCollector::on_tensor_step(const TensorStepRecord& r, const Decision& decision) {
  if (!active_config_ || decision.config.get() != active_config_.get()) {
    active_config_ = decision.config;
    auto parsed = decision.config ? policies::parse_controllers(decision.config->controller)
                                  : Expected<policies::ControllerSet>(policies::ControllerSet{0});
    active_ = parsed.ok() ? *parsed : 0;
    // The step controller prices messages of every size: receivers time one in
    // step_timed_send_every of the small ones too.
    if (transport_ != nullptr) {
      const bool step = policies::has(active_, policies::ControllerKind::kStep);
      transport_->set_timed_sends(step ? static_cast<uint32_t>(decision.config->step_timed_send_every) : 0);
    }
  }
  const policies::ControllerSet active = active_;
  // Counters always (rank 0 needs them to notice a controller was switched off and revert it);
  // the passes over the data only while a controller listens.
  const bool measure = (active & kRank0Controllers) != 0;
  // ||local sum||^2 is read by the accuracy and gradnorm controllers only: on the host it is a
  // pass over the gradient before the step's result goes out (kernels::norm2 of 85 k floats:
  // 17-25 us on the 2-core box), which the step, bandwidth and budget controllers do not pay for.
  const bool measure_gradient = policies::has(active, policies::ControllerKind::kAccuracy) ||
                                policies::has(active, policies::ControllerKind::kGradNorm);
  if (current_ && current_->step != r.step) finish(decision);  // a tensor of the last step never came
  if (!current_) {
    current_.emplace();
    current_->rank = rank_;
    current_->step = r.step;
    records_ = 0;
    magnitudes_incomplete_ = false;
    lease_ = r.lease_steps;
  }
  lease_ = std::min(lease_, r.lease_steps);
  expected_records_ = r.tensors_in_job;
  auto& o = *current_;
  ++records_;
  o.elements += r.elements;
  if (r.on_device) o.device_elements += r.elements;
  if (r.trainer_reduced) o.trainer_elements += r.elements;
  o.nnz += r.nnz;
  o.bytes_sent += r.bytes_sent;
  o.dense_bytes += r.dense_bytes;
  o.exchange_s += r.exchange_s;
  o.encode_s += r.encode_s;
  o.decode_s += r.decode_s;
  o.reduce_s += r.reduce_s;
  o.link_bytes += r.link_bytes;
  o.link_s += r.link_s;
  if (measure) {
    if (measure_gradient) o.grad_norm2 += r.grad_norm2 >= 0 ? r.grad_norm2 : kernels::norm2(r.local_sum);
    if (r.residual_norm2 >= 0) {
      o.residual_norm2 += r.residual_norm2;
    } else if (r.residual_norm2 != TensorStepRecord::kNormLater) {
      o.residual_norm2 += kernels::norm2(r.residual);
    }
  }
  if (policies::has(active, policies::ControllerKind::kBudget)) add_magnitudes(r, decision);
  policies::TensorStepObservation t;
  t.tensor_id = r.tensor_id;
  t.elements = r.elements;
  t.nnz = r.nnz;
  if (policies::has(active, policies::ControllerKind::kFrequency) && r.ok && !r.plan.dense) {
    // Selected coordinates are the residual's exact zeros after the commit (top-k/threshold
    // clear what they send); compare with the previous step's zeros.
    auto& bits = last_selected_[r.tensor_id];
    const size_t words = (r.residual.size() + 63) / 64;
    const bool had = bits.size() == words;
    if (!had) bits.assign(words, 0);
    uint64_t now = 0, both = 0;
    for (size_t w = 0; w < words; ++w) {
      uint64_t mask = 0;
      const size_t end = std::min(r.residual.size(), (w + 1) * 64);
      for (size_t i = w * 64; i < end; ++i) mask |= uint64_t{r.residual[i] == 0.0f} << (i - w * 64);
      now += static_cast<uint64_t>(std::popcount(mask));
      both += static_cast<uint64_t>(std::popcount(mask & bits[w]));
      bits[w] = mask;
    }
    if (had && now > 0) t.repeat_fraction = static_cast<double>(both) / static_cast<double>(now);
  }
  o.tensors.push_back(t);
  if (records_ >= expected_records_) finish(decision);
}

void ObservationCollector::add_magnitudes(const TensorStepRecord& r, const Decision& decision) {
  auto& o = *current_;
  if (!r.ok) {
    magnitudes_incomplete_ = true;
    return;
  }
  if (r.plan.dense) return;  // sent whole: no lambda applies to it
  const bool measured = r.magnitude_hist.size() == policies::kMagnitudeBins &&
                        r.gradient_hist.size() == policies::kMagnitudeBins;  // on the GPU
  if (!measured &&
      (r.selected.size() != r.nnz || r.residual.size() != r.elements || r.local_sum.size() != r.elements)) {
    magnitudes_incomplete_ = true;  // e.g. scaled (random) selections, or a device step not measured
    return;
  }
  if (o.magnitude_hist.empty()) {
    o.magnitude_hist.assign(policies::kMagnitudeBins, 0);
    o.gradient_hist.assign(policies::kMagnitudeBins, 0);
  }
  if (measured) {
    for (uint32_t b = 0; b < policies::kMagnitudeBins; ++b) {
      o.magnitude_hist[b] += r.magnitude_hist[b];
      o.gradient_hist[b] += r.gradient_hist[b];
    }
  } else {
    // Pre-selection |residual + g|: what stayed (the residual after the commit) plus what left
    // (the selected values); the selected coordinates' own residual (zero) lands in the lowest bins.
    policies::magnitude_hist_add(o.magnitude_hist, r.residual);
    policies::magnitude_hist_add(o.magnitude_hist, r.selected);
    policies::magnitude_hist_add(o.gradient_hist, r.local_sum);
  }
  o.magnitude_elements += r.elements;
  // The `threshold` knob in force, not the tensor's own lambda (per-tensor scales divide it):
  // the controller moves the knob.
  if (r.plan.selector == kernels::Selector::kThreshold) {
    o.threshold = decision.config ? decision.config->selector_params.threshold : r.plan.params.threshold;
  }
}

void ObservationCollector::finish(const Decision& decision) {
  if (!current_) return;
  policies::NodeObservation o = std::move(*current_);
  current_.reset();
  // A step missing a tensor's record may have leased less than lease_ (the trainers take the
  // least over the tensors): then no gap after it counts as leased.
  const uint32_t lease = records_ >= expected_records_ ? lease_ : 0;
  records_ = 0;
  o.period_s = period_.on_finish(o.step, clock_.now(), lease);
  if (magnitudes_incomplete_) {
    // A tensor of the step is missing from them: its quantiles would be another population's.
    o.magnitude_hist.clear();
    o.gradient_hist.clear();
    o.magnitude_elements = 0;
    o.threshold = 0;
  }
  double hint_wait_s = 0, hint_step_s = 0;
  bool corrected = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    corrected = corrected_;
    hint_wait_s = std::exchange(hint_wait_s_, 0.0);
    hint_step_s = std::exchange(hint_step_s_, 0.0);
    const std::string metric = decision.config ? decision.config->controller_metric : "loss";
    if (auto it = metrics_.find(metric); it != metrics_.end()) {
      o.loss = it->second;
      o.has_loss = true;
    }
    if (auto it = metrics_.find(metric + "_target"); it != metrics_.end()) {
      o.loss_target = it->second;
      o.has_loss_target = true;
    }
    o.compute_s = trainer_compute_s(metrics_);
  }
  if (transport_ != nullptr) {
    // Taken every step (so none is stale when a controller starts listening), sent while one is.
    std::vector<ReceiveSample> samples = transport_->drain_receive_samples();
    if (policies::has(active_, policies::ControllerKind::kStep)) {
      for (const ReceiveSample& r : samples) {
        if (o.link_samples.size() >= kMaxLinkSamples) break;
        o.link_samples.push_back({.peer = r.peer, .bytes = r.bytes, .seconds = r.seconds});
      }
    }
  }
  probe_facts_ = probe_facts(o, decision, hint_wait_s, hint_step_s, corrected);
  ++finished_;
  ready_.push_back(std::move(o));
}

LinkProbe::StepFacts ObservationCollector::probe_facts(const policies::NodeObservation& o,
                                                       const Decision& decision, double hint_wait_s,
                                                       double hint_step_s, bool corrected) const {
  LinkProbe::StepFacts f;
  f.step = o.step;
  f.step_s = o.period_s;  // the steps a probe delays pay for it too (LinkProbe's spacing)
  const Config* c = decision.config.get();
  if (c == nullptr || transport_ == nullptr) return f;
  const bool sparse = o.elements > 0 && o.nnz < o.elements && o.trainer_elements == 0;
  f.wanted = policies::has(active_, policies::ControllerKind::kStep) && c->step_allow_dense && c->compression && sparse;
  f.share = c->step_probe_share;
  f.dense_worth = policies::sparse_step_worth(c->step_dense_worth, c->step_dense_worth_corrected, corrected);
  std::vector<uint64_t> elements;
  for (const auto& t : o.tensors) elements.push_back(t.elements);
  const uint32_t w = transport_->world_size();
  f.payload_bytes = policies::link_probe_payload_bytes(elements, w);
  // What a ring step over the link took, scaled to the probe's bytes (of what the ring sends a
  // successor in a step, dense_bytes): this step's, where it ran the daemons' ring, else the
  // trainers' dense iterations before the first step.
  const bool ring = o.elements > 0 && o.nnz >= o.elements && o.trainer_elements == 0;
  if (o.dense_bytes > 0 && f.payload_bytes > 0) {
    const double scale = std::min(
        1.0, static_cast<double>(f.payload_bytes + wire::kHeaderBytes) / static_cast<double>(o.dense_bytes));
    const double ring_s = ring && o.exchange_s > 0 ? o.exchange_s : hint_wait_s;
    if (ring_s > 0 && std::isfinite(ring_s)) f.ring_probe_s = ring_s * scale;
  }
  // A ring step's whole time (the probe's spacing by the ring's distance): this one's period, or
  // the trainers' dense step before the first step.
  f.ring_step_s = ring && o.period_s > 0 ? o.period_s : hint_step_s;
  f.ring_ran = ring;
  for (const auto& l : o.link_samples) {  // the predecessor's probe, as this node's transport timed it
    if (w > 1 && l.peer == (rank_ + w - 1) % w && policies::link_probe_sized(l.bytes, f.payload_bytes)) {
      f.received_s = std::max(f.received_s, l.seconds);
    }
  }
  return f;
}

void ObservationCollector::on_residual_norm2(uint32_t, uint64_t step, double norm2) {
  if ((active_ & kRank0Controllers) == 0 || !(norm2 >= 0)) return;  // as on_tensor_step's `measure`
  if (current_ && current_->step == step) {
    current_->residual_norm2 += norm2;
    return;
  }
  for (auto it = ready_.rbegin(); it != ready_.rend(); ++it) {  // the step's last tensor finished it
    if (it->step == step) {
      it->residual_norm2 += norm2;
      return;
    }
  }
}

void ObservationCollector::after_complete() {
  if (ready_.empty()) return;
  if (probe_facts_) probe_.after_step(*probe_facts_);
  probe_facts_.reset();
  for (const policies::NodeObservation& o : ready_) {
    if (runner_) {
      runner_->add(o);
    } else {
      send_to_rank0(o);
    }
  }
  ready_.clear();
  if (runner_) runner_->poll();
}

void ObservationCollector::send_to_rank0(const policies::NodeObservation& o) {
  if (transport_ == nullptr || rank_ == 0) return;
  wire::WireHeader h{};
  h.kind = static_cast<uint16_t>(wire::Kind::kObservation);
  h.job_id = job_id_;
  h.sender_rank = rank_;
  h.step = o.step;
  Status s = send_text_message(*transport_, 0, h, format_observation(o), "an observation", /*quiet=*/true);
  if (!s.ok()) SC_LOG_DEBUG("cannot send an observation to rank 0: {}", s.to_string());
}

}  // namespace sparsecar
