// Timing the convolution's algorithms on the device for one problem: the
// kernel side of jax_dnn's benchmark mode (jax_dnn/_src/conv/tuning.py, which
// times XLA's convolution itself and picks the fastest). Plain C++ interface
// (no CUDA or XLA types): ffi/registrations.cc binds it in CUDA builds.
#pragma once

#include <string>
#include <vector>

#include "ffi/conv/conv_plan.h"

namespace jax_dnn {

// One algorithm's result: the median of its timed runs in milliseconds, or
// why it could not run (ms is then NaN).
struct ConvTiming {
  double ms;
  std::string error;
};

// Times each algorithm of `algorithm_ids` on `problem` on the current CUDA
// device: allocates the problem's operands and the largest workspace among
// them, fills the inputs with uniform random values in [-1, 1] (never zeros:
// no kernel gets an easy case), then per algorithm, on a stream of its own,
// runs it through LaunchConv (the handlers' path), twice untimed, and then
// up to `repeats` times between CUDA events. Fewer repeats for slow
// candidates: at most kConvBenchmarkBudgetMs of timed runs each, and a
// candidate whose second untimed run already took 1.5x the best median so
// far is not timed further (it cannot win; its time is that run's). Frees
// everything before returning. Returns "" with one ConvTiming per id, or
// why nothing could be timed (no device, out of memory), then *timings is
// empty.
inline constexpr double kConvBenchmarkBudgetMs = 50.0;
std::string ConvBenchmark(const ConvProblem& problem, const std::vector<int>& algorithm_ids,
                          int repeats, std::vector<ConvTiming>* timings);

}  // namespace jax_dnn
