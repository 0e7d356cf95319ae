// The control protocol's envelope: every malformed, oversized or mistyped request is a
// ProtocolError with the right kind, and replies have the documented shape.
#include <gtest/gtest.h>

#include "daemon/control/protocol.h"

namespace sparsecar::control {
namespace {

using json = nlohmann::json;

TEST(ControlProtocol, ParsesAWellFormedRequest) {
  auto r = parse_request(R"({"v":1,"id":"a1","cmd":"get","args":{"knob":"density"}})");
  ASSERT_TRUE(r.ok) << r.error.message;
  EXPECT_EQ(r.request.id, json("a1"));
  EXPECT_EQ(r.request.cmd, "get");
  EXPECT_EQ(r.request.args["knob"], "density");
}

TEST(ControlProtocol, ArgsAndIdAreOptional) {
  auto r = parse_request(R"({"v":1,"cmd":"status"})");
  ASSERT_TRUE(r.ok);
  EXPECT_TRUE(r.request.id.is_null());
  EXPECT_TRUE(r.request.args.is_object());
  EXPECT_TRUE(parse_request(R"({"v":1,"id":7,"cmd":"status","args":null})").ok);
}

struct BadCase {
  const char* text;
  Rejection kind;
};

TEST(ControlProtocol, RejectsBadEnvelopes) {
  const BadCase cases[] = {
      {"", Rejection::kMalformed},
      {"not json", Rejection::kMalformed},
      {"[1,2]", Rejection::kMalformed},
      {R"({"v":1,"cmd":"status")", Rejection::kMalformed},
      {R"({"cmd":"status"})", Rejection::kMalformed},
      {R"({"v":"1","cmd":"status"})", Rejection::kMalformed},
      {R"({"v":1.5,"cmd":"status"})", Rejection::kMalformed},
      {R"({"v":2,"cmd":"status"})", Rejection::kUnsupportedVersion},
      {R"({"v":1})", Rejection::kMalformed},
      {R"({"v":1,"cmd":3})", Rejection::kMalformed},
      {R"({"v":1,"cmd":""})", Rejection::kMalformed},
      {R"({"v":1,"cmd":"status","id":[1]})", Rejection::kMalformed},
      {R"({"v":1,"cmd":"status","id":{}})", Rejection::kMalformed},
      {R"({"v":1,"cmd":"status","args":[]})", Rejection::kWrongType},
      {R"({"v":1,"cmd":"status","args":"x"})", Rejection::kWrongType},
      {R"({"v":1,"cmd":"status","extra":1})", Rejection::kMalformed},
      {R"({"v":1,"cmd":"status","token":5})", Rejection::kMalformed},
      {"{\"v\":1,\"cmd\":\"st\xff\xfe\"}", Rejection::kMalformed},  // invalid UTF-8
  };
  for (const auto& c : cases) {
    auto r = parse_request(c.text);
    EXPECT_FALSE(r.ok) << c.text;
    EXPECT_EQ(rejection_label(r.error.kind), rejection_label(c.kind)) << c.text << ": " << r.error.message;
  }
}

TEST(ControlProtocol, EchoesTheIdOfARequestItCouldRead) {
  auto r = parse_request(R"({"v":9,"id":"x","cmd":"status"})");
  ASSERT_FALSE(r.ok);
  EXPECT_EQ(r.error.id, json("x"));
  json reply = json::parse(error_reply(r.error));
  EXPECT_EQ(reply["id"], "x");
  EXPECT_EQ(reply["ok"], false);
  EXPECT_EQ(reply["error"]["code"], "UNSUPPORTED_VERSION");
  EXPECT_EQ(reply["v"], 1);
}

TEST(ControlProtocol, OversizedRequestsAreTooLarge) {
  std::string big = R"({"v":1,"cmd":"status","args":{"pad":")" + std::string(2000, 'x') + "\"}}";
  auto r = parse_request(big, 1024);
  ASSERT_FALSE(r.ok);
  EXPECT_EQ(r.error.kind, Rejection::kTooLarge);
  EXPECT_TRUE(parse_request(big, 4096).ok);
}

TEST(ControlProtocol, DeepNestingIsRejectedBeforeParsing) {
  std::string deep = R"({"v":1,"cmd":"status","args":{"a":)" + std::string(5000, '[') + std::string(5000, ']') + "}}";
  auto r = parse_request(deep, 1 << 20);
  ASSERT_FALSE(r.ok);
  EXPECT_EQ(r.error.kind, Rejection::kMalformed);
  EXPECT_NE(r.error.message.find("nests deeper"), std::string::npos);
  // Brackets inside strings do not count.
  EXPECT_TRUE(parse_request(R"({"v":1,"cmd":"status","args":{"a":"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}})").ok);
}

TEST(ControlProtocol, RepliesSurviveInvalidUtf8) {
  std::string reply = error_reply(json("id"), "MALFORMED", std::string("bad \xff byte"));
  json parsed = json::parse(reply);
  EXPECT_EQ(parsed["error"]["code"], "MALFORMED");
  json ok = json::parse(ok_reply(json(3), json{{"a", 1}}));
  EXPECT_EQ(ok["ok"], true);
  EXPECT_EQ(ok["result"]["a"], 1);
  EXPECT_EQ(ok["id"], 3);
}

TEST(ControlProtocol, MakeRequestRoundTrips) {
  auto r = parse_request(make_request(json(12), "set", json{{"knob", "density"}, {"value", 0.1}}, "secret-token-123"));
  ASSERT_TRUE(r.ok);
  EXPECT_EQ(r.request.cmd, "set");
  EXPECT_EQ(r.request.token, "secret-token-123");
  EXPECT_DOUBLE_EQ(r.request.args["value"].get<double>(), 0.1);
}

}  // namespace
}  // namespace sparsecar::control
