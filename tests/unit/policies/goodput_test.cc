// The link goodput estimate (GoodputEstimator): log-domain smoothing, outliers beyond 2x that
// move it only when confirm_steps of them agree, and the wall-time lower bound that stands in
// until a completion-based sample arrives. Expected values are worked out by hand below.
#include <gtest/gtest.h>

#include <cmath>

#include "sparsecar/policies/goodput.h"

namespace sparsecar::policies {
namespace {

constexpr double kSmoothing = 0.3;
constexpr uint64_t kConfirm = 2;

TEST(GoodputEstimatorTest, UnknownUntilTheFirstSampleWhichIsTakenAsIs) {
  GoodputEstimator g;
  EXPECT_EQ(g.update(0, 0, kSmoothing, kConfirm), 0.0);
  EXPECT_EQ(g.update(-1, NAN, kSmoothing, kConfirm), 0.0) << "negative and non-finite samples are none";
  EXPECT_EQ(g.update(1e9, 0, kSmoothing, kConfirm), 1e9);
  EXPECT_EQ(g.estimate(), 1e9);
}

TEST(GoodputEstimatorTest, SamplesWithin2xAreSmoothedInTheLogDomain) {
  GoodputEstimator g;
  g.update(1e9, 0, kSmoothing, kConfirm);
  // exp(0.3 ln 1.5e9 + 0.7 ln 1e9) = 1e9 * 1.5^0.3
  EXPECT_NEAR(g.update(1.5e9, 0, kSmoothing, kConfirm), 1e9 * std::pow(1.5, 0.3), 1.0);
}

TEST(GoodputEstimatorTest, AnOutlierIsNoiseUntilConfirmedThenTheGeometricMeanOfTheRun) {
  GoodputEstimator g;
  g.update(1e9, 0, kSmoothing, kConfirm);
  EXPECT_EQ(g.update(1e8, 0, kSmoothing, kConfirm), 1e9) << "one sample below half: held";
  EXPECT_NEAR(g.update(4e8, 0, kSmoothing, kConfirm), 2e8, 1e-3) << "sqrt(1e8 * 4e8)";
  // An outlier on the other side restarts the count.
  GoodputEstimator h;
  h.update(1e9, 0, kSmoothing, kConfirm);
  h.update(1e8, 0, kSmoothing, kConfirm);
  EXPECT_EQ(h.update(3e9, 0, kSmoothing, kConfirm), 1e9) << "above 2x after one below: a new run of one";
  EXPECT_NEAR(h.update(12e9, 0, kSmoothing, kConfirm), 6e9, 1e-2) << "sqrt(3e9 * 12e9)";
  // A sample within 2x between two outliers breaks the run.
  GoodputEstimator k;
  k.update(1e9, 0, kSmoothing, 3);
  k.update(1e8, 0, kSmoothing, 3);
  k.update(1e8, 0, kSmoothing, 3);
  EXPECT_NEAR(k.update(1e9, 0, kSmoothing, 3), 1e9, 1.0) << "within 2x: smoothed, the run ends";
  EXPECT_NEAR(k.update(1e8, 0, kSmoothing, 3), 1e9, 1.0) << "the run of three starts again";
}

TEST(GoodputEstimatorTest, WallTimeStandsInUntilALinkSampleThenOnlyLifts) {
  GoodputEstimator g;
  EXPECT_EQ(g.update(0, 1e6, kSmoothing, kConfirm), 1e6) << "no link sample yet: the lower bound";
  // The first completion-based sample replaces a wall-time-only estimate at once (no outlier run).
  EXPECT_EQ(g.update(1e9, 1e6, kSmoothing, kConfirm), 1e9);
  EXPECT_EQ(g.update(0, 5e8, kSmoothing, kConfirm), 1e9) << "a lower bound below the estimate says nothing";
  EXPECT_NEAR(g.update(0, 1.2e9, kSmoothing, kConfirm), 1e9 * std::pow(1.2, 0.3), 1.0) << "one above lifts it";
  // A link sample below the wall-time bound of the same step is raised to the bound.
  GoodputEstimator h;
  h.update(1e9, 0, kSmoothing, kConfirm);
  EXPECT_NEAR(h.update(8e8, 1.1e9, kSmoothing, kConfirm), 1e9 * std::pow(1.1, 0.3), 1.0);
}

}  // namespace
}  // namespace sparsecar::policies
