"""A thread pool for the decode step's CPU kernels whose caller never waits for a descheduled helper.

An OpenMP parallel region ends in a barrier of its whole team: when another process (a load client, the
application's own work) or the event loop takes one of the team's CPUs for a time slice, every other thread
waits out that slice at the region's end, and a decode step runs a region per matmul and per attention, so on a
machine whose CPUs the engine shares those waits are a large part of a step (docs/performance.md, "Sharing the
machine"). Used where ``EngineOptions.cpu_kernel_pool`` is on.

``KernelPool`` runs a job of independent tasks on the calling thread and ``helpers`` threads of its own. Tasks
are claimed one at a time from a shared counter (each participant claims the next one as it starts one, so
that a kernel can fetch its data ahead). A task is computed into the participant's private scratch and then
committed (copied to the job's output) only if it is still that participant's: once no task is left to claim,
the caller takes over every task a helper has not finished (at once if the helper has not started it, after
about two tasks' time if it has), computes it itself, and returns. A helper that comes back later finds its
task taken and drops its result. So the caller's time is bounded by the work, not by the scheduler.

What a task may read: a late helper can still be computing a task after the caller returned, so a task reads
only memory that lives as long as the pool (its inputs copied into the pool's input buffer, ``input``; the
weights and the KV cache, which the owner frees only after ``close``) and must be safe on garbage inputs (a
later job may be overwriting the input buffer): the kernels bound-check every index they read from it.
``close`` joins the helpers. The job's context (its pointers and sizes) is copied into the pool when the job
is published and by each helper before use.

C interface (``HEADER``, included by the kernels that run on the pool):
``run(pool, job)`` runs ``job`` and returns 1 once every task is committed, or 0 without running anything
when the pool cannot take it (more scratch than the pool has, a context too large); the caller then runs the
kernel its usual way.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading

from asyncllm.backends.cpu import _native as native
from asyncllm.backends.cpu._native import I32, I64, PTR

logger = logging.getLogger("asyncllm")

__all__ = ["HEADER", "HELPER_NAME", "KernelPool", "available"]

HELPER_NAME = "asyncllm-pool"
"""The helpers' thread name (``/proc/<pid>/task/<tid>/comm``, py-spy, top)."""

HEADER = r"""
#define POOL_CONTEXT_BYTES 512
/* A job: `tasks` independent tasks. compute(context, task, next, scratch) computes task `task` into the
   participant's scratch (`next`: the task it computes after this one, -1 if none, for prefetching);
   commit(context, task, scratch) copies a computed task into the job's output; direct(context, task, next,
   scratch) computes it straight into the output, as compute then commit would: the caller's way (nothing can
   take a task from the caller). */
typedef struct pool_job {
    void (*compute)(const void *context, int64_t task, int64_t next, void *scratch);
    void (*commit)(const void *context, int64_t task, const void *scratch);
    void (*direct)(const void *context, int64_t task, int64_t next, void *scratch);
    int64_t tasks;
    int64_t scratch_bytes;
    int64_t threads;
    int64_t context_bytes;
    _Alignas(64) unsigned char context[POOL_CONTEXT_BYTES];
} pool_job;
typedef int (*pool_run_fn)(void *pool, const pool_job *job);
"""

_SOURCE = (
    r"""
#define _GNU_SOURCE
#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
"""
    + HEADER
    + r"""
/* A task's state: the job's sequence number (high bits) and where the task is (low 8 bits). A state of an
   older job reads as "not marked yet". */
#define STATE(seq, s) (((uint64_t)(seq) << 8) | (s))
#define HELPER_NAME "asyncllm-pool"
#define YIELD_EVERY 16
enum { CLAIMED = 1, STARTED = 2, COMMITTING = 3, DONE = 4, TAKEN = 5 };

typedef struct pool {
    uint32_t seq;            /* futex word: odd while the caller writes `job`, even once it is published */
    int stop;
    uint64_t claims;         /* the job's sequence number << 32 | the next unclaimed task */
    uint64_t *states;
    int64_t max_tasks;
    int64_t scratch_bytes;   /* per participant */
    unsigned char *scratch;  /* participant 0 (the caller), then each helper's */
    unsigned char *input;
    int64_t input_bytes;
    int helpers;
    int spin;                /* spins (mostly pause instructions) a helper waits for the next job before it sleeps */
    int sleepers;
    int hold;                /* tests: a helper that starts a task waits here first, as if descheduled */
    int *inside;             /* per helper: inside a job (quiesce waits for none) */
    pthread_t *threads;
    pool_job job;
    int64_t stolen, wakes;
} pool;

static inline int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* The next task of job `seq`, or -1 when the job has none left (or is no longer the current one). */
static inline int64_t claim(pool *p, uint32_t seq, int64_t tasks) {
    uint64_t current = __atomic_load_n(&p->claims, __ATOMIC_RELAXED);
    for (;;) {
        if ((uint32_t)(current >> 32) != seq || (int64_t)(uint32_t)current >= tasks) return -1;
        if (__atomic_compare_exchange_n(&p->claims, &current, current + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
            return (int64_t)(uint32_t)current;
    }
}

/* A helper marks a task it claimed as its own, unless the caller took it first: a state of this job, or of a
   later one (a helper descheduled between its claim and its mark comes back after its job ended; overwriting
   what a later job left there would let it commit into memory its job's caller no longer owns). */
static inline int mark_claimed(pool *p, uint32_t seq, int64_t task) {
    uint64_t current = __atomic_load_n(&p->states[task], __ATOMIC_ACQUIRE);
    for (;;) {
        if ((int32_t)((uint32_t)(current >> 8) - seq) >= 0) return 0;
        if (__atomic_compare_exchange_n(&p->states[task], &current, STATE(seq, CLAIMED), 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE))
            return 1;
    }
}

/* Move a task of job `seq` from `from` to `to`; 0 if the caller took it first. */
static inline int advance(pool *p, uint32_t seq, int64_t task, int from, int to) {
    uint64_t expected = STATE(seq, from);
    return __atomic_compare_exchange_n(&p->states[task], &expected, STATE(seq, to), 0, __ATOMIC_ACQ_REL,
                                       __ATOMIC_ACQUIRE);
}

/* A helper's part of job `seq`: claim, compute into its scratch, commit what is still its own. */
static void help(pool *p, const pool_job *job, uint32_t seq, unsigned char *scratch) {
    int64_t task = claim(p, seq, job->tasks);
    int mine = task >= 0 && mark_claimed(p, seq, task);
    while (task >= 0) {
        const int64_t next = claim(p, seq, job->tasks);
        const int next_mine = next >= 0 && mark_claimed(p, seq, next);
        if (mine && advance(p, seq, task, CLAIMED, STARTED)) {
            while (__atomic_load_n(&p->hold, __ATOMIC_ACQUIRE) && !__atomic_load_n(&p->stop, __ATOMIC_ACQUIRE))
                sched_yield();
            job->compute(job->context, task, next, scratch);
            if (advance(p, seq, task, STARTED, COMMITTING)) {
                job->commit(job->context, task, scratch);
                __atomic_store_n(&p->states[task], STATE(seq, DONE), __ATOMIC_RELEASE);
            }
        }
        task = next;
        mine = next_mine;
    }
}

static void *helper_main(void *argument) {
    pool *p = ((void **)argument)[0];
    const int index = (int)(intptr_t)((void **)argument)[1];
    free(argument);
    unsigned char *scratch = p->scratch + (int64_t)(index + 1) * p->scratch_bytes;
    uint32_t seen = __atomic_load_n(&p->seq, __ATOMIC_ACQUIRE) & ~1u;
    pool_job job;
    int idle = 0;  /* left out of the last job (fewer threads than helpers): sleep at once, spin for nothing */
    for (;;) {
        uint32_t seq;
        int spins = idle ? p->spin : 0;
        for (;;) {
            if (__atomic_load_n(&p->stop, __ATOMIC_ACQUIRE)) return NULL;
            seq = __atomic_load_n(&p->seq, __ATOMIC_ACQUIRE);
            if (seq != seen && !(seq & 1)) break;
            if (++spins < p->spin) {
                /* Every YIELD_EVERY spins the CPU goes to any other thread that wants it: a load client, the
                   event loop, the rest of the application; else the helper spins on at once. */
                if (spins % YIELD_EVERY == 0)
                    sched_yield();
                else
                    _mm_pause();
                continue;
            }
            __atomic_add_fetch(&p->sleepers, 1, __ATOMIC_SEQ_CST);
            if (__atomic_load_n(&p->seq, __ATOMIC_SEQ_CST) == seq && !__atomic_load_n(&p->stop, __ATOMIC_SEQ_CST))
                syscall(SYS_futex, &p->seq, FUTEX_WAIT_PRIVATE, seq, NULL, NULL, 0);
            __atomic_sub_fetch(&p->sleepers, 1, __ATOMIC_SEQ_CST);
            spins = 0;
        }
        __atomic_store_n(&p->inside[index], 1, __ATOMIC_SEQ_CST);
        memcpy(&job, &p->job, sizeof job);  /* a seqlock read: kept only if the sequence did not move meanwhile */
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (__atomic_load_n(&p->seq, __ATOMIC_RELAXED) == seq) {
            seen = seq;
            idle = index >= job.threads - 1;
            if (!idle) help(p, &job, seq, scratch);
        }
        __atomic_store_n(&p->inside[index], 0, __ATOMIC_RELEASE);
    }
}

void *asyncllm_pool_create(int helpers, int64_t max_tasks, int64_t scratch_bytes, int64_t input_bytes, int spin) {
    /* The pool holds a job, whose context is 64-byte aligned: calloc's 16 bytes are not enough (the compiler may
       copy a job with aligned vector stores). */
    const size_t pool_bytes = (sizeof(pool) + 63) / 64 * 64;
    pool *p = aligned_alloc(64, pool_bytes);
    if (!p) return NULL;
    memset(p, 0, pool_bytes);
    p->helpers = helpers;
    p->max_tasks = max_tasks;
    p->scratch_bytes = (scratch_bytes + 63) / 64 * 64;
    p->spin = spin;
    p->states = calloc((size_t)max_tasks, sizeof(uint64_t));
    p->scratch = aligned_alloc(64, (size_t)((helpers + 1) * p->scratch_bytes));
    p->input_bytes = (input_bytes + 63) / 64 * 64;
    p->input = aligned_alloc(64, (size_t)(p->input_bytes ? p->input_bytes : 64));
    p->inside = calloc((size_t)(helpers ? helpers : 1), sizeof(int));
    p->threads = calloc((size_t)(helpers ? helpers : 1), sizeof(pthread_t));
    int ok = p->states && p->scratch && p->input && p->inside && p->threads;
    int started = 0;
    for (; ok && started < helpers; ++started) {
        void **argument = malloc(2 * sizeof(void *));
        if (!argument) break;
        argument[0] = p;
        argument[1] = (void *)(intptr_t)started;
        if (pthread_create(&p->threads[started], NULL, helper_main, argument)) {
            free(argument);
            break;
        }
        pthread_setname_np(p->threads[started], HELPER_NAME);  /* set here, so it is set once create returns */
    }
    p->helpers = started;
    if (!ok || started < helpers) {
        __atomic_store_n(&p->stop, 1, __ATOMIC_SEQ_CST);
        syscall(SYS_futex, &p->seq, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
        for (int i = 0; i < started; ++i) pthread_join(p->threads[i], NULL);
        free(p->states); free(p->scratch); free(p->input); free(p->inside); free(p->threads); free(p);
        return NULL;
    }
    return p;
}

/* Stop and join the helpers (each finishes the task it is computing first), then free the pool. */
void asyncllm_pool_destroy(void *handle) {
    pool *p = handle;
    __atomic_store_n(&p->stop, 1, __ATOMIC_SEQ_CST);
    __atomic_add_fetch(&p->seq, 2, __ATOMIC_SEQ_CST);
    syscall(SYS_futex, &p->seq, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
    for (int i = 0; i < p->helpers; ++i) pthread_join(p->threads[i], NULL);
    free(p->states); free(p->scratch); free(p->input); free(p->inside); free(p->threads); free(p);
}

/* Wait until no helper is inside a job: after this, nothing the pool's tasks read is in use. */
void asyncllm_pool_quiesce(void *handle) {
    pool *p = handle;
    for (int i = 0; i < p->helpers; ++i)
        while (__atomic_load_n(&p->inside[i], __ATOMIC_ACQUIRE)) sched_yield();
}

void asyncllm_pool_hold(void *handle, int hold) { __atomic_store_n(&((pool *)handle)->hold, hold, __ATOMIC_RELEASE); }
int asyncllm_pool_inside(void *handle) {
    pool *p = handle;
    int inside = 0;
    for (int i = 0; i < p->helpers; ++i) inside += __atomic_load_n(&p->inside[i], __ATOMIC_ACQUIRE);
    return inside;
}
void *asyncllm_pool_input(void *handle) { return ((pool *)handle)->input; }
int64_t asyncllm_pool_input_bytes(void *handle) { return ((pool *)handle)->input_bytes; }
int64_t asyncllm_pool_stolen(void *handle) { return __atomic_load_n(&((pool *)handle)->stolen, __ATOMIC_RELAXED); }

int asyncllm_pool_run(void *handle, const pool_job *job) {
    pool *p = handle;
    if (job->tasks > p->max_tasks || job->scratch_bytes > p->scratch_bytes || job->context_bytes > POOL_CONTEXT_BYTES
        || job->tasks >= ((int64_t)1 << 31))
        return 0;
    unsigned char *scratch = p->scratch;
    const int helpers = job->threads - 1 < p->helpers ? (int)job->threads - 1 : p->helpers;
    if (helpers <= 0 || job->tasks <= 1) {  /* nothing to share: the caller alone, nothing published */
        for (int64_t task = 0; task < job->tasks; ++task)
            job->direct(job->context, task, task + 1 < job->tasks ? task + 1 : -1, scratch);
        return 1;
    }
    const int64_t start = now_ns();
    /* Publish: the sequence odd while the job is written, the claims counter reset to the new number. */
    uint32_t seq = __atomic_load_n(&p->seq, __ATOMIC_RELAXED);
    __atomic_store_n(&p->seq, seq + 1, __ATOMIC_SEQ_CST);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);  /* the job's bytes are written after the odd number, not before */
    memcpy(&p->job, job, sizeof p->job);
    p->job.threads = helpers + 1;
    seq += 2;
    __atomic_store_n(&p->claims, (uint64_t)seq << 32, __ATOMIC_SEQ_CST);
    __atomic_store_n(&p->seq, seq, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&p->sleepers, __ATOMIC_SEQ_CST)) {
        syscall(SYS_futex, &p->seq, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);  /* it cannot pick who */
        p->wakes += 1;
    }
    int64_t task = claim(p, seq, job->tasks), own = 0;
    while (task >= 0) {
        const int64_t next = claim(p, seq, job->tasks);
        job->direct(job->context, task, next, scratch);
        __atomic_store_n(&p->states[task], STATE(seq, DONE), __ATOMIC_RELEASE);
        task = next;
        ++own;
    }
    /* Every task is claimed. Wait for a helper's started task about two of the caller's tasks' time; take
       the rest (not started, or started and late) and compute them here. A task being committed is waited
       for (its copy is a small part of a task; a helper descheduled inside it is the one wait left). */
    const int64_t ended = now_ns(), patience = own ? 2 * (ended - start) / own : 20000;
    for (int64_t t = 0; t < job->tasks; ++t) {
        uint64_t state = __atomic_load_n(&p->states[t], __ATOMIC_ACQUIRE);
        while (state != STATE(seq, DONE)) {
            if (state == STATE(seq, COMMITTING) || (state == STATE(seq, STARTED) && now_ns() - ended < patience)) {
                _mm_pause();
                state = __atomic_load_n(&p->states[t], __ATOMIC_ACQUIRE);
                continue;
            }
            if (__atomic_compare_exchange_n(&p->states[t], &state, STATE(seq, TAKEN), 0, __ATOMIC_ACQ_REL,
                                            __ATOMIC_ACQUIRE)) {
                job->direct(job->context, t, -1, scratch);
                __atomic_store_n(&p->states[t], STATE(seq, DONE), __ATOMIC_RELEASE);
                state = STATE(seq, DONE);
                p->stolen += 1;
            }
        }
    }
    return 1;
}
"""
)

_SIGNATURES: native.Signatures = {
    "asyncllm_pool_create": ([I32, I64, I64, I64, I32], PTR),
    "asyncllm_pool_destroy": ([PTR], None),
    "asyncllm_pool_quiesce": ([PTR], None),
    "asyncllm_pool_input": ([PTR], PTR),
    "asyncllm_pool_input_bytes": ([PTR], I64),
    "asyncllm_pool_stolen": ([PTR], I64),
    "asyncllm_pool_run": ([PTR, PTR], I32),
    "asyncllm_pool_hold": ([PTR, I32], None),
    "asyncllm_pool_inside": ([PTR], I32),
}


@functools.cache
def _library() -> ctypes.CDLL | None:
    return native.load("kernel_pool", _SOURCE, _SIGNATURES, flags=("-pthread",))


def available() -> bool:
    """Whether the pool builds here (Linux: its helpers sleep on a futex)."""
    import sys

    return sys.platform.startswith("linux") and _library() is not None


class KernelPool:
    """A ``helpers``-thread pool for kernels that run on it (see the module docstring); ``close`` joins them.

    Args:
        helpers: Threads besides the caller's.
        max_tasks: The most tasks a job may have.
        scratch_bytes: Each participant's scratch, the most a task may need.
        input_bytes: The input buffer's size (``input``).
        spin: Spins a helper waits for the next job before it sleeps: pause instructions, and every 16th a
            ``sched_yield`` (another thread that wants the CPU gets it, rather than wait for the helper's slice).
    """

    def __init__(self, helpers: int, *, max_tasks: int, scratch_bytes: int, input_bytes: int, spin: int) -> None:
        library = _library()
        if library is None:
            raise RuntimeError("the kernel pool needs Linux and a C compiler")
        self._library = library
        self._lock = threading.Lock()
        self.helpers = helpers
        self.threads = helpers + 1
        """Threads a job runs on, the caller's included (at most ``helpers + 1``): the kernels read it at each
        call; the runner sets it to the step's compute thread count (the thread governor's)."""
        handle = library.asyncllm_pool_create(helpers, max_tasks, scratch_bytes, input_bytes, spin)
        if not handle:
            raise RuntimeError(f"could not start the kernel pool's {helpers} threads")
        self._handle: int | None = handle
        self.input_bytes = int(library.asyncllm_pool_input_bytes(handle))
        self.input = int(library.asyncllm_pool_input(handle))
        self.run = ctypes.cast(library.asyncllm_pool_run, ctypes.c_void_p).value

    @property
    def handle(self) -> int:
        """The pool's address for the kernels; RuntimeError once closed."""
        if self._handle is None:
            raise RuntimeError("the kernel pool is closed")
        return self._handle

    @property
    def stolen(self) -> int:
        """Tasks the caller has taken over from a late helper so far."""
        return int(self._library.asyncllm_pool_stolen(self.handle))

    def hold(self, held: bool) -> None:
        """For tests: while held, a helper that starts a task waits before computing it, as a helper another
        process descheduled would (so the caller takes the task over)."""
        self._library.asyncllm_pool_hold(self.handle, int(held))

    @property
    def helpers_inside(self) -> int:
        """Helpers inside a job now (0 once ``quiesce`` returns and no job runs)."""
        return int(self._library.asyncllm_pool_inside(self.handle))

    def quiesce(self) -> None:
        """Return once no helper is inside a job (before memory the tasks read is freed or moved)."""
        self._library.asyncllm_pool_quiesce(self.handle)

    def close(self) -> None:
        """Join the helpers and free the pool; idempotent."""
        with self._lock:
            handle, self._handle = self._handle, None
        if handle is not None:
            self._library.asyncllm_pool_destroy(handle)
