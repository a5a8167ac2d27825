/* A small persistent pthread pool: the caller runs range 0, workers 1..T-1.
 * Workers spin briefly on a generation counter, then sleep on a condition variable. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define QT_PAUSE() _mm_pause()
#else
#define QT_PAUSE() ((void)0)
#endif

#include "qtool_kernels.h"

#define QT_MAX_THREADS 64
#define QT_SPIN 20000

static pthread_mutex_t g_call_lock = PTHREAD_MUTEX_INITIALIZER;  /* one job at a time */
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_wake = PTHREAD_COND_INITIALIZER;
static pthread_cond_t g_done_cv = PTHREAD_COND_INITIALIZER;
static atomic_uint g_generation;
static atomic_int g_pending;
static int g_nthreads = 0;     /* requested */
static int g_started = 0;      /* workers running (excluding caller) */
static qt_task_fn g_fn;
static void* g_ctx;
static size_t g_n;
static int g_active;           /* threads used for the current job */

static void run_range(int t) {
  size_t b = g_n * (size_t)t / (size_t)g_active, e = g_n * (size_t)(t + 1) / (size_t)g_active;
  if (b < e) g_fn(g_ctx, b, e);
}

typedef struct { int t; unsigned gen; } worker_arg;

static void* worker(void* arg) {
  /* `seen` is the generation at creation time: a job published before this thread got to run
   * must still be picked up. */
  int t = ((worker_arg*)arg)->t;
  unsigned seen = ((worker_arg*)arg)->gen;
  free(arg);
  for (;;) {
    unsigned gen;
    int spins = 0;
    while ((gen = atomic_load_explicit(&g_generation, memory_order_acquire)) == seen &&
           spins < QT_SPIN) {
      QT_PAUSE();
      spins++;
    }
    if (gen == seen) {
      pthread_mutex_lock(&g_lock);
      while ((gen = atomic_load(&g_generation)) == seen) pthread_cond_wait(&g_wake, &g_lock);
      pthread_mutex_unlock(&g_lock);
    }
    seen = gen;
    if (t < g_active) run_range(t);
    if (atomic_fetch_sub_explicit(&g_pending, 1, memory_order_acq_rel) == 1) {
      pthread_mutex_lock(&g_lock);
      pthread_cond_signal(&g_done_cv);
      pthread_mutex_unlock(&g_lock);
    }
  }
  return NULL;
}

static int default_threads(void) {
  const char* env = getenv("QTOOL_NUM_THREADS");
  int n = env ? atoi(env) : 2;
  return n < 1 ? 1 : (n > QT_MAX_THREADS ? QT_MAX_THREADS : n);
}

void qt_set_num_threads(int n) {
  pthread_mutex_lock(&g_call_lock);
  g_nthreads = n < 1 ? 1 : (n > QT_MAX_THREADS ? QT_MAX_THREADS : n);
  pthread_mutex_unlock(&g_call_lock);
}

int qt_get_num_threads(void) {
  if (g_nthreads == 0) g_nthreads = default_threads();
  return g_nthreads;
}

void qt_parallel(size_t n, qt_task_fn fn, void* ctx) {
  if (n == 0) return;
  pthread_mutex_lock(&g_call_lock);
  int T = qt_get_num_threads();
  if ((size_t)T > n) T = (int)n;
  if (T <= 1) {
    pthread_mutex_unlock(&g_call_lock);
    fn(ctx, 0, n);
    return;
  }
  while (g_started < T - 1) {  /* workers are never stopped; start more on demand */
    pthread_t th;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    worker_arg* wa = (worker_arg*)malloc(sizeof(worker_arg));
    if (!wa) break;
    wa->t = g_started + 1;
    wa->gen = atomic_load(&g_generation);
    if (pthread_create(&th, &attr, worker, wa) != 0) {
      free(wa);
      pthread_attr_destroy(&attr);
      break;
    }
    pthread_attr_destroy(&attr);
    g_started++;
  }
  if (T > g_started + 1) T = g_started + 1;
  g_fn = fn; g_ctx = ctx; g_n = n; g_active = T;
  atomic_store(&g_pending, g_started);
  pthread_mutex_lock(&g_lock);
  atomic_fetch_add_explicit(&g_generation, 1, memory_order_release);
  pthread_cond_broadcast(&g_wake);
  pthread_mutex_unlock(&g_lock);
  run_range(0);
  int spins = 0;
  while (atomic_load_explicit(&g_pending, memory_order_acquire) > 0 && spins < QT_SPIN) {
    QT_PAUSE();
    spins++;
  }
  if (atomic_load(&g_pending) > 0) {
    pthread_mutex_lock(&g_lock);
    while (atomic_load(&g_pending) > 0) pthread_cond_wait(&g_done_cv, &g_lock);
    pthread_mutex_unlock(&g_lock);
  }
  pthread_mutex_unlock(&g_call_lock);
}
