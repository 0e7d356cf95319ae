// PipelineJob: W real Pipelines (with their Mailboxes) joined by the in-process FakeNetwork —
// a whole job's data path without UCX, for pipeline tests. run_step() submits one tensor step on
// every node and waits (bounded) for every node's result.
#pragma once

#include <cmath>
#include <functional>
#include <memory>
#include <random>
#include <vector>

#include "daemon/collective/mailbox.h"
#include "daemon/config/knobs.h"
#include "daemon/metrics/metrics.h"
#include "daemon/pipeline/decisions.h"
#include "daemon/pipeline/pipeline.h"
#include "tests/unit/daemon/fake_transport.h"
#include "tests/unit/daemon/step_results.h"

namespace sparsecar::fakes {

struct PipelineNode {
  std::unique_ptr<Metrics> metrics;        // with a board (below) only
  std::unique_ptr<Mailbox> mailbox;
  std::unique_ptr<DecisionBoard> board;    // with a board only: the plans follow its decisions
  std::unique_ptr<Pipeline> pipeline;
  StepResults results;
};

struct PipelineJob {
  // `base` is every node's options; rank and world size are filled in per node.
  // `before_start` (optional) sees each node's pipeline before it starts (test hooks).
  // `clock` (default the steady clock) must outlive the job. `board` (optional): every node gets a
  // DecisionBoard holding these knobs (rank and world size set per node; the agreed knobs are
  // theirs) and its own Metrics, and the plans come from the board's decisions, not base.settings.
  explicit PipelineJob(uint32_t world, PipelineOptions base = {},
                       const std::function<void(Pipeline&)>& before_start = {}, const Clock& clock = steady_clock(),
                       const Config* board = nullptr)
      : net(world) {
    for (uint32_t r = 0; r < world; ++r) {
      auto& n = nodes.emplace_back(std::make_unique<PipelineNode>());
      PipelineOptions o = base;
      o.rank = r;
      o.world_size = world;
      if (o.agreed_knobs.empty()) o.agreed_knobs = "compression=test";
      n->mailbox = std::make_unique<Mailbox>(o.job_id, world, nullptr, Mailbox::kDefaultMaxBytesPerPeer, clock);
      if (board != nullptr) {
        Config c = *board;
        c.rank = r;
        c.world_size = world;
        o.agreed_knobs = agreed_knobs(c);
        n->metrics = Metrics::create("off").value();
        n->board = std::make_unique<DecisionBoard>(c, net.transport(r), clock);
        n->mailbox->set_control_handler([b = n->board.get()](uint32_t peer, const wire::WireHeader& h,
                                                             std::span<const std::byte> p) { b->on_message(peer, h, p); });
      }
      net.attach(r, n->mailbox.get());
      n->pipeline = std::make_unique<Pipeline>(o, net.transport(r), n->mailbox.get(), n->metrics.get(), n->board.get(),
                                               clock);
      n->pipeline->set_result_sink(&n->results);
      if (before_start) before_start(*n->pipeline);
      n->pipeline->start();
    }
  }
  ~PipelineJob() {
    for (auto& n : nodes) n->pipeline->stop();
  }
  std::vector<std::unique_ptr<PipelineNode>> nodes;
  // Members die in reverse order: `net` (declared after `nodes`) stops its delivery thread
  // before any node's mailbox is freed.
  FakeNetwork net;
};

inline std::vector<float> random_vector(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

// One step of one tensor on every node; inputs[r] is node r's local sum, outputs[r] receives
// node r's result (NaN-filled first, so an unwritten element shows). reduces[r]: node r's
// trainers said they all-reduce dense steps themselves (StepJob::trainer_reduces; empty: none).
inline std::vector<StepResult> run_step(PipelineJob& job, uint32_t tensor, uint64_t step,
                                        const std::vector<std::vector<float>>& inputs,
                                        std::vector<std::vector<float>>& outputs,
                                        const std::vector<bool>& reduces = {}, bool takes_lease = false) {
  const uint32_t w = static_cast<uint32_t>(job.nodes.size());
  outputs.assign(w, std::vector<float>(inputs[0].size(), std::nanf("")));
  for (uint32_t r = 0; r < w; ++r) {
    StepJob j;
    j.tensor_id = tensor;
    j.step = step;
    j.local_sum = inputs[r];
    j.result = outputs[r];
    j.trainer_reduces = r < reduces.size() && reduces[r];
    j.takes_lease = j.trainer_reduces && takes_lease;
    job.nodes[r]->pipeline->submit(j);
  }
  std::vector<StepResult> out;
  for (uint32_t r = 0; r < w; ++r) out.push_back(job.nodes[r]->results.wait(tensor, step));
  return out;
}

}  // namespace sparsecar::fakes
