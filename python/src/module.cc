// sparsecar._sparsecar: the pybind11 binding behind the Python package `sparsecar`.
//
// Two parts:
//  - Client / Tensor over the C++ client library (client/): connect, register, register_device
//    (a GPU tensor by CUDA IPC handles), submit, wait, report_metric. A Tensor's shared-memory slot is exposed as a NumPy array *without a copy*
//    (Tensor.array(); torch.from_numpy() on it is zero-copy too). Blocking calls release the GIL.
//  - `kernels`: the CPU sparsifiers and codecs (kernels/) over NumPy arrays, for experiments and
//    tests that simulate workers in one process (bench/convergence/).
//
// Thread-safety: the C++ Client is single-threaded; this binding serialises every call on one
// Client with a mutex, and wait() waits in short slices (releasing the mutex and the GIL between
// them) so that another Python thread can submit or report while a thread waits. Memory: the
// slot mappings live as long as any Tensor or array view of them (shared ownership), so close()
// can never leave a dangling array behind.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "sparsecar/client.h"
#include "sparsecar/common/log.h"
#include "sparsecar/kernels/codec.h"
#include "sparsecar/kernels/select.h"
#include "sparsecar/kernels/selectors.h"
#include "sparsecar/kernels/types.h"

namespace py = pybind11;
using namespace std::chrono_literals;

namespace {

// sparsecar.Error and its subclasses; created in PYBIND11_MODULE.
py::object g_error, g_deadline, g_unavailable;

[[noreturn]] void raise_status(const sparsecar::Status& st) {
  py::object cls = g_error;
  if (st.code() == sparsecar::Code::kDeadlineExceeded) cls = g_deadline;
  if (st.code() == sparsecar::Code::kUnavailable) cls = g_unavailable;
  py::object exc = cls(st.to_string());
  exc.attr("code") = py::int_(static_cast<int>(st.code()));
  exc.attr("code_name") = py::str(std::string(sparsecar::code_name(st.code())));
  exc.attr("detail") = py::str(st.message());
  PyErr_SetObject(cls.ptr(), exc.ptr());
  throw py::error_already_set();
}

void check(const sparsecar::Status& st) {
  if (!st.ok()) raise_status(st);
}

// Owns the C++ client; shared by the Python Client and every Tensor / array view it made.
struct Session {
  std::mutex mu;
  std::unique_ptr<sparsecar::Client> client;
  std::string socket;
  bool closed = false;
};

struct PyTensor {
  std::shared_ptr<Session> session;
  sparsecar::Tensor* tensor = nullptr;
  std::vector<ssize_t> shape;
};

struct PyStepInfo {
  uint64_t step = 0, bytes_sent = 0, dense_bytes = 0, nnz = 0;
  bool trainer_reduces = false;
  uint32_t lease_steps = 0;
};

class PyClient {
 public:
  static std::unique_ptr<PyClient> connect(const std::string& socket, double timeout_s) {
    sparsecar::ConnectOptions opt;
    opt.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000.0));
    sparsecar::Expected<std::unique_ptr<sparsecar::Client>> c = sparsecar::Status::Ok();
    {
      py::gil_scoped_release nogil;
      c = sparsecar::Client::connect(socket, opt);
    }
    if (!c.ok()) raise_status(c.status());
    auto self = std::make_unique<PyClient>();
    self->s_ = std::make_shared<Session>();
    self->s_->client = std::move(*c);
    self->s_->socket = socket;
    return self;
  }

  PyTensor register_tensor(const std::string& name, py::object size) {
    // An int registers a flat tensor; a tuple registers its shape too (the daemon's structured
    // selectors and per-tensor overrides see it). A 0-d tuple is one element, without a shape.
    std::vector<ssize_t> shape;
    const bool shaped = !py::isinstance<py::int_>(size);
    if (!shaped) {
      shape.push_back(size.cast<ssize_t>());
    } else {
      for (auto d : size) shape.push_back(d.cast<ssize_t>());
    }
    if (shape.size() > sparsecar::Client::kMaxDims) {
      throw py::value_error(sparsecar::strfmt("tensor '%s': a shape has at most %zu dims, got %zu (register "
                                              "the element count instead)",
                                              name.c_str(), sparsecar::Client::kMaxDims, shape.size()));
    }
    size_t count = 1;
    std::vector<uint64_t> dims;
    for (ssize_t d : shape) {
      if (d < 0) throw py::value_error("tensor dimensions must be >= 0");
      count *= static_cast<size_t>(d);
      dims.push_back(static_cast<uint64_t>(d));
    }
    if (!shaped) dims.clear();
    Session& s = live();
    sparsecar::Expected<sparsecar::Tensor*> t = sparsecar::Status::Ok();
    {
      py::gil_scoped_release nogil;
      std::lock_guard lock(s.mu);
      t = s.client->register_tensor(name, count, sparsecar::DType::kF32, dims);  // empty dims: unshaped
    }
    if (!t.ok()) raise_status(t.status());
    return PyTensor{s_, *t, shape};
  }

  // A tensor in GPU memory, by its CUDA IPC handles (sparsecar.device_handles() makes them from a
  // torch CUDA tensor and two interprocess events). The byte strings are checked here so that a
  // wrong one says which and how long it should be.
  PyTensor register_device(const std::string& name, size_t count, const py::bytes& device_uuid,
                           const py::bytes& mem_handle, uint64_t offset, const py::bytes& ready_event,
                           const py::bytes& done_event, const py::object& shape) {
    sparsecar::DeviceHandles h;
    auto take = [&](const py::bytes& b, const char* what, auto& field) {
      const std::string_view v = b;
      if (v.size() != field.size()) {
        throw py::value_error(sparsecar::strfmt("register_device('%s'): %s must be %zu bytes, got %zu", name.c_str(),
                                                what, field.size(), v.size()));
      }
      std::memcpy(field.data(), v.data(), field.size());
    };
    take(device_uuid, "device_uuid (cudaUUID_t)", h.device_uuid);
    take(mem_handle, "mem_handle (cudaIpcMemHandle_t)", h.mem_handle);
    take(ready_event, "ready_event (cudaIpcEventHandle_t)", h.ready_event);
    take(done_event, "done_event (cudaIpcEventHandle_t)", h.done_event);
    h.offset = offset;
    std::vector<uint64_t> dims;
    std::vector<ssize_t> view_shape{static_cast<ssize_t>(count)};
    if (!shape.is_none()) {
      view_shape.clear();
      for (auto d : shape) {
        const ssize_t v = d.cast<ssize_t>();
        if (v < 0) throw py::value_error("tensor dimensions must be >= 0");
        dims.push_back(static_cast<uint64_t>(v));
        view_shape.push_back(v);
      }
      if (dims.size() > sparsecar::Client::kMaxDims) {
        throw py::value_error(sparsecar::strfmt("tensor '%s': a shape has at most %zu dims, got %zu", name.c_str(),
                                                sparsecar::Client::kMaxDims, dims.size()));
      }
    }
    Session& s = live();
    sparsecar::Expected<sparsecar::Tensor*> t = sparsecar::Status::Ok();
    {
      py::gil_scoped_release nogil;
      std::lock_guard lock(s.mu);
      t = s.client->register_device_tensor(name, count, h, dims);
    }
    if (!t.ok()) raise_status(t.status());
    return PyTensor{s_, *t, view_shape};
  }

  void submit(const PyTensor& t, uint64_t step, float lr, bool trainer_reduces, bool takes_lease) {
    Session& s = live_for(t);
    sparsecar::Status st;
    {
      std::lock_guard lock(s.mu);  // never blocks for long: wait() holds it only to look
      sparsecar::SubmitOptions o;
      o.lr = lr;
      o.trainer_reduces = trainer_reduces;
      o.takes_lease = takes_lease;
      st = s.client->submit(*t.tensor, step, o);
    }
    check(st);
  }

  PyStepInfo wait(const PyTensor& t, uint64_t step, double timeout_s) {
    Session& s = live_for(t);
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::microseconds(static_cast<int64_t>(timeout_s * 1e6));
    sparsecar::Expected<sparsecar::StepInfo> r = sparsecar::Status::Ok();
    bool timed_out_here = true;  // until a wait returns anything but its own timeout
    {
      py::gil_scoped_release nogil;
      // The lock is held only to look (wait() with no time to block, or 1 ms where the daemon's
      // socket has something to say); the blocking happens outside it, in await_activity(). A
      // wait() that blocked under the lock held each submit() from another thread back while a
      // step was in flight (a DDP bucket after the first): 3.5 ms median on loopback
      // (bench/client/submit_while_waiting.py; the tensor outlives this call: `t` holds its
      // Session, whose Client close() does not destroy).
      bool socket_readable = false;
      for (;;) {
        bool still_waiting = false;
        {
          std::lock_guard lock(s.mu);
          r = s.client->wait(*t.tensor, step, socket_readable ? 1ms : 0ms);
          // A DEADLINE_EXCEEDED of the daemon's (a peer did not deliver) ends the step: only
          // this look's own timeout leaves it in flight. Waiting again would ask for a step
          // that is over ("not submitted") and hide the daemon's error.
          still_waiting = !r.ok() && r.status().code() == sparsecar::Code::kDeadlineExceeded &&
                          s.client->in_flight(*t.tensor, step);
        }
        if (!still_waiting) {
          timed_out_here = false;
          break;
        }
        auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
        if (left <= 0ms) break;
        socket_readable = s.client->await_activity(std::min(left, 2ms));
      }
    }
    if (!r.ok()) {
      if (timed_out_here) {
        raise_status(sparsecar::deadline_exceeded(sparsecar::strfmt(
            "tensor '%s': step %llu not completed within %.3f s", t.tensor->name().c_str(),
            static_cast<unsigned long long>(step), timeout_s)));
      }
      raise_status(r.status());
    }
    return PyStepInfo{r->step, r->bytes_sent, r->dense_bytes, r->nnz, r->trainer_reduces, r->lease_steps};
  }

  void report_metric(const std::string& name, double value, uint64_t step) {
    Session& s = live();
    sparsecar::Status st;
    {
      py::gil_scoped_release nogil;
      std::lock_guard lock(s.mu);
      st = s.client->report_metric(name, value, step);
    }
    check(st);
  }

  void close() {
    if (s_) s_->closed = true;
    s_.reset();  // the session ends when the last Tensor / array view of it is gone
  }
  bool closed() const { return !s_ || s_->closed; }
  std::string socket() const { return s_ ? s_->socket : std::string(); }

 private:
  Session& live() {
    if (!s_ || s_->closed) throw py::value_error("sparsecar.Client is closed");
    return *s_;
  }
  Session& live_for(const PyTensor& t) {
    Session& s = live();
    if (t.session.get() != &s) throw py::value_error("tensor was registered by another Client");
    return s;
  }
  std::shared_ptr<Session> s_;
};

// A NumPy view of a tensor's slot; its base object keeps the mapping alive.
py::array tensor_array(py::object self) {
  const PyTensor& t = self.cast<const PyTensor&>();
  if (t.tensor->on_device()) {
    throw py::value_error("tensor '" + t.tensor->name() +
                          "' lives on the GPU (registered with register_device): it has no host array");
  }
  std::vector<ssize_t> strides(t.shape.size());
  ssize_t stride = sizeof(float);
  for (size_t i = t.shape.size(); i-- > 0;) {
    strides[i] = stride;
    stride *= t.shape[i];
  }
  return py::array(py::dtype::of<float>(), t.shape, strides, t.tensor->data(), self);
}

// ---- kernels ------------------------------------------------------------------------------------
using F32 = py::array_t<float, py::array::c_style>;  // no forcecast: wrong dtypes are rejected
using U32 = py::array_t<uint32_t, py::array::c_style>;

std::span<float> writable(F32& a, const char* what) {
  if (!a.writeable()) throw py::value_error(std::string(what) + " must be writable");
  return {a.mutable_data(), static_cast<size_t>(a.size())};
}
std::span<const float> readonly(const F32& a) { return {a.data(), static_cast<size_t>(a.size())}; }

py::tuple pairs(std::vector<uint32_t>& idx, std::vector<float>& val, size_t n) {
  U32 i(static_cast<ssize_t>(n));
  F32 v(static_cast<ssize_t>(n));
  std::copy_n(idx.data(), n, i.mutable_data());
  std::copy_n(val.data(), n, v.mutable_data());
  return py::make_tuple(i, v);
}

void same_size(const F32& a, const F32& b) {
  if (a.size() != b.size()) throw py::value_error("residual and grad must have the same size");
}

}  // namespace

PYBIND11_MODULE(_sparsecar, m) {
  m.doc() = "sparsecar native binding (client library + CPU kernels)";
  py::object builtins = py::module_::import("builtins");
  g_error = py::reinterpret_steal<py::object>(
      PyErr_NewExceptionWithDoc("sparsecar.Error", "A sparsecar call failed; .code_name says why.",
                                builtins.attr("RuntimeError").ptr(), nullptr));
  g_deadline = py::reinterpret_steal<py::object>(PyErr_NewExceptionWithDoc(
      "sparsecar.DeadlineExceeded", "A wait ran past its deadline.",
      py::make_tuple(g_error, builtins.attr("TimeoutError")).ptr(), nullptr));
  g_unavailable = py::reinterpret_steal<py::object>(PyErr_NewExceptionWithDoc(
      "sparsecar.Unavailable", "The daemon or a peer is down or unreachable.",
      py::make_tuple(g_error, builtins.attr("ConnectionError")).ptr(), nullptr));
  m.attr("Error") = g_error;
  m.attr("DeadlineExceeded") = g_deadline;
  m.attr("Unavailable") = g_unavailable;
  m.attr("MAX_DIMS") = sparsecar::Client::kMaxDims;

  m.def("set_log_level", [](const std::string& level) {
    sparsecar::LogLevel l;
    if (!sparsecar::parse_log_level(level, &l)) throw py::value_error("log level: error|warn|info|debug|trace");
    sparsecar::set_log_level(l);
  }, "Verbosity of the native library's stderr log (default info).");

  py::class_<PyStepInfo>(m, "StepInfo", "What the daemon reported for a completed step.")
      .def_readonly("step", &PyStepInfo::step)
      .def_readonly("bytes_sent", &PyStepInfo::bytes_sent, "bytes the local daemon put on the wire")
      .def_readonly("dense_bytes", &PyStepInfo::dense_bytes, "what a dense ring all-reduce would have sent")
      .def_readonly("nnz", &PyStepInfo::nnz, "elements the local daemon selected")
      .def_readonly("trainer_reduces", &PyStepInfo::trainer_reduces,
                    "the tensor holds this trainer's share, not the average: all-reduce (sum) it over every "
                    "trainer and divide by their number (only after submit(..., trainer_reduces=True))")
      .def_readonly("lease_steps", &PyStepInfo::lease_steps,
                    "with trainer_reduces: the next this many steps of the tensor are trainer-reduced dense "
                    "steps too, which the trainer may all-reduce without submitting them (every trainer of the "
                    "job skipping the same ones: the least over all trainers and tensors); only after "
                    "submit(..., trainer_reduces=True, takes_lease=True), else 0")
      .def("__repr__", [](const PyStepInfo& i) {
        const std::string lease = i.lease_steps ? sparsecar::strfmt(", lease_steps=%u", i.lease_steps) : "";
        return sparsecar::strfmt("StepInfo(step=%llu, bytes_sent=%llu, dense_bytes=%llu, nnz=%llu%s%s)",
                                 static_cast<unsigned long long>(i.step), static_cast<unsigned long long>(i.bytes_sent),
                                 static_cast<unsigned long long>(i.dense_bytes), static_cast<unsigned long long>(i.nnz),
                                 i.trainer_reduces ? ", trainer_reduces=True" : "", lease.c_str());
      });

  py::class_<PyTensor>(m, "Tensor", "A registered tensor: a float32 shared-memory slot.")
      .def_property_readonly("name", [](const PyTensor& t) { return t.tensor->name(); })
      .def_property_readonly("id", [](const PyTensor& t) { return t.tensor->id(); })
      .def_property_readonly("size", [](const PyTensor& t) { return t.tensor->size(); })
      .def_property_readonly("shape", [](const PyTensor& t) { return py::tuple(py::cast(t.shape)); })
      .def_property_readonly("registered_shape", [](const PyTensor& t) { return py::tuple(py::cast(t.tensor->shape())); },
                             "The shape the daemon knows (empty when registered by element count).")
      .def_property_readonly("on_device", [](const PyTensor& t) { return t.tensor->on_device(); },
                             "True for a GPU tensor (Client.register_device): no host slot, array() raises.")
      .def("array", &tensor_array, "The slot as a NumPy float32 array (a view, no copy); ValueError for a GPU tensor.");

  py::class_<PyClient>(m, "_Client")
      .def_static("connect", &PyClient::connect, py::arg("socket"), py::arg("timeout") = 10.0)
      .def("register", &PyClient::register_tensor, py::arg("name"), py::arg("size"))
      .def("register_device", &PyClient::register_device, py::arg("name"), py::arg("count"), py::kw_only(),
           py::arg("device_uuid"), py::arg("mem_handle"), py::arg("offset"), py::arg("ready_event"),
           py::arg("done_event"), py::arg("shape") = py::none())
      .def("submit", &PyClient::submit, py::arg("tensor"), py::arg("step"), py::arg("lr") = 0.0f,
           py::arg("trainer_reduces") = false, py::arg("takes_lease") = false)
      .def("wait", &PyClient::wait, py::arg("tensor"), py::arg("step"), py::arg("timeout") = 30.0)
      .def("report_metric", &PyClient::report_metric, py::arg("name"), py::arg("value"), py::arg("step"))
      .def("close", &PyClient::close)
      .def_property_readonly("closed", &PyClient::closed)
      .def_property_readonly("socket", &PyClient::socket);

  py::module_ k = m.def_submodule("kernels", "sparsecar's CPU kernels over NumPy float32 arrays.");
  k.def("topk_count", &sparsecar::kernels::topk_count, py::arg("n"), py::arg("density"));
  k.def("topk_exact", [](const F32& x, size_t k) {
    const size_t n = static_cast<size_t>(x.size());
    const size_t kk = std::min(k, n);
    std::vector<std::byte> scratch(sparsecar::kernels::topk_scratch_bytes(n));
    std::vector<uint32_t> idx(kk);
    std::vector<float> val(kk);
    auto r = sparsecar::kernels::topk_exact(readonly(x), kk, scratch, idx.data(), val.data());
    if (!r.ok()) raise_status(r.status());
    return pairs(idx, val, *r);
  }, py::arg("x"), py::arg("k"), "Exact top-k by magnitude: (index uint32, value float32), index ascending.");
  // The selector registry (kernels/selectors.h): every row, and any row's CPU function by name.
  k.def("selectors", [] {
    py::list rows;
    for (const sparsecar::kernels::SelectorInfo& row : sparsecar::kernels::selector_registry()) {
      py::list params;
      for (const sparsecar::kernels::ParamInfo& p : sparsecar::kernels::kSelectorParams) {
        if (row.params & sparsecar::kernels::param_bit(p.param)) params.append(p.name);
      }
      py::dict d;
      d["id"] = static_cast<int>(row.id);
      d["name"] = row.name;
      d["doc"] = row.doc;
      d["params"] = params;
      d["unbiased"] = row.unbiased;
      d["needs_shape"] = row.needs_shape;
      d["stateful"] = row.stateful;
      rows.append(d);
    }
    return rows;
  }, "The selector registry: one dict per selector (id, name, doc, params, unbiased, needs_shape, "
     "stateful), in id order (the CUDA column lives in the CUDA library: docs/gpu.md).");
  k.def("select", [](const std::string& name, const F32& x, double density, float threshold, uint32_t block_size,
                     uint64_t seed, bool unbiased, const std::vector<uint64_t>& shape) {
    const sparsecar::kernels::SelectorInfo* row = sparsecar::kernels::find_selector(std::string_view(name));
    if (row == nullptr || row->cpu == nullptr) throw py::value_error("not a selector: " + name);
    if (row->stateful) throw py::value_error(name + " keeps per-tensor state; the daemon runs it");
    const size_t n = static_cast<size_t>(x.size());
    sparsecar::kernels::SelectorParams params;
    params.density = density;
    params.threshold = threshold;
    params.block_size = block_size;
    params.seed = seed;
    std::vector<std::byte> scratch(sparsecar::kernels::selector_scratch_bytes(n, shape));
    std::vector<uint32_t> idx(n);
    std::vector<float> val(n);
    sparsecar::kernels::SelectInput in;
    in.x = readonly(x);
    in.grad = in.x;
    in.shape = shape;
    in.params = &params;
    in.unbiased = unbiased && row->unbiased;
    in.scratch = scratch;
    auto c = row->cpu(in, sparsecar::kernels::SelectOutput{idx.data(), val.data(), n});
    if (!c.ok()) raise_status(c.status());
    return pairs(idx, val, *c);
  }, py::arg("name"), py::arg("x"), py::arg("density") = 0.01, py::arg("threshold") = 1e-3f,
     py::arg("block_size") = 64, py::arg("seed") = 0, py::arg("unbiased") = false,
     py::arg("shape") = std::vector<uint64_t>{},
     "Runs a selector of the registry by name on x: (index uint32, value float32), index ascending. "
     "seed is the (tensor, step) stream; unbiased writes x/p for the unbiased selectors.");
  k.def("threshold_select", [](const F32& x, float lambda) {
    const size_t n = static_cast<size_t>(x.size());
    std::vector<uint32_t> idx(n);
    std::vector<float> val(n);
    size_t c = sparsecar::kernels::threshold_select(readonly(x), lambda, idx.data(), val.data(), n);
    return pairs(idx, val, c);
  }, py::arg("x"), py::arg("lam"), "All i with |x_i| >= lam: (index, value).");
  k.def("ef_accumulate", [](F32 residual, const F32& grad) {
    same_size(residual, grad);
    sparsecar::kernels::ef_accumulate(writable(residual, "residual"), readonly(grad));
  }, py::arg("residual").noconvert(), py::arg("grad"), "residual += grad (in place).");
  k.def("clear_selected", [](F32 residual, const U32& index) {
    for (ssize_t i = 0; i < index.size(); ++i) {
      if (index.data()[i] >= static_cast<uint64_t>(residual.size())) throw py::index_error("index out of range");
    }
    sparsecar::kernels::clear_selected(writable(residual, "residual"),
                                       {index.data(), static_cast<size_t>(index.size())});
  }, py::arg("residual").noconvert(), py::arg("index"), "residual[index] = 0 (in place).");
  k.def("ef_topk", [](F32 residual, const F32& grad, size_t k) {
    same_size(residual, grad);
    auto r = writable(residual, "residual");
    sparsecar::kernels::ef_accumulate(r, readonly(grad));
    const size_t kk = std::min(k, r.size());
    std::vector<std::byte> scratch(sparsecar::kernels::topk_scratch_bytes(r.size()));
    std::vector<uint32_t> idx(kk);
    std::vector<float> val(kk);
    auto c = sparsecar::kernels::topk_exact(r, kk, scratch, idx.data(), val.data());
    if (!c.ok()) raise_status(c.status());
    sparsecar::kernels::clear_selected(r, {idx.data(), *c});
    return pairs(idx, val, *c);
  }, py::arg("residual").noconvert(), py::arg("grad"), py::arg("k"),
     "Error feedback + exact top-k, as the daemon's pipeline does it: residual += grad; select the k "
     "largest |residual|; zero them in the residual; return (index, value).");
  k.def("ef_threshold", [](F32 residual, const F32& grad, float lambda) {
    same_size(residual, grad);
    auto r = writable(residual, "residual");
    std::vector<uint32_t> idx(r.size());
    std::vector<float> val(r.size());
    size_t c = sparsecar::kernels::ef_threshold(r, readonly(grad), lambda, idx.data(), val.data(), r.size());
    return pairs(idx, val, c);
  }, py::arg("residual").noconvert(), py::arg("grad"), py::arg("lam"),
     "Fused error feedback + hard threshold: residual += grad; select |residual_i| >= lam; zero them.");
  k.def("coo_bytes", [](size_t dense_len, size_t nnz) {
    return sparsecar::kernels::encoded_bytes(sparsecar::kernels::Format::kCoo, sparsecar::kernels::ValueType::kF32,
                                             dense_len, nnz);
  }, py::arg("dense_len"), py::arg("nnz"), "Payload bytes of a COO selection (uint32 index + fp32 value).");
  k.def("coo_encode", [](const U32& index, const F32& value) {
    size_t bytes = sparsecar::kernels::encoded_bytes(sparsecar::kernels::Format::kCoo,
                                                     sparsecar::kernels::ValueType::kF32,
                                                     static_cast<size_t>(UINT32_MAX), static_cast<size_t>(index.size()));
    std::string out(bytes, '\0');
    check(sparsecar::kernels::coo_encode({index.data(), static_cast<size_t>(index.size())},
                                         {value.data(), static_cast<size_t>(value.size())},
                                         {reinterpret_cast<std::byte*>(out.data()), out.size()}));
    return py::bytes(out);
  }, py::arg("index"), py::arg("value"));
  k.def("coo_decode_accumulate", [](py::bytes payload, uint64_t nnz, F32 dense_out) {
    std::string_view p = payload;
    check(sparsecar::kernels::decode_accumulate(
        sparsecar::kernels::Format::kCoo, sparsecar::kernels::ValueType::kF32,
        {reinterpret_cast<const std::byte*>(p.data()), p.size()}, nnz, writable(dense_out, "dense_out")));
  }, py::arg("payload"), py::arg("nnz"), py::arg("dense_out").noconvert(),
     "Validates a COO payload and adds it into dense_out (the receiver's decode).");
}
