# The slow tests' timeouts and their `slow` label (issue 30, docs/testing.md), read by ctest after
# the test lists that gtest_discover_tests writes at build time (tests/CMakeLists.txt appends this
# file to the directory's TEST_INCLUDE_FILES after them).
#
# Every test's timeout is at least three times its time measured under load (`ctest -j2` on the
# 2-core development machine with a second build beside it, which roughly doubles a quiet run).
# Most tests take under 3 s: they get 120 s (tests/CMakeLists.txt), which a hang reaches soon. The
# tests below take longer (quiet `ctest -j2` seconds in the comments); they get more and the label
# `slow`, so that `ctest -LE slow` is a quick pass. The command-line and Python tests, which exist
# when CMake configures, are given theirs in tests/CMakeLists.txt.
set(_megatrain_slow  # name, its suite's label, timeout in seconds
  CompiledStep.MeasuredSpansAndBytesEqualThePrediction executor 300  # 43 s
  MoeSize.GptOssAndQwen3MoeGetTheSmallestH200Host planner 180        # 14 s
  Search.MoreRamNeverGivesASlowerBestPlan planner 120                # 9 s
  Size.TargetNeedsAtLeastAsBigARig planner 120                       # 9 s
)
list(LENGTH _megatrain_slow _n)
math(EXPR _last "${_n} - 1")
foreach(_i RANGE 0 ${_last} 3)
  math(EXPR _j "${_i} + 1")
  math(EXPR _k "${_i} + 2")
  list(GET _megatrain_slow ${_i} _name)
  list(GET _megatrain_slow ${_j} _label)
  list(GET _megatrain_slow ${_k} _timeout)
  set_tests_properties(${_name} PROPERTIES TIMEOUT ${_timeout} LABELS "${_label};slow")
endforeach()
