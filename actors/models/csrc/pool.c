/* A small thread pool for the CPU kernels: one call's chunks shared by the caller and its helpers.

   Built by actors/models/cpu_pool.py (gcc -O3 -pthread) and used by the other kernels (the block
   GEMM's linears, the decode attention), which receive `tidal_pool_run`'s address from Python and
   call it with a task of their own: `task(ctx, chunk, scratch)` for chunk = 0 .. chunks - 1, each
   chunk on exactly one thread, `scratch` that thread's buffer of at least `scratch_bytes` (64-byte
   aligned). A kernel whose chunks each compute their outputs alone gives the same bits on any
   number of threads. Plain C: no torch headers.

   Why not OpenMP: a 2-core box serves with the model worker beside the Serve processes, and a
   team that waits for a preempted member at a barrier stalls the whole step (measured: oneDNN's
   two threads on 5-12-row decode steps were faster offline and slower served). Here nothing
   waits for a helper that has not started: the chunks are claimed from one counter by every
   thread, the caller too, and the caller waits only for chunks a helper has already begun (each
   a few microseconds). A helper the OS has not scheduled claims nothing, and the caller does its
   share. While it waits the caller sleeps on a futex after a short spin, so a preempted helper
   can take its core. Between calls a helper waits `spin_ns` for the next one, yielding its core
   to any other runnable thread at every turn (sched_yield: the Serve processes beside it run
   first), then sleeps on a futex. One pool serves every kernel, so the helper that finished a
   layer's projection is still awake for its attention a few microseconds later.

   The claim counter holds the call's generation in its high 32 bits, so a helper that wakes late
   cannot claim a chunk of a later call, and a call closes its counter before it returns, so a
   claim made with a value read during the call fails once the call is over; the call's
   arguments are copied only after a successful claim, and a call ends only when all its chunks
   are done. One caller at a time uses the pool (a second, concurrent caller computes alone). */

#define _GNU_SOURCE /* syscall(), clock_gettime() under -std=c11 */
#include <stdint.h>
#include <stdlib.h>

typedef void (*pool_task)(void *ctx, int64_t chunk, void *scratch);

static void *scratch_alloc(int64_t bytes) {
    return aligned_alloc(64, (size_t)((bytes + 63) / 64 * 64 + 64));
}

/* Every chunk on this thread, in order: 0, or 3 when the scratch cannot be allocated. */
static int run_alone(pool_task task, void *ctx, int64_t chunks, int64_t scratch_bytes) {
    void *scratch = scratch_alloc(scratch_bytes);
    if (scratch == NULL) return 3;
    for (int64_t c = 0; c < chunks; c++) task(ctx, c, scratch);
    free(scratch);
    return 0;
}

#if defined(__linux__)
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define POOL_MAX 8

typedef struct {
    pool_task task;
    void *ctx;
    int64_t scratch_bytes;
    int chunks;
} pool_job;

static pool_job job;
static _Atomic uint64_t ticket;             /* generation << 32 | next chunk to claim */
static atomic_int posted;                   /* the latest generation: the helpers' futex word */
static atomic_int finished;                 /* chunks done in the current call: the caller's futex word */
static atomic_int helpers_sleeping, caller_sleeping;
static atomic_long spin_ns = 0;             /* set by the loader (cpu_pool.py's SPIN_NS) */
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static int helpers;                         /* started so far (under pool_lock) */

static void futex_wait(atomic_int *addr, int value) {
    syscall(SYS_futex, (int *)addr, FUTEX_WAIT_PRIVATE, value, NULL, NULL, 0);
}

static void futex_wake(atomic_int *addr, int count) {
    syscall(SYS_futex, (int *)addr, FUTEX_WAKE_PRIVATE, count, NULL, NULL, 0);
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Claim and run chunks of generation `gen` until none is left. `*scratch`, `*cap`: this thread's buffer. */
static void work(uint32_t gen, void **scratch, int64_t *cap) {
    for (;;) {
        uint64_t t = atomic_load(&ticket);
        if ((uint32_t)(t >> 32) != gen) return;
        int chunks = __atomic_load_n(&job.chunks, __ATOMIC_RELAXED);
        int64_t bytes = __atomic_load_n(&job.scratch_bytes, __ATOMIC_RELAXED);
        if ((int64_t)(uint32_t)t >= chunks) return;
        if (*cap < bytes) {  /* before claiming: a thread without scratch leaves the chunk to others */
            free(*scratch);
            *scratch = scratch_alloc(bytes);
            *cap = *scratch ? bytes : 0;
            if (*scratch == NULL) return;
        }
        if (!atomic_compare_exchange_weak(&ticket, &t, t + 1)) continue;
        /* Claimed: the call cannot end before this chunk is done, so its arguments (read above
           and here, all written before the generation was posted) hold still. */
        pool_job j = job;
        j.task(j.ctx, (int64_t)(uint32_t)t, *scratch);
        atomic_fetch_add(&finished, 1);
        if (atomic_load(&caller_sleeping)) futex_wake(&finished, 1);
    }
}

static void *helper_main(void *arg) {
    (void)arg;
    void *scratch = NULL;
    int64_t cap = 0;
    int seen = atomic_load(&posted);
    for (;;) {
        int64_t until = now_ns() + atomic_load(&spin_ns);
        while (atomic_load(&posted) == seen) {
            if (now_ns() >= until) {
                atomic_fetch_add(&helpers_sleeping, 1);
                if (atomic_load(&posted) == seen) futex_wait(&posted, seen);
                atomic_fetch_sub(&helpers_sleeping, 1);
                until = now_ns() + atomic_load(&spin_ns);
            }
            sched_yield();
        }
        seen = atomic_load(&posted);
        work((uint32_t)seen, &scratch, &cap);
    }
    return NULL;
}

/* task(ctx, c, scratch) for every c in [0, chunks), on `threads` threads (this one and threads - 1
   helpers, started on first use and kept). Returns 0, or 1 for a chunk count past INT_MAX, 3
   when the caller's scratch cannot be allocated. One thread, one chunk, a pool that cannot start
   its helpers or one in use by another caller: this thread runs every chunk. */
int tidal_pool_run(pool_task task, void *ctx, int64_t chunks, int64_t scratch_bytes, int threads) {
    if (chunks < 0 || chunks > INT_MAX || scratch_bytes < 0) return 1;
    if (threads > POOL_MAX) threads = POOL_MAX;
    if (threads < 2 || chunks < 2 || pthread_mutex_trylock(&pool_lock) != 0)
        return run_alone(task, ctx, chunks, scratch_bytes);
    while (helpers < threads - 1) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&t, &attr, helper_main, NULL);
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        helpers++;
    }
    void *scratch = scratch_alloc(scratch_bytes);
    if (scratch == NULL) {
        pthread_mutex_unlock(&pool_lock);
        return 3;
    }
    job = (pool_job){task, ctx, scratch_bytes, (int)chunks};
    atomic_store(&finished, 0);
    uint32_t gen = (uint32_t)atomic_load(&posted) + 1;
    atomic_store(&ticket, (uint64_t)gen << 32);
    atomic_store(&posted, (int)gen);
    if (atomic_load(&helpers_sleeping)) futex_wake(&posted, INT_MAX);
    int64_t cap = scratch_bytes;
    work(gen, &scratch, &cap);
    int64_t until = now_ns() + 20000;
    for (int spins = 0; atomic_load(&finished) < chunks; spins++) {
        if ((spins & 63) == 0 && now_ns() >= until) {
            atomic_store(&caller_sleeping, 1);
            int seen = atomic_load(&finished);
            if (seen < chunks) futex_wait(&finished, seen);
            atomic_store(&caller_sleeping, 0);
        }
        relax();
    }
    /* Closed: a helper still holding this generation's counter value from before (descheduled
       between reading it and claiming) now fails its claim, even after the next call has
       rewritten `job`, and cannot count a chunk into that call's `finished`. */
    atomic_store(&ticket, ((uint64_t)gen << 32) | 0xFFFFFFFFu);
    free(scratch);
    pthread_mutex_unlock(&pool_lock);
    return 0;
}

/* How long an idle helper waits for the next call, yielding its core, before it sleeps (ns; 0:
   sleep at once). */
void tidal_pool_spin(long ns) { atomic_store(&spin_ns, ns < 0 ? 0 : ns); }

#else
int tidal_pool_run(pool_task task, void *ctx, int64_t chunks, int64_t scratch_bytes, int threads) {
    (void)threads;
    if (chunks < 0 || scratch_bytes < 0) return 1;
    return run_alone(task, ctx, chunks, scratch_bytes);
}
void tidal_pool_spin(long ns) { (void)ns; }
#endif
