// Units: formatting picks the right unit and rounding; parsing accepts what users type.
#include <gtest/gtest.h>

#include "megatrain/core/units.h"

namespace megatrain {
namespace {

TEST(Units, FormatBytes) {
  EXPECT_EQ(format_bytes(0), "0 B");
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes(8.0 * kGiB), "8.00 GiB");
  EXPECT_EQ(format_bytes(1.5 * kTiB), "1.50 TiB");
  EXPECT_EQ(format_bytes(1023.0 * kMiB), "1023 MiB");
  EXPECT_EQ(format_bytes(1023.9 * kMiB), "1.00 GiB");  // never "1024 MiB"
  EXPECT_EQ(format_bytes(1024.0 * kMiB), "1.00 GiB");
}

TEST(Units, FormatRatesAndTimes) {
  EXPECT_EQ(format_bandwidth(25e9), "25.0 GB/s");
  EXPECT_EQ(format_bandwidth(780e6), "780 MB/s");
  EXPECT_EQ(format_duration(850e-9), "850 ns");
  EXPECT_EQ(format_duration(12.34e-6), "12.3 us");
  EXPECT_EQ(format_duration(4.567e-3), "4.57 ms");
  EXPECT_EQ(format_duration(1.234), "1.23 s");
  EXPECT_EQ(format_duration(150), "2.50 min");
  EXPECT_EQ(format_duration(3 * 3600), "3.00 h");
  EXPECT_EQ(format_flops(4.2e13), "42.0 TFLOP");
  EXPECT_EQ(format_flop_rate(989e12), "989 TFLOP/s");
  EXPECT_EQ(format_count(6738415616), "6.74B");
  EXPECT_EQ(format_count(512), "512");
  EXPECT_EQ(format_thousands(68976648192ull), "68,976,648,192");
  EXPECT_EQ(format_thousands(999), "999");
  EXPECT_EQ(format_thousands(1000), "1,000");
}

TEST(Units, ParseBytes) {
  EXPECT_EQ(*parse_bytes("4096"), 4096u);
  EXPECT_EQ(*parse_bytes("64K"), 65536u);
  EXPECT_EQ(*parse_bytes("8GiB"), 8 * kGiB);
  EXPECT_EQ(*parse_bytes("8 GiB"), 8 * kGiB);
  EXPECT_EQ(*parse_bytes("512MB"), 512000000u);
  EXPECT_EQ(*parse_bytes("1.5TB"), 1500000000000u);
  EXPECT_EQ(*parse_bytes("1.5G"), 3 * kGiB / 2);
  for (const char* bad : {"", "GiB", "12 parsecs", "-5", "0.5", "1e400"}) {
    auto r = parse_bytes(bad);
    EXPECT_FALSE(r.ok()) << bad;
    if (!r.ok()) {
      EXPECT_NE(r.status().message().find("accepted"), std::string::npos);
    }
  }
}

TEST(Status, ResultCarriesValueOrError) {
  Result<int> good = 42;
  EXPECT_TRUE(good.ok());
  EXPECT_EQ(*good, 42);
  Result<int> bad = not_found("x.json does not exist");
  EXPECT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(bad.status().to_string(), "not found: x.json does not exist");
  EXPECT_EQ(bad.status().with_context("plan").message(), "plan: x.json does not exist");
  Result<int> from_ok = Status();  // a Result cannot hold an ok Status
  EXPECT_FALSE(from_ok.ok());
  EXPECT_EQ(from_ok.status().code(), StatusCode::kInternal);
}

TEST(StatusDeathTest, ValueOfAnErrorAborts) {
  Result<int> bad = invalid_argument("nope");
  EXPECT_DEATH((void)bad.value(), "nope");
}

}  // namespace
}  // namespace megatrain
