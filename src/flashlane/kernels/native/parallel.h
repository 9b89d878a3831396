// Rows split over the calling process's OpenMP team. A kernel built with -fopenmp (build.py's
// OPENMP) links libgomp.so.1, which the dynamic linker resolves to the runtime torch has already
// loaded: one team, torch's, whose idle threads take the parts at once (threads of our own would
// compete with torch's spinning ones for the same cores). `threads` comes from the caller:
// torch's thread count, or 1 where the work is too small to share. A source built without
// OpenMP (a kernel that includes this one's file) runs every part on the calling thread.
#pragma once
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

// body(first, count) over [0, rows) in at most `threads` contiguous parts
template <typename F>
static inline void parallel_rows(int64_t rows, int64_t threads, F&& body) {
    if (threads <= 1 || rows <= 1) {
        if (rows > 0) body(int64_t(0), rows);
        return;
    }
#ifdef _OPENMP
#pragma omp parallel num_threads(static_cast<int>(threads))
    {
        const int64_t n = omp_get_num_threads(), i = omp_get_thread_num();
        const int64_t step = (rows + n - 1) / n, first = i * step;
        if (first < rows) body(first, first + step < rows ? step : rows - first);
    }
#else
    body(int64_t(0), rows);
#endif
}
