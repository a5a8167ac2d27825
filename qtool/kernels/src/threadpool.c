/* A small persistent pthread pool with dynamic chunking.
 *
 * A job [0, n) is cut into contiguous chunks; the caller and the workers claim chunks with a CAS on
 * one 64-bit word (generation << 32 | next chunk), so a worker that the OS has descheduled (the
 * machine is shared) simply claims nothing and the caller does the work itself; the caller only
 * ever waits for chunks that were actually claimed. Idle workers spin on the generation for a
 * fixed time (QT_SPIN_NS, read on the clock every QT_SPIN_CHECK pauses: a `pause` takes ~10x more
 * cycles on some CPUs than on others, so a count of them is no measure of time), then sleep on a
 * condition variable: the pool is quiet a few hundred microseconds after its last job. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define QT_PAUSE() _mm_pause()
#else
#define QT_PAUSE() ((void)0)
#endif

#include "qtool_kernels.h"

#define QT_MAX_THREADS 64
#define QT_SPIN_NS 100000     /* spin this long after a job before sleeping (env QTOOL_SPIN_US) */
#define QT_SPIN_CHECK 16      /* pauses between clock reads while spinning */
#define QT_CHUNKS_PER_THREAD 4

static pthread_mutex_t g_call_lock = PTHREAD_MUTEX_INITIALIZER;  /* one job at a time */
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_wake = PTHREAD_COND_INITIALIZER;
static atomic_uint g_generation;        /* bumped once per job; wakes workers */
static _Atomic uint64_t g_claim;        /* (generation << 32) | next chunk */
static atomic_size_t g_completed;       /* chunks finished in the current job */
static int g_nthreads = 0;              /* requested */
static int g_started = 0;               /* workers running (excluding the caller) */
static qt_task_fn g_fn;
static void* g_ctx;
static size_t g_n, g_nchunks;
static double g_min_ns = QT_PARALLEL_MIN_NS;
static int64_t g_spin_ns = -1;          /* set on first use */
static atomic_int g_sleeping;           /* workers waiting on g_wake (the wake-up probe reads it) */

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int64_t spin_ns(void) {
  if (g_spin_ns < 0) {
    const char* env = getenv("QTOOL_SPIN_US");
    double us = env ? atof(env) : QT_SPIN_NS / 1000.0;
    g_spin_ns = us < 0 ? 0 : (int64_t)(us * 1000.0);
  }
  return g_spin_ns;
}

void qt_set_spin_ns(double ns) { g_spin_ns = ns < 0 ? 0 : (int64_t)ns; }
double qt_get_spin_ns(void) { return (double)spin_ns(); }

/* Spin on *word until it differs from `seen` or `limit_ns` have passed; returns its last value. */
static unsigned spin_while_equal(atomic_uint* word, unsigned seen, int64_t limit_ns) {
  unsigned v;
  if (limit_ns <= 0) return atomic_load_explicit(word, memory_order_acquire);
  const int64_t deadline = now_ns() + limit_ns;
  for (unsigned k = 1;; k++) {
    if ((v = atomic_load_explicit(word, memory_order_acquire)) != seen) return v;
    if (k % QT_SPIN_CHECK == 0 && now_ns() >= deadline) return v;
    QT_PAUSE();
  }
}

void qt_set_parallel_min_ns(double ns) { g_min_ns = ns; }

static atomic_size_t g_stat_jobs, g_stat_chunks, g_stat_worker_chunks;

void qt_pool_stats(size_t* jobs, size_t* chunks, size_t* worker_chunks) {
  *jobs = atomic_load(&g_stat_jobs);
  *chunks = atomic_load(&g_stat_chunks);
  *worker_chunks = atomic_load(&g_stat_worker_chunks);
}

static void work(uint32_t gen, int is_worker) {
  for (;;) {
    uint64_t v = atomic_load_explicit(&g_claim, memory_order_acquire);
    if ((uint32_t)(v >> 32) != gen) return;
    size_t c = (size_t)(v & 0xFFFFFFFFu);
    if (c >= g_nchunks) return;
    if (!atomic_compare_exchange_weak_explicit(&g_claim, &v, v + 1, memory_order_acq_rel,
                                               memory_order_acquire))
      continue;
    /* the job cannot change while a claimed chunk is unfinished */
    size_t b = g_n * c / g_nchunks, e = g_n * (c + 1) / g_nchunks;
    if (b < e) g_fn(g_ctx, b, e);
    if (is_worker) atomic_fetch_add_explicit(&g_stat_worker_chunks, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&g_completed, 1, memory_order_acq_rel);
  }
}

typedef struct { unsigned gen; } worker_arg;

static void* worker(void* arg) {
  /* `seen` is the generation at creation time, so a job published before this thread first
   * runs is still picked up. */
  unsigned seen = ((worker_arg*)arg)->gen;
  free(arg);
  for (;;) {
    unsigned gen = spin_while_equal(&g_generation, seen, spin_ns());
    if (gen == seen) {
      pthread_mutex_lock(&g_lock);
      atomic_fetch_add(&g_sleeping, 1);
      while ((gen = atomic_load(&g_generation)) == seen) pthread_cond_wait(&g_wake, &g_lock);
      atomic_fetch_sub(&g_sleeping, 1);
      pthread_mutex_unlock(&g_lock);
    }
    seen = gen;
    work((uint32_t)gen, 1);
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

/* After fork() only the forking thread exists: forget the workers (the child starts its own). */
static void child_after_fork(void) {
  pthread_mutex_init(&g_call_lock, NULL);
  pthread_mutex_init(&g_lock, NULL);
  pthread_cond_init(&g_wake, NULL);
  g_started = 0;
  atomic_store(&g_sleeping, 0);
}

static pthread_once_t g_atfork_once = PTHREAD_ONCE_INIT;
static void register_atfork(void) { pthread_atfork(NULL, NULL, child_after_fork); }

/* Publish a job under g_call_lock. The previous job's claim word is closed first (next chunk =
 * all ones): a worker still inside work() for it, late after its last chunk, can then neither
 * read this job's parameters as the previous one's nor claim a chunk of it under the old
 * generation, whose word it may have loaded before the parameters changed. */
static uint32_t publish(qt_task_fn fn, void* ctx, size_t n, size_t chunks) {
  const uint32_t old = atomic_load(&g_generation), gen = old + 1;
  atomic_store_explicit(&g_claim, ((uint64_t)old << 32) | 0xFFFFFFFFu, memory_order_seq_cst);
  g_fn = fn; g_ctx = ctx; g_n = n; g_nchunks = chunks;
  atomic_store_explicit(&g_completed, 0, memory_order_relaxed);
  atomic_store_explicit(&g_claim, (uint64_t)gen << 32, memory_order_release);
  pthread_mutex_lock(&g_lock);
  atomic_store_explicit(&g_generation, gen, memory_order_release);
  pthread_cond_broadcast(&g_wake);
  pthread_mutex_unlock(&g_lock);
  return gen;
}

/* Wake sleeping workers with an empty job and return at once: they spin for their spin time, so
 * the next job, posted within it, starts without the OS wake-up (tens of microseconds on a VM).
 * The executor calls it when a run starts, before its own Python work on the inputs. */
void qt_pool_prewake(void) {
  if (atomic_load(&g_sleeping) == 0) return;
  pthread_mutex_lock(&g_call_lock);
  if (g_started > 0 && qt_get_num_threads() > 1) publish(NULL, NULL, 0, 0);
  pthread_mutex_unlock(&g_call_lock);
}

int qt_pool_sleeping(void) { return atomic_load(&g_sleeping); }

void qt_parallel(size_t n, qt_task_fn fn, void* ctx, double est_ns) {
  if (n == 0) return;
  pthread_once(&g_atfork_once, register_atfork);
  pthread_mutex_lock(&g_call_lock);
  int T = qt_get_num_threads();
  if ((size_t)T > n) T = (int)n;
  if (est_ns < g_min_ns) T = 1;
  if (T <= 1) {
    pthread_mutex_unlock(&g_call_lock);
    fn(ctx, 0, n);
    return;
  }
  while (g_started < T - 1) {  /* workers are never stopped; more are started on demand */
    pthread_t th;
    pthread_attr_t attr;
    worker_arg* wa = (worker_arg*)malloc(sizeof(worker_arg));
    if (!wa) break;
    wa->gen = atomic_load(&g_generation);
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&th, &attr, worker, wa);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
      free(wa);
      break;
    }
    g_started++;
  }
  size_t chunks = (size_t)T * QT_CHUNKS_PER_THREAD;
  if (chunks > n) chunks = n;
  if (chunks > 0xFFFFFFFEu) chunks = 0xFFFFFFFEu;
  const uint32_t gen = publish(fn, ctx, n, chunks);
  work(gen, 0);
  atomic_fetch_add_explicit(&g_stat_jobs, 1, memory_order_relaxed);
  atomic_fetch_add_explicit(&g_stat_chunks, chunks, memory_order_relaxed);
  if (atomic_load_explicit(&g_completed, memory_order_acquire) < chunks) {
    const int64_t deadline = now_ns() + spin_ns();
    int late = 0;
    for (unsigned k = 1; atomic_load_explicit(&g_completed, memory_order_acquire) < chunks; k++) {
      if (late) {
        sched_yield();  /* a worker holding a chunk was descheduled: give it the CPU */
      } else {
        QT_PAUSE();
        if (k % QT_SPIN_CHECK == 0 && now_ns() >= deadline) late = 1;
      }
    }
  }
  pthread_mutex_unlock(&g_call_lock);
}

/* ---- wake-up probe: how long a worker takes to start a job, asleep or still spinning --------- */

typedef struct {
  pthread_t caller;
  _Atomic int64_t started;  /* clock when a worker began its chunk; 0 until then */
} probe_ctx;

static void probe_task(void* ctx, size_t b, size_t e) {
  (void)b; (void)e;
  probe_ctx* p = (probe_ctx*)ctx;
  if (pthread_equal(pthread_self(), p->caller)) {  /* the caller keeps its chunk until a worker starts */
    const int64_t give_up = now_ns() + 100000000;
    while (atomic_load(&p->started) == 0 && now_ns() < give_up) QT_PAUSE();
  } else {
    int64_t zero = 0;
    atomic_compare_exchange_strong(&p->started, &zero, now_ns());
  }
}

static void sleep_ns(int64_t ns) {
  struct timespec ts = {(time_t)(ns / 1000000000), (long)(ns % 1000000000)};
  nanosleep(&ts, NULL);
}

/* Nanoseconds from the call that posts a job to a worker starting it, one sample; < 0 when the
 * pool has no worker (one thread) or none came within 100 ms. asleep = 1: every worker is first
 * left to finish its spin and sleep; asleep = 0: the job follows another at once (a spinning worker). */
double qt_pool_wake_ns(int asleep) {
  if (qt_get_num_threads() < 2) return -1.0;
  probe_ctx warm = {pthread_self(), 0};
  qt_parallel(2, probe_task, &warm, 1e12);  /* starts the workers; they are now spinning */
  if (g_started < 1) return -1.0;
  if (asleep) {
    const int64_t give_up = now_ns() + spin_ns() + 200000000;
    while (atomic_load(&g_sleeping) < g_started && now_ns() < give_up) sleep_ns(50000);
    sleep_ns(200000);  /* and into the kernel's wait */
  } else {
    const int64_t t = now_ns() + 5000;  /* past the end of the warm job, into the spin */
    while (now_ns() < t) QT_PAUSE();
  }
  probe_ctx p = {pthread_self(), 0};
  const int64_t t0 = now_ns();
  qt_parallel(2, probe_task, &p, 1e12);
  const int64_t t1 = atomic_load(&p.started);
  return t1 > 0 ? (double)(t1 - t0) : -1.0;
}

/* Nanoseconds one `pause` takes on this CPU (the best of a few timed loops; 0 where there is none). */
double qt_pause_ns(void) {
#if defined(__x86_64__) || defined(__i386__)
  double best = 1e30;
  for (int r = 0; r < 5; r++) {
    const int64_t t0 = now_ns();
    for (int i = 0; i < 4096; i++) QT_PAUSE();
    const double per = (double)(now_ns() - t0) / 4096.0;
    if (per < best) best = per;
  }
  return best;
#else
  return 0.0;
#endif
}
