"""Does a core hide its memory reads behind its own arithmetic? A C probe
(compiled here with gcc -O2 -march=native, AVX2) reads 1 GiB on huge pages in
runs of R bytes (in address order, or the runs shuffled), optionally
prefetching D lines ahead (T0), and does W 8-lane FMAs per 64-byte line on 8
independent accumulators. Each line prints GB/s cold (1 GiB) and, for the
arithmetic rows, hot (the same loop over 384 KiB, in L2); with perfect
overlap cold would be min(hot, plain stream), with none 1 / (1/hot + 1/stream).

    .venv/bin/python scripts/stream_overlap.py        # THREADS=2 runs two copies at once

Measured 2026-12-02 17:40 UTC on the 2-core Zen 5, one thread, GB/s (a slow
minute: the plain stream 23.4): 6 KB runs shuffled 8.6, with prefetch 16.7;
100 KB runs shuffled 16.7; 4 FMAs a line: hot 61.1, cold in order 22.7 (the
stream's speed: full overlap), 6 KB runs shuffled + prefetch 13.3, 100 KB
runs + prefetch 24.8; 12 FMAs a line: hot 22.4, cold in order 18.6, 100 KB
runs + prefetch 16.5 (hot 20.6). Two copies at once: the same per thread for
plain reads, less with arithmetic (4 FMAs in order 19.0 / 15.8). So the core
does overlap a stream with independent arithmetic; what costs is short
scattered runs (6 KB: one 16-token K block of the default model), at half to
two-thirds a long run's speed even with prefetch. An AVX-512 BF16 variant
(4 vdpbf16ps a line, a faster minute: stream 32.4) gave hot 42.9, cold in
order 26.0, 100 KB runs + prefetch 25.6, 6 KB runs + prefetch 18.7: partial
overlap; with 14 dependent vdpbf16ps a line (hot 17.5) cold 12.1, none.
"""
import os
import subprocess
import tempfile

SOURCE = r"""
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char** argv) {
  long total = atol(argv[1]), R = atol(argv[2]), pfd = atol(argv[5]);
  int shuffled = atoi(argv[3]), work = atoi(argv[4]), reps = atoi(argv[6]);
  char* buf = mmap(0, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  madvise(buf, total, MADV_HUGEPAGE);
  memset(buf, 1, total);
  long runs = total / R, n = 0;
  long* order = malloc(runs * sizeof(long));
  for (long i = 0; i < runs; i++) order[i] = i;
  srand(1);
  if (shuffled) for (long i = runs - 1; i > 0; i--) { long j = rand() % (i + 1), t = order[i]; order[i] = order[j]; order[j] = t; }
  char** lines = malloc(total / 64 * sizeof(char*));
  for (long i = 0; i < runs; i++) for (long o = 0; o < R; o += 64) lines[n++] = buf + order[i] * R + o;
  __m256 a[8], m = _mm256_set1_ps(1.0001f);
  for (int u = 0; u < 8; u++) a[u] = _mm256_setzero_ps();
  double best = 1e9;
  for (int r = 0; r < reps; r++) {
    double t = now();
    for (long i = 0; i + 8 <= n; i += 8) {
      if (pfd && i + pfd + 8 <= n) for (int u = 0; u < 8; u++) _mm_prefetch(lines[i + pfd + u], _MM_HINT_T0);
      for (int u = 0; u < 8; u++) {
        __m256 v = _mm256_add_ps(_mm256_load_ps((float*)lines[i + u]), _mm256_load_ps((float*)(lines[i + u] + 32)));
        if (work == 0) a[u] = _mm256_add_ps(a[u], v);
        for (int w = 0; w < work; w++) a[u] = _mm256_fmadd_ps(a[u], m, v);
      }
    }
    double dt = now() - t;
    if (dt < best) best = dt;
  }
  float s = 0, out[8];
  for (int u = 0; u < 8; u++) { _mm256_storeu_ps(out, a[u]); for (int k = 0; k < 8; k++) s += out[k]; }
  printf("%.1f %g\n", n * 64.0 / best / 1e9, s);
  return 0;
}
"""

CASES = [  # (run bytes, shuffled, FMAs a line, prefetch distance in lines)
    (6144, 0, 0, 0), (6144, 1, 0, 0), (6144, 1, 0, 128), (102400, 1, 0, 0),
    (6144, 0, 4, 0), (6144, 1, 4, 0), (6144, 1, 4, 128), (102400, 1, 4, 64),
    (6144, 0, 12, 0), (102400, 1, 12, 64),
]


def main() -> None:
    threads = int(os.environ.get("THREADS", "1"))
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, "probe.c"), os.path.join(tmp, "probe")
        with open(src, "w") as f:
            f.write(SOURCE)
        subprocess.run(["gcc", "-O2", "-march=native", "-o", exe, src], check=True)

        def run(total: int, case: tuple[int, int, int, int], reps: int) -> str:
            r, shuffled, work, pfd = case
            cmd = [exe, str(total), str(r), str(shuffled), str(work), str(pfd), str(reps)]
            procs = [subprocess.Popen(["taskset", "-c", str(t), *cmd], stdout=subprocess.PIPE, text=True)
                     for t in range(threads)]
            return " / ".join(p.communicate()[0].split()[0] for p in procs)

        print(f"{threads} thread(s) at once; GB/s a thread")
        print("| run bytes | order | FMAs a line | prefetch lines | cold | hot |")
        print("|---|---|---|---|---|---|")
        for case in CASES:
            cold = run(1 << 30, case, 3)
            hot = run(6144 * 64, case, 2000) if case[2] else "-"
            print(f"| {case[0]} | {'shuffled' if case[1] else 'in order'} | {case[2]} | {case[3]} | {cold} | {hot} |")


if __name__ == "__main__":
    main()
