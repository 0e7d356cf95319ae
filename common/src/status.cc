#include "sparsecar/common/status.h"

#include <cerrno>
#include <cstring>

namespace sparsecar {

std::string_view code_name(Code code) {
  switch (code) {
    case Code::kOk: return "OK";
    case Code::kInvalidArgument: return "INVALID_ARGUMENT";
    case Code::kNotFound: return "NOT_FOUND";
    case Code::kAlreadyExists: return "ALREADY_EXISTS";
    case Code::kOutOfRange: return "OUT_OF_RANGE";
    case Code::kDeadlineExceeded: return "DEADLINE_EXCEEDED";
    case Code::kUnavailable: return "UNAVAILABLE";
    case Code::kDataLoss: return "DATA_LOSS";
    case Code::kFailedPrecondition: return "FAILED_PRECONDITION";
    case Code::kPermissionDenied: return "PERMISSION_DENIED";
    case Code::kInternal: return "INTERNAL";
    case Code::kWouldBlock: return "WOULD_BLOCK";
    case Code::kAborted: return "ABORTED";
    case Code::kResourceExhausted: return "RESOURCE_EXHAUSTED";
  }
  return "UNKNOWN";
}

std::string Status::to_string() const {
  if (ok()) return "OK";
  std::string out(code_name(code_));
  out += ": ";
  out += message_;
  return out;
}

Status Status::with_context(std::string_view context) const {
  if (ok()) return *this;
  std::string m(context);
  m += ": ";
  m += message_;
  return {code_, std::move(m)};
}

Status errno_status(std::string_view what, int err) {
  std::string m(what);
  m += ": ";
  m += std::strerror(err);
  switch (err) {
    case ECONNREFUSED:
    case ECONNRESET:
    case EPIPE:
    case ENOENT:
    case ENOTCONN:
      return {Code::kUnavailable, std::move(m)};
    case ETIMEDOUT:
      return {Code::kDeadlineExceeded, std::move(m)};
    case EACCES:
    case EPERM:
      return {Code::kPermissionDenied, std::move(m)};
    default:
      return {Code::kInternal, std::move(m)};
  }
}

}  // namespace sparsecar
