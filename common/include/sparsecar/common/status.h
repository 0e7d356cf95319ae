// Status and Expected<T>: the error values of sparsecar's data path.
//
// Every function on the data path (kernels, codecs, transport, pipeline, client) returns one of
// these instead of throwing. A Status is a code plus a human-readable message that names what
// went wrong (the tensor, the peer, the field). Codes are frozen: the C ABI (sparsecar.h) uses the
// same numbers, so never renumber one. Cheap to move; copying copies the message.
// Thread-safety: value types, no shared state.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace sparsecar {

enum class Code : int32_t {
  kOk = 0,
  kInvalidArgument = 1,     // caller passed something malformed
  kNotFound = 2,            // unknown tensor / knob / command
  kAlreadyExists = 3,       // duplicate registration
  kOutOfRange = 4,          // step out of order, index outside the tensor
  kDeadlineExceeded = 5,    // a wait ran past its deadline (a peer or the daemon did not answer)
  kUnavailable = 6,         // peer or daemon down, connection closed
  kDataLoss = 7,            // corrupted or malformed message (checksum, field check)
  kFailedPrecondition = 8,  // job state does not allow it (e.g. nodes disagree on tensors/knobs)
  kPermissionDenied = 9,    // uid / secret check failed
  kInternal = 10,           // a bug or a failed system call
  kWouldBlock = 11,         // "not now": full ring, empty queue; retry later
  kAborted = 12,            // a step was aborted by another node or by shutdown
  kResourceExhausted = 13,  // a configured limit was hit (slots, memory, message size)
};

std::string_view code_name(Code code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return {}; }
  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  // "DEADLINE_EXCEEDED: peer rank 2 did not send step 7 of tensor 'w' within 5000 ms"
  std::string to_string() const;
  // Prepends context: "while decoding from rank 1: <message>".
  Status with_context(std::string_view context) const;
  void ignore() const {}

 private:
  Code code_ = Code::kOk;
  std::string message_;
};

inline Status invalid_argument(std::string m) { return {Code::kInvalidArgument, std::move(m)}; }
inline Status not_found(std::string m) { return {Code::kNotFound, std::move(m)}; }
inline Status out_of_range(std::string m) { return {Code::kOutOfRange, std::move(m)}; }
inline Status deadline_exceeded(std::string m) { return {Code::kDeadlineExceeded, std::move(m)}; }
inline Status unavailable(std::string m) { return {Code::kUnavailable, std::move(m)}; }
inline Status data_loss(std::string m) { return {Code::kDataLoss, std::move(m)}; }
inline Status failed_precondition(std::string m) { return {Code::kFailedPrecondition, std::move(m)}; }
inline Status permission_denied(std::string m) { return {Code::kPermissionDenied, std::move(m)}; }
inline Status internal_error(std::string m) { return {Code::kInternal, std::move(m)}; }
inline Status would_block(std::string m = "would block") { return {Code::kWouldBlock, std::move(m)}; }
inline Status aborted(std::string m) { return {Code::kAborted, std::move(m)}; }
inline Status resource_exhausted(std::string m) { return {Code::kResourceExhausted, std::move(m)}; }

// errno-based failure of a system call: "<what>: <strerror(err)>" with code kInternal
// (or kUnavailable for connection errors such as ECONNREFUSED/EPIPE/ECONNRESET/ENOENT).
Status errno_status(std::string_view what, int err);

// A value or the Status explaining why there is none.
template <typename T>
class [[nodiscard]] Expected {
 public:
  Expected(T value) : v_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
  Expected(Status status) : v_(std::move(status)) {}  // NOLINT(google-explicit-constructor)

  bool ok() const { return std::holds_alternative<T>(v_); }
  explicit operator bool() const { return ok(); }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  // The error; Status::Ok() when a value is held.
  Status status() const { return ok() ? Status::Ok() : std::get<Status>(v_); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace sparsecar

// Returns early from the enclosing function when `expr` yields a non-OK Status.
#define SC_RETURN_IF_ERROR(expr)                      \
  do {                                                \
    ::sparsecar::Status sc_status_ = (expr);          \
    if (!sc_status_.ok()) return sc_status_;          \
  } while (0)

#define SC_CONCAT_INNER_(a, b) a##b
#define SC_CONCAT_(a, b) SC_CONCAT_INNER_(a, b)
// SC_ASSIGN_OR_RETURN(auto x, make_x()); — assigns the value or returns the Status.
#define SC_ASSIGN_OR_RETURN(lhs, expr) \
  SC_ASSIGN_OR_RETURN_IMPL_(SC_CONCAT_(sc_expected_, __LINE__), lhs, expr)
#define SC_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  if (!tmp.ok()) return tmp.status();             \
  lhs = std::move(tmp).value()
