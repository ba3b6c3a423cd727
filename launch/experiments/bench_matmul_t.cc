// One thread of the CPU decode matmul (flexdraft_jax/kernels/cpu/matmul_t.cc)
// by itself: the kernel's row loop called directly, without XLA or its thread
// pool, over --weights distinct [1536, 576] fp32 weights (DRAM when they pass
// the L3), the best of 12 passes, µs a call for 1-64 rows. Builds of other
// ISAs, blocks or prefetch distances compare in one run:
//
//   INC=$(python -c "import jax; print(jax.ffi.include_dir())")
//   for m in native x86-64-v3; do
//     c++ -O3 -march=$m -ffp-contract=fast -std=c++17 -I $INC \
//         launch/experiments/bench_matmul_t.cc -o /tmp/bench_matmul_t_$m
//   done
//   for m in native x86-64-v3; do taskset -c 1 /tmp/bench_matmul_t_$m 60; done
//
// (-DFLEXDRAFT_WEIGHT_ROWS=R -DFLEXDRAFT_INPUT_ROWS=M -DFLEXDRAFT_PREFETCH=F
// override the block and the distance.) Prints the build, then rows:µs.

#include "../../flexdraft_jax/kernels/cpu/matmul_t.cc"

#include <chrono>
#include <cstdlib>
#include <random>
#include <vector>

int main(int argc, char** argv) {
  const int O = 1536, I = 576;
  const int n_weights = argc > 1 ? std::atoi(argv[1]) : 60;
  const int rows[] = {1, 2, 3, 4, 6, 8, 12, 16, 32, 64};
  std::mt19937 gen(0);
  std::normal_distribution<float> normal;
  std::vector<std::vector<float>> ws(n_weights, std::vector<float>((size_t)O * I));
  for (auto& w : ws)
    for (auto& v : w) v = normal(gen);
  std::vector<float> x(64 * I), y(64 * O);
  for (auto& v : x) v = normal(gen);
  std::printf("%s", FlexdraftMatmulTBuild());
  for (int n : rows) {
    double best = 1e30;
    for (int pass = 0; pass < 12; ++pass) {
      const auto t0 = std::chrono::steady_clock::now();
      for (const auto& w : ws) {
        F32Rows r(x.data(), w.data(), n, I);
        row_groups(r, 0, O, y.data(), O);
      }
      const double us =
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
      best = std::min(best, us / n_weights);
    }
    std::printf(" | %d:%.0f", n, best);
  }
  std::printf("\n");
  return 0;
}
