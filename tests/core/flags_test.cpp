// Numeric flag values (core/flags.h): whole text only, bounds inclusive, one message form
// (issue 16: `--steps 0` printed a 309-digit upper bound and exited 105).
#include <gtest/gtest.h>

#include "megatrain/core/flags.h"

namespace megatrain {
namespace {

TEST(Flags, WholeNumbersInRange) {
  EXPECT_EQ(int_flag_error("1", 1, 10), "");
  EXPECT_EQ(int_flag_error("10", 1, 10), "");
  EXPECT_EQ(int_flag_error("+7", 1, 10), "");
  EXPECT_EQ(*parse_int_flag("--steps", "+7", 1, 10), 7);
  EXPECT_EQ(*parse_int_flag("--top", "0", 0, 1000), 0);
}

TEST(Flags, WholeNumbersOutOfRange) {
  EXPECT_EQ(int_flag_error("0", 1, 1000000000), "must be at least 1 (got 0)");
  EXPECT_EQ(int_flag_error("-3", 1, 10), "must be at least 1 (got -3)");
  EXPECT_EQ(int_flag_error("11", 1, 10), "must be at most 10 (got 11)");
  // Past int64: still "at most" / "at least", not "not a number".
  EXPECT_EQ(int_flag_error("99999999999999999999", 1, 10), "must be at most 10 (got 99999999999999999999)");
  EXPECT_EQ(int_flag_error("-99999999999999999999", 1, 10), "must be at least 1 (got -99999999999999999999)");
  EXPECT_EQ(parse_int_flag("--steps", "0", 1, 1000000000).status().message(), "--steps: must be at least 1 (got 0)");
}

TEST(Flags, NotWholeNumbers) {
  for (const char* bad : {"abc", "", "1.5", "12abc", " 3", "1e3", "+-1", "-", "0x10"})
    EXPECT_EQ(int_flag_error(bad, 1, 256), std::string("expected a whole number from 1 to 256 (got '") + bad + "')") << bad;
  EXPECT_EQ(parse_int_flag("--steps", "abc", 1, 5).status().code(), StatusCode::kInvalidArgument);
}

TEST(Flags, RealNumbers) {
  EXPECT_EQ(number_flag_error("0.25", 0.0, 0.5), "");
  EXPECT_EQ(number_flag_error("1e3", 0.0, 1e15), "");
  EXPECT_DOUBLE_EQ(*parse_number_flag("--tolerance", "0.5", 0.0, 0.5), 0.5);
  EXPECT_EQ(number_flag_error("0.6", 0.0, 0.5), "must be at most 0.5 (got 0.6)");
  EXPECT_EQ(number_flag_error("0.001", 0.01, 4096.0), "must be at least 0.01 (got 0.001)");
  EXPECT_EQ(number_flag_error("2e15", 0.0, 1e15), "must be at most 1000000000000000 (got 2e15)");
  for (const char* bad : {"x", "", "nan", "inf", "1.5GiB"})
    EXPECT_EQ(number_flag_error(bad, 0.0, 0.5), std::string("expected a number from 0 to 0.5 (got '") + bad + "')") << bad;
}

TEST(Flags, BoundsPrintShort) {
  EXPECT_EQ(format_flag_bound(1048576.0), "1048576");
  EXPECT_EQ(format_flag_bound(0.01), "0.01");
  EXPECT_EQ(format_flag_bound(1e300), "1e+300");
}

}  // namespace
}  // namespace megatrain
