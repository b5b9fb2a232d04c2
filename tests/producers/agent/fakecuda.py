"""Builds stand-in CUDA runtime and NCCL shared libraries with gcc, and a driver program that
calls them with known counts, delays and sizes — something real for uprobes to attach to.

The libraries export the real symbol names (``cudaLaunchKernel``, ``ncclAllReduce``, …) with the
real argument order for the arguments the agent reads (byte counts, NCCL datatypes), and are
named ``libcudart.so.12`` / ``libnccl.so.2`` so the agent discovers the driver process exactly
as it would discover a PyTorch process.

Driver protocol: ``driver ITEM...`` where ITEM is ``name:calls:delay_us:count:dtype[:rate]``;
it prints ``ready``, waits for a line on stdin, runs every item in its own thread (``rate`` calls
per second when given, else back to back), prints one ``stat NAME TOTAL_NS SLOT:COUNT...`` line
per item — the durations it measured around each call, whose log2 slots bound from above what
the probes can measure — then ``done``, and exits on the next line or EOF.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

CUDART_SRC = r"""
#include <stddef.h>
#include <unistd.h>
__thread unsigned fake_delay_us;
static volatile unsigned long calls;
#define BODY { calls++; if (fake_delay_us) usleep(fake_delay_us); return 0; }
int cudaLaunchKernel(const void *f, unsigned long g, unsigned long b, void **a, size_t s,
                     void *st) BODY
int cudaMemcpy(void *dst, const void *src, size_t count, int kind) BODY
int cudaMemcpyAsync(void *dst, const void *src, size_t count, int kind, void *st) BODY
int cudaMemset(void *dev, int value, size_t count) BODY
int cudaStreamSynchronize(void *st) BODY
int cudaDeviceSynchronize(void) BODY
"""

NCCL_SRC = r"""
#include <stddef.h>
#include <unistd.h>
extern __thread unsigned fake_delay_us;
static volatile unsigned long calls;
#define BODY { calls++; if (fake_delay_us) usleep(fake_delay_us); return 0; }
int ncclAllReduce(const void *s, void *r, size_t count, int dtype, int op, void *comm,
                  void *st) BODY
int ncclAllGather(const void *s, void *r, size_t count, int dtype, void *comm, void *st) BODY
int ncclReduceScatter(const void *s, void *r, size_t count, int dtype, int op, void *comm,
                      void *st) BODY
int ncclBroadcast(const void *s, void *r, size_t count, int dtype, int root, void *comm,
                  void *st) BODY
int ncclSend(const void *s, size_t count, int dtype, int peer, void *comm, void *st) BODY
int ncclRecv(void *r, size_t count, int dtype, int peer, void *comm, void *st) BODY
"""

DRIVER_SRC = r"""
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
extern __thread unsigned fake_delay_us;
int cudaLaunchKernel(const void *, unsigned long, unsigned long, void **, size_t, void *);
int cudaMemcpy(void *, const void *, size_t, int);
int cudaMemcpyAsync(void *, const void *, size_t, int, void *);
int cudaMemset(void *, int, size_t);
int cudaStreamSynchronize(void *);
int cudaDeviceSynchronize(void);
int ncclAllReduce(const void *, void *, size_t, int, int, void *, void *);
int ncclAllGather(const void *, void *, size_t, int, void *, void *);
int ncclReduceScatter(const void *, void *, size_t, int, int, void *, void *);
int ncclBroadcast(const void *, void *, size_t, int, int, void *, void *);
int ncclSend(const void *, size_t, int, int, void *, void *);
int ncclRecv(void *, size_t, int, int, void *, void *);

struct item {
    char name[64]; long calls; unsigned delay_us; size_t count; int dtype; long rate;
    unsigned long total_ns; unsigned long slots[64];  /* measured around each call */
};

static void call(const struct item *it) {
    const char *n = it->name;
    if (!strcmp(n, "cudaLaunchKernel")) cudaLaunchKernel(0, 1, 1, 0, 0, 0);
    else if (!strcmp(n, "cudaMemcpy")) cudaMemcpy(0, 0, it->count, 1);
    else if (!strcmp(n, "cudaMemcpyAsync")) cudaMemcpyAsync(0, 0, it->count, 1, 0);
    else if (!strcmp(n, "cudaMemset")) cudaMemset(0, 0, it->count);
    else if (!strcmp(n, "cudaStreamSynchronize")) cudaStreamSynchronize(0);
    else if (!strcmp(n, "cudaDeviceSynchronize")) cudaDeviceSynchronize();
    else if (!strcmp(n, "ncclAllReduce")) ncclAllReduce(0, 0, it->count, it->dtype, 0, 0, 0);
    else if (!strcmp(n, "ncclAllGather")) ncclAllGather(0, 0, it->count, it->dtype, 0, 0);
    else if (!strcmp(n, "ncclReduceScatter"))
        ncclReduceScatter(0, 0, it->count, it->dtype, 0, 0, 0);
    else if (!strcmp(n, "ncclBroadcast")) ncclBroadcast(0, 0, it->count, it->dtype, 0, 0, 0);
    else if (!strcmp(n, "ncclSend")) ncclSend(0, it->count, it->dtype, 1, 0, 0);
    else if (!strcmp(n, "ncclRecv")) ncclRecv(0, it->count, it->dtype, 1, 0, 0);
    else { fprintf(stderr, "unknown function %s\n", n); exit(2); }
}

static double now_s(void) {
    struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static unsigned long now_ns(void) {
    struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000UL + ts.tv_nsec;
}

/* One call, timed from outside: this interval contains the one the probes measure. */
static void timed_call(struct item *it) {
    unsigned long t0 = now_ns();
    call(it);
    unsigned long d = now_ns() - t0;
    it->total_ns += d;
    it->slots[d ? 63 - __builtin_clzl(d) : 0]++;
}

static void *run(void *arg) {
    struct item *it = arg;
    fake_delay_us = it->delay_us;
    if (it->rate <= 0) {
        for (long i = 0; i < it->calls; i++) timed_call(it);
        return 0;
    }
    /* Paced: every millisecond, catch up to rate * elapsed calls. */
    double start = now_s();
    long done = 0;
    while (done < it->calls) {
        long due = (long)((now_s() - start) * it->rate);
        if (due > it->calls) due = it->calls;
        for (; done < due; done++) call(it);  /* untimed: keep the paced loop cheap */
        struct timespec ms = {0, 1000000};
        nanosleep(&ms, 0);
    }
    return 0;
}

int main(int argc, char **argv) {
    int n = argc - 1;
    struct item *items = calloc(n > 0 ? n : 1, sizeof *items);
    pthread_t *threads = calloc(n > 0 ? n : 1, sizeof *threads);
    for (int i = 0; i < n; i++) {
        char *save, *tok = strtok_r(argv[i + 1], ":", &save);
        strncpy(items[i].name, tok, sizeof items[i].name - 1);
        items[i].calls = atol(strtok_r(0, ":", &save));
        items[i].delay_us = (unsigned)atol(strtok_r(0, ":", &save));
        items[i].count = (size_t)atol(strtok_r(0, ":", &save));
        items[i].dtype = atoi(strtok_r(0, ":", &save));
        tok = strtok_r(0, ":", &save);
        items[i].rate = tok ? atol(tok) : 0;
    }
    char line[64];
    printf("ready\n"); fflush(stdout);
    if (!fgets(line, sizeof line, stdin)) return 1;
    for (int i = 0; i < n; i++) pthread_create(&threads[i], 0, run, &items[i]);
    for (int i = 0; i < n; i++) pthread_join(threads[i], 0);
    for (int i = 0; i < n; i++) {
        printf("stat %s %lu", items[i].name, items[i].total_ns);
        for (int s = 0; s < 64; s++)
            if (items[i].slots[s]) printf(" %d:%lu", s, items[i].slots[s]);
        printf("\n");
    }
    printf("done\n"); fflush(stdout);
    fgets(line, sizeof line, stdin);
    return 0;
}
"""


@dataclass(frozen=True)
class FakeCuda:
    directory: Path
    cudart: Path
    nccl: Path
    driver: Path


def gcc_available() -> bool:
    return shutil.which("gcc") is not None


def build(directory: Path) -> FakeCuda:
    """Compile the two libraries and the driver into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    sources = {"cudart.c": CUDART_SRC, "nccl.c": NCCL_SRC, "driver.c": DRIVER_SRC}
    for name, text in sources.items():
        (directory / name).write_text(text)
    cudart = directory / "libcudart.so.12"
    nccl = directory / "libnccl.so.2"

    def gcc(*args: str) -> None:
        subprocess.run(["gcc", *args], check=True, cwd=directory, capture_output=True, text=True)

    gcc("-O2", "-fPIC", "-shared", f"-Wl,-soname,{cudart.name}", "-o", cudart.name, "cudart.c")
    gcc(
        "-O2",
        "-fPIC",
        "-shared",
        f"-Wl,-soname,{nccl.name}",
        "-o",
        nccl.name,
        "nccl.c",
        "-L.",
        f"-l:{cudart.name}",
    )
    gcc(
        "-O2",
        "-o",
        "driver",
        "driver.c",
        "-L.",
        f"-l:{cudart.name}",
        f"-l:{nccl.name}",
        "-Wl,-rpath,$ORIGIN",
        "-lpthread",
    )
    return FakeCuda(directory, cudart, nccl, directory / "driver")
