// Observation text from peers (rank 0's controllers read it): what a node formats parses back to
// the same values, and values no honest peer sends — negative counts, counts beyond 2^53, ranks
// beyond 2^32, impossible tensor lines — are refused instead of cast (a negative double cast to
// an unsigned integer is undefined behaviour).
#include "daemon/pipeline/observations.h"

#include <gtest/gtest.h>

namespace sparsecar {
namespace {

TEST(ObservationText, RoundTrip) {
  policies::NodeObservation o;
  o.rank = 3;
  o.step = 123456789;
  o.elements = 1u << 20;
  o.nnz = 1048;
  o.bytes_sent = 9000;
  o.dense_bytes = 8u << 20;
  o.exchange_s = 0.25;
  o.link_bytes = 77;
  o.link_s = 0.5;
  o.loss = -1.5;  // a loss may be negative (e.g. a log-likelihood)
  o.has_loss = true;
  o.tensors.push_back({7, 1000, 10, 0.5});
  o.tensors.push_back({8, 10, 10, -1.0});  // -1: repeat fraction unknown
  auto back = parse_observation(format_observation(o));
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(back->rank, 3u);
  EXPECT_EQ(back->step, 123456789u);
  EXPECT_EQ(back->elements, 1u << 20);
  EXPECT_EQ(back->nnz, 1048u);
  EXPECT_EQ(back->bytes_sent, 9000u);
  EXPECT_EQ(back->dense_bytes, 8u << 20);
  EXPECT_EQ(back->link_bytes, 77u);
  EXPECT_DOUBLE_EQ(back->exchange_s, 0.25);
  EXPECT_DOUBLE_EQ(back->loss, -1.5);
  ASSERT_EQ(back->tensors.size(), 2u);
  EXPECT_EQ(back->tensors[0].tensor_id, 7u);
  EXPECT_EQ(back->tensors[0].nnz, 10u);
  EXPECT_DOUBLE_EQ(back->tensors[1].repeat_fraction, -1.0);
}

TEST(ObservationText, OutOfRangeValuesAreRefusedNotCast) {
  for (const char* text : {"step -1\n", "nnz -0.5\n", "rank 4294967296\n", "rank 1e300\n", "bytes_sent 1e30\n",
                           "step 9007199254740994\n" /* 2^53 + 2 */, "exchange_s -2\n", "link_s nan\n",
                           "tensor -1 5 1 0.5\n", "tensor 1 5 9 0.5\n", "tensor 1 -5 0 0.5\n", "tensor 1 5 1 2\n",
                           "tensor 1 5 1 -3\n", "tensor 4294967296 5 1 0.5\n"}) {
    auto o = parse_observation(text);
    EXPECT_FALSE(o.ok()) << "accepted: " << text;
    if (!o.ok()) {
      EXPECT_EQ(o.status().code(), Code::kDataLoss) << text;
    }
  }
  // The limits themselves are fine.
  auto o = parse_observation("rank 4294967295\nstep 9007199254740992\n");
  ASSERT_TRUE(o.ok()) << o.status().to_string();
  EXPECT_EQ(o->rank, 4294967295u);
  EXPECT_EQ(o->step, uint64_t{1} << 53);
}

}  // namespace
}  // namespace sparsecar
