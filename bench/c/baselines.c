/*
 * Plain-C baselines for the aiodatadist movers (bench/README.md).
 *
 *   baselines memcpy [opts]   gather with memcpy, T threads, one process
 *   baselines cma    [opts]   a forked child holds the source; the parent gathers
 *                             with process_vm_readv (IOV_MAX iovecs per call), T threads
 *   baselines tcp    [opts]   a forked child writev's the segments over K loopback TCP
 *                             streams (blocking sockets, IOV_MAX iovecs per call); the
 *                             parent readv's them straight into the destination
 *
 * Layout (the llama8b-fp16 "64 random blocks, all layers" pull by default):
 * --tensors tensors of --pool blocks of --block-bytes bytes on each side; the pull
 * copies --blocks random source blocks to random destination blocks of every tensor,
 * tensor-major, in the same order and with the same run merging as Plan.blocks.
 * The block lists come from splitmix64(--seed), mirrored in bench/workloads.py.
 * Work is split among threads / streams into contiguous runs of equal bytes,
 * like the native split_even().
 *
 * Buffers are mmap'd, madvise(MADV_HUGEPAGE)'d (as numpy does; --no-huge to opt
 * out) and touched before timing; the destination is checked at the end.
 * memcpy --src-shm puts the source in a POSIX shared-memory segment instead
 * (shm_open + posix_fallocate + MAP_SHARED, not madvise'd: the memory of the
 * engine's allocated caches, whose huge pages depend on shmem_enabled).
 *
 * A run does 1 warm-up + --repeats timed transfers and prints one JSON line with
 * every sample and the median in GB/s (1e9 bytes/s).  With --serve it sets up,
 * prints "ready", then does one timed transfer per "run" line read on stdin and
 * answers with its seconds, so a driver (bench_movers.py) can alternate it with
 * the mover it compares; at EOF it prints the JSON line of every transfer.
 * --batch-bytes caps the bytes per system call of cma / tcp (default: none,
 * IOV_MAX iovecs per call).
 *
 * Built with -DBASELINES_LIB -shared (bin/libbaselines.so), the same gathers are
 * callable in-process (bl_memcpy, bl_cma_read, at the end of this file): the
 * driver uses them as a control that shares the mover's process and buffers.
 *
 * C11 + pthreads, Linux only.  Build: bench/build.sh
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <limits.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* ---------------------------------------------------------------- options */

typedef struct {
  const char *op;
  uint64_t tensors, pool, blocks, block_bytes, seed;
  int threads, streams, repeats, huge, serve;
  uint64_t batch_bytes; /* cma/tcp: cap on bytes per system call (0: IOV_MAX iovecs only) */
  int src_shm;          /* memcpy: the source in POSIX shared memory */
} opts_t;

static opts_t O = {NULL, 64, 64, 64, 256 * 1024, 20240601, 2, 1, 7, 1, 0, 0, 0};

static void die(const char *what) {
  fprintf(stderr, "baselines: %s: %s\n", what, strerror(errno));
  exit(2);
}

static void usage(void) {
  fprintf(stderr,
          "usage: baselines {memcpy|cma|tcp} [--tensors N] [--pool N] [--blocks N]\n"
          "                 [--block-bytes N] [--seed N] [--threads T] [--streams K]\n"
          "                 [--repeats R] [--batch-bytes N] [--no-huge] [--src-shm] [--serve]\n");
  exit(2);
}

static void parse(int argc, char **argv) {
  if (argc < 2) usage();
  O.op = argv[1];
  for (int i = 2; i < argc; ++i) {
    const char *a = argv[i];
    if (!strcmp(a, "--no-huge")) {
      O.huge = 0;
      continue;
    }
    if (!strcmp(a, "--serve")) {
      O.serve = 1;
      continue;
    }
    if (!strcmp(a, "--src-shm")) {
      O.src_shm = 1;
      continue;
    }
    if (i + 1 >= argc) usage();
    unsigned long long v = strtoull(argv[++i], NULL, 0);
    if (!strcmp(a, "--tensors")) O.tensors = v;
    else if (!strcmp(a, "--pool")) O.pool = v;
    else if (!strcmp(a, "--blocks")) O.blocks = v;
    else if (!strcmp(a, "--block-bytes")) O.block_bytes = v;
    else if (!strcmp(a, "--seed")) O.seed = v;
    else if (!strcmp(a, "--threads")) O.threads = (int)v;
    else if (!strcmp(a, "--streams")) O.streams = (int)v;
    else if (!strcmp(a, "--repeats")) O.repeats = (int)v;
    else if (!strcmp(a, "--batch-bytes")) O.batch_bytes = v;
    else usage();
  }
  if (!O.tensors || !O.pool || !O.blocks || O.blocks > O.pool || !O.block_bytes || O.threads < 1 ||
      O.streams < 1 || O.repeats < 1)
    usage();
}

/* ------------------------------------------------- blocks (see workloads.py) */

static uint64_t sm_state;
static uint64_t sm_next(void) {
  uint64_t z = (sm_state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static void pick(uint64_t pool, uint64_t count, uint64_t *out) {
  uint64_t *a = malloc(pool * sizeof *a);
  if (!a) die("malloc");
  for (;;) {
    for (uint64_t i = 0; i < pool; ++i) a[i] = i;
    for (uint64_t i = 0; i < count; ++i) {
      uint64_t j = i + sm_next() % (pool - i);
      uint64_t t = a[i];
      a[i] = a[j];
      a[j] = t;
    }
    int contiguous = 0;
    for (uint64_t i = 0; i + 1 < count; ++i)
      if (a[i + 1] == a[i] + 1) contiguous = 1;
    if (count == 1 || pool < 3 || !contiguous) break;
  }
  memcpy(out, a, count * sizeof *a);
  free(a);
}

static uint64_t fnv_u64(uint64_t h, uint64_t v) {
  for (int k = 0; k < 8; ++k) {
    h ^= (v >> (8 * k)) & 0xff;
    h *= 0x100000001B3ull;
  }
  return h;
}

/* --------------------------------------------------------------- segments */

typedef struct {
  uint64_t src, dst, n; /* offsets into the src / dst buffers (or addresses) */
} seg_t;

typedef struct {
  seg_t *v;
  size_t n;
} segs_t;

static uint64_t *g_sb, *g_db, g_hash, g_total;
static segs_t g_segs;

static void build_segments(void) {
  g_sb = malloc(O.blocks * sizeof *g_sb);
  g_db = malloc(O.blocks * sizeof *g_db);
  if (!g_sb || !g_db) die("malloc");
  sm_state = O.seed;
  pick(O.pool, O.blocks, g_sb);
  pick(O.pool, O.blocks, g_db);
  g_hash = 0xCBF29CE484222325ull;
  for (uint64_t i = 0; i < O.blocks; ++i) g_hash = fnv_u64(fnv_u64(g_hash, g_sb[i]), g_db[i]);
  const uint64_t bb = O.block_bytes, tb = O.pool * bb;
  g_segs.v = malloc(O.tensors * O.blocks * sizeof(seg_t));
  if (!g_segs.v) die("malloc");
  g_segs.n = 0;
  for (uint64_t t = 0; t < O.tensors; ++t)
    for (uint64_t i = 0; i < O.blocks; ++i) {
      uint64_t s = t * tb + g_sb[i] * bb, d = t * tb + g_db[i] * bb;
      seg_t *last = g_segs.n ? &g_segs.v[g_segs.n - 1] : NULL;
      /* merge like Plan.blocks (never across tensors) */
      if (last && i > 0 && last->src + last->n == s && last->dst + last->n == d) {
        last->n += bb;
      } else {
        g_segs.v[g_segs.n++] = (seg_t){s, d, bb};
      }
    }
  g_total = O.tensors * O.blocks * bb;
}

/* split into `parts` contiguous runs of (almost) equal bytes, cutting segments */
static segs_t *split_even(const segs_t *all, uint64_t total, int parts) {
  segs_t *out = calloc((size_t)parts, sizeof *out);
  if (!out) die("calloc");
  size_t idx = 0;
  uint64_t used = 0;
  for (int p = 0; p < parts; ++p) {
    out[p].v = malloc((all->n + 1) * sizeof(seg_t));
    if (!out[p].v) die("malloc");
    uint64_t want = total / (uint64_t)parts + ((uint64_t)p < total % (uint64_t)parts ? 1 : 0);
    while (want > 0 && idx < all->n) {
      const seg_t *s = &all->v[idx];
      uint64_t take = s->n - used < want ? s->n - used : want;
      out[p].v[out[p].n++] = (seg_t){s->src + used, s->dst + used, take};
      want -= take;
      used += take;
      if (used == s->n) {
        ++idx;
        used = 0;
      }
    }
  }
  return out;
}

/* ------------------------------------------------------------ memory, time */

static uint64_t buf_bytes(void) { return O.tensors * O.pool * O.block_bytes; }

static char *alloc_buf(uint64_t n) {
  void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) die("mmap");
  madvise(p, n, O.huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
  return p;
}

/* A POSIX shared-memory segment, as the engine allocates one (ext/shm.cpp):
 * shm_open, posix_fallocate, MAP_SHARED; unlinked at once (the mapping stays). */
static char *alloc_shm(uint64_t n) {
  char name[64];
  snprintf(name, sizeof name, "/aiodd-baselines-%d", (int)getpid());
  int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) die("shm_open");
  shm_unlink(name);
  int rc = ftruncate(fd, (off_t)n) ? errno : posix_fallocate(fd, 0, (off_t)n);
  if (rc) {
    errno = rc;
    die("allocating shared memory");
  }
  void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) die("mmap");
  close(fd);
  return p;
}

/* Source block b of tensor t: every 8-byte word holds its tag (t << 32 | b) + 1. */
static void fill_src(char *src) {
  const uint64_t bb = O.block_bytes;
  for (uint64_t t = 0; t < O.tensors; ++t)
    for (uint64_t b = 0; b < O.pool; ++b) {
      uint64_t tag = ((t << 32) | b) + 1, *w = (uint64_t *)(src + (t * O.pool + b) * bb);
      for (uint64_t k = 0; k < bb / 8; ++k) w[k] = tag;
    }
}

static int check_dst(const char *dst) {
  const uint64_t bb = O.block_bytes;
  for (uint64_t t = 0; t < O.tensors; ++t)
    for (uint64_t i = 0; i < O.blocks; ++i) {
      uint64_t tag = ((t << 32) | g_sb[i]) + 1;
      const char *blk = dst + (t * O.pool + g_db[i]) * bb;
      uint64_t first, last;
      memcpy(&first, blk, 8);
      memcpy(&last, blk + bb - 8, 8);
      if (first != tag || last != tag) return 0;
    }
  return 1;
}

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static void report(const char *op, int par, const char *par_name, const double *secs, int n, int verified) {
  double *gbps = malloc((size_t)(n ? n : 1) * sizeof *gbps), *sorted = malloc((size_t)(n ? n : 1) * sizeof *sorted);
  if (!gbps || !sorted) die("malloc");
  for (int i = 0; i < n; ++i) sorted[i] = gbps[i] = (double)g_total / secs[i] / 1e9;
  qsort(sorted, (size_t)n, sizeof *sorted, cmp_double);
  double med = n == 0 ? 0 : n % 2 ? sorted[n / 2] : (sorted[n / 2 - 1] + sorted[n / 2]) / 2;
  printf("{\"op\": \"%s\", \"%s\": %d, \"bytes\": %llu, \"segments\": %zu, \"blocks_hash\": \"%016llx\", "
         "\"runs\": %d, \"huge\": %s, \"src_shm\": %s, \"verified\": %s, \"median_gbps\": %.4f, "
         "\"samples_gbps\": [",
         op, par_name, par, (unsigned long long)g_total, g_segs.n, (unsigned long long)g_hash, n,
         O.huge ? "true" : "false", O.src_shm ? "true" : "false", verified ? "true" : "false", med);
  for (int i = 0; i < n; ++i) printf("%s%.4f", i ? ", " : "", gbps[i]);
  printf("]}\n");
  fflush(stdout);
  free(gbps);
  free(sorted);
}

/* ------------------------------------------------------------------ memcpy */

typedef struct {
  const segs_t *segs;
  uintptr_t src, dst; /* bases the segment offsets add to (0: offsets are addresses) */
  pid_t pid;
  int fd;
  int err;
} job_t;

static void *memcpy_worker(void *arg) {
  job_t *j = arg;
  for (size_t i = 0; i < j->segs->n; ++i) {
    const seg_t *s = &j->segs->v[i];
    memcpy((void *)(j->dst + s->dst), (const void *)(j->src + s->src), s->n);
  }
  return NULL;
}

/* runs fn on `n` threads (the caller takes job 0) */
static void run_threads(int n, void *(*fn)(void *), job_t *jobs) {
  pthread_t th[64];
  for (int i = 1; i < n; ++i)
    if (pthread_create(&th[i], NULL, fn, &jobs[i])) die("pthread_create");
  fn(&jobs[0]);
  for (int i = 1; i < n; ++i) pthread_join(th[i], NULL);
  for (int i = 0; i < n; ++i)
    if (jobs[i].err) {
      errno = jobs[i].err;
      die("worker");
    }
}

/* One op = setup (allocate, fill, fork peers), run_once (one timed transfer,
 * returns seconds), finish (stop peers, check the destination). */
static char *g_dst;
static job_t g_jobs[64];
static int g_par; /* threads or streams */

static void setup_memcpy(void) {
  uint64_t n = buf_bytes();
  char *src = O.src_shm ? alloc_shm(n) : alloc_buf(n);
  g_dst = alloc_buf(n);
  fill_src(src);
  memset(g_dst, 0, n);
  segs_t *parts = split_even(&g_segs, g_total, O.threads);
  for (int i = 0; i < O.threads; ++i) g_jobs[i] = (job_t){&parts[i], (uintptr_t)src, (uintptr_t)g_dst, 0, -1, 0};
}

static double run_memcpy(void) {
  double t0 = now();
  run_threads(O.threads, memcpy_worker, g_jobs);
  return now() - t0;
}

/* --------------------------------------------------------------------- cma */

static void *cma_worker(void *arg) {
  job_t *j = arg;
  const size_t max_iov = (size_t)(sysconf(_SC_IOV_MAX) > 0 ? sysconf(_SC_IOV_MAX) : IOV_MAX);
  struct iovec *l = malloc(max_iov * sizeof *l), *r = malloc(max_iov * sizeof *r);
  if (!l || !r) die("malloc");
  size_t i = 0;
  while (i < j->segs->n) {
    size_t k = 0;
    uint64_t batch = 0;
    for (; k < max_iov && i + k < j->segs->n && (!O.batch_bytes || batch < O.batch_bytes); ++k) {
      const seg_t *s = &j->segs->v[i + k];
      l[k] = (struct iovec){(void *)(j->dst + s->dst), s->n};
      r[k] = (struct iovec){(void *)(j->src + s->src), s->n};
      batch += s->n;
    }
    size_t first = 0;
    while (batch > 0) {
      ssize_t got = process_vm_readv(j->pid, l + first, k - first, r + first, k - first, 0);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) {
        j->err = got < 0 ? errno : EFAULT;
        goto out;
      }
      batch -= (uint64_t)got;
      while (got > 0) { /* partial: move the window */
        if ((size_t)got >= l[first].iov_len) {
          got -= (ssize_t)l[first].iov_len;
          ++first;
        } else {
          l[first].iov_base = (char *)l[first].iov_base + got;
          r[first].iov_base = (char *)r[first].iov_base + got;
          l[first].iov_len -= (size_t)got;
          r[first].iov_len -= (size_t)got;
          got = 0;
        }
      }
    }
    i += k;
  }
out:
  free(l);
  free(r);
  return NULL;
}

static pid_t g_child = -1;
static int g_go = -1, g_done = -1; /* pipes to / from the child */

static void setup_cma(void) {
  uint64_t n = buf_bytes();
  int up[2], down[2]; /* child -> parent: source address; parent -> child: EOF = exit */
  if (pipe(up) || pipe(down)) die("pipe");
  fflush(stdout);
  pid_t pid = fork();
  if (pid < 0) die("fork");
  if (pid == 0) {
    close(up[0]);
    close(down[1]);
    char *src = alloc_buf(n);
    fill_src(src);
    uintptr_t a = (uintptr_t)src;
    if (write(up[1], &a, sizeof a) != sizeof a) _exit(3);
    char c;
    while (read(down[0], &c, 1) > 0) {
    }
    _exit(0);
  }
  close(up[1]);
  close(down[0]);
  g_child = pid;
  g_go = down[1];
  g_dst = alloc_buf(n);
  memset(g_dst, 0, n);
  uintptr_t a;
  if (read(up[0], &a, sizeof a) != sizeof a) die("child did not start");
  close(up[0]);
  segs_t *parts = split_even(&g_segs, g_total, O.threads);
  for (int i = 0; i < O.threads; ++i) g_jobs[i] = (job_t){&parts[i], a, (uintptr_t)g_dst, pid, -1, 0};
}

static double run_cma(void) {
  double t0 = now();
  run_threads(O.threads, cma_worker, g_jobs);
  return now() - t0;
}

/* --------------------------------------------------------------------- tcp */

/* writev (send) or readv (recv) a part on a blocking socket, IOV_MAX iovecs per call */
static void *sock_worker(void *arg, int send) {
  job_t *j = arg;
  const size_t max_iov = (size_t)(sysconf(_SC_IOV_MAX) > 0 ? sysconf(_SC_IOV_MAX) : IOV_MAX);
  struct iovec *v = malloc(max_iov * sizeof *v);
  if (!v) die("malloc");
  size_t i = 0;
  while (i < j->segs->n) {
    size_t k = 0;
    uint64_t batch = 0;
    for (; k < max_iov && i + k < j->segs->n && (!O.batch_bytes || batch < O.batch_bytes); ++k) {
      const seg_t *s = &j->segs->v[i + k];
      v[k] = (struct iovec){(void *)(send ? j->src + s->src : j->dst + s->dst), s->n};
      batch += s->n;
    }
    size_t first = 0;
    while (batch > 0) {
      ssize_t got = send ? writev(j->fd, v + first, (int)(k - first)) : readv(j->fd, v + first, (int)(k - first));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) {
        j->err = got < 0 ? errno : ECONNRESET;
        goto out;
      }
      batch -= (uint64_t)got;
      while (got > 0) {
        if ((size_t)got >= v[first].iov_len) {
          got -= (ssize_t)v[first].iov_len;
          ++first;
        } else {
          v[first].iov_base = (char *)v[first].iov_base + got;
          v[first].iov_len -= (size_t)got;
          got = 0;
        }
      }
    }
    i += k;
  }
out:
  free(v);
  return NULL;
}
static void *send_worker(void *arg) { return sock_worker(arg, 1); }
static void *recv_worker(void *arg) { return sock_worker(arg, 0); }

static void setup_tcp(void) {
  uint64_t n = buf_bytes();
  int K = O.streams;
  if (K > 64) usage();
  int lfd = socket(AF_INET, SOCK_STREAM, 0);
  if (lfd < 0) die("socket");
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK), .sin_port = 0};
  socklen_t sl = sizeof sa;
  if (bind(lfd, (struct sockaddr *)&sa, sizeof sa) || listen(lfd, 64) || getsockname(lfd, (struct sockaddr *)&sa, &sl))
    die("listen");
  int go[2], done[2]; /* parent -> child: one byte per transfer (EOF = exit); child -> parent: ready/done */
  if (pipe(go) || pipe(done)) die("pipe");
  segs_t *parts = split_even(&g_segs, g_total, K);
  fflush(stdout);
  pid_t pid = fork();
  if (pid < 0) die("fork");
  if (pid == 0) { /* the serving side: holds the source, writev's */
    close(go[1]);
    close(done[0]);
    close(lfd);
    char *src = alloc_buf(n);
    fill_src(src);
    job_t jobs[64];
    for (int i = 0; i < K; ++i) {
      int fd = socket(AF_INET, SOCK_STREAM, 0);
      if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof sa)) die("connect");
      int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      unsigned char idx = (unsigned char)i;
      if (write(fd, &idx, 1) != 1) die("write");
      jobs[i] = (job_t){&parts[i], (uintptr_t)src, 0, 0, fd, 0};
    }
    char c = 'r';
    if (write(done[1], &c, 1) != 1) _exit(3);
    while (read(go[0], &c, 1) == 1) {
      for (int i = 0; i < K; ++i) jobs[i].err = 0;
      run_threads(K, send_worker, jobs);
      if (write(done[1], &c, 1) != 1) _exit(3);
    }
    _exit(0);
  }
  close(go[0]);
  close(done[1]);
  g_child = pid;
  g_go = go[1];
  g_done = done[0];
  g_dst = alloc_buf(n);
  memset(g_dst, 0, n);
  for (int i = 0; i < K; ++i) {
    int fd = accept(lfd, NULL, NULL);
    if (fd < 0) die("accept");
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    unsigned char idx;
    if (read(fd, &idx, 1) != 1 || idx >= K) die("stream index");
    g_jobs[idx] = (job_t){&parts[idx], 0, (uintptr_t)g_dst, 0, fd, 0};
  }
  close(lfd);
  char c;
  if (read(g_done, &c, 1) != 1) die("child did not start");
}

static double run_tcp(void) {
  char c = 'g';
  for (int i = 0; i < O.streams; ++i) g_jobs[i].err = 0;
  double t0 = now();
  if (write(g_go, &c, 1) != 1) die("go");
  run_threads(O.streams, recv_worker, g_jobs);
  double dt = now() - t0;
  if (read(g_done, &c, 1) != 1) die("child failed");
  return dt;
}

static int finish(void) {
  int ok = check_dst(g_dst);
  if (g_go >= 0) close(g_go);
  if (g_child > 0) waitpid(g_child, NULL, 0);
  return ok;
}

/* ---------------------------------------------- in-process entry points
 * Built into bin/libbaselines.so (-DBASELINES_LIB) so that a driver can run the
 * same gather on its own buffers, in its own process: segments are absolute
 * addresses (src[i], dst[i], len[i]).  Return 0 or an errno. */
static int run_absolute(const uint64_t *src, const uint64_t *dst, const uint64_t *len, size_t n, int threads,
                        int pid, uint64_t batch_bytes) {
  if (threads < 1 || threads > 64) return EINVAL;
  segs_t all = {malloc((n ? n : 1) * sizeof(seg_t)), n};
  if (!all.v) return ENOMEM;
  uint64_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    all.v[i] = (seg_t){src[i], dst[i], len[i]};
    total += len[i];
  }
  O.batch_bytes = batch_bytes;
  segs_t *parts = split_even(&all, total, threads);
  job_t jobs[64];
  for (int i = 0; i < threads; ++i) jobs[i] = (job_t){&parts[i], 0, 0, pid, -1, 0};
  int err = 0;
  pthread_t th[64];
  void *(*fn)(void *) = pid ? cma_worker : memcpy_worker;
  for (int i = 1; i < threads; ++i)
    if (pthread_create(&th[i], NULL, fn, &jobs[i])) jobs[i].err = EAGAIN;
  fn(&jobs[0]);
  for (int i = 1; i < threads; ++i)
    if (jobs[i].err != EAGAIN) pthread_join(th[i], NULL);
  for (int i = 0; i < threads; ++i) {
    if (jobs[i].err && !err) err = jobs[i].err;
    free(parts[i].v);
  }
  free(parts);
  free(all.v);
  return err;
}

int bl_memcpy(const uint64_t *src, const uint64_t *dst, const uint64_t *len, size_t n, int threads) {
  return run_absolute(src, dst, len, n, threads, 0, 0);
}

int bl_cma_read(int pid, const uint64_t *remote_src, const uint64_t *local_dst, const uint64_t *len, size_t n,
                int threads, uint64_t batch_bytes) {
  return pid > 0 ? run_absolute(remote_src, local_dst, len, n, threads, pid, batch_bytes) : EINVAL;
}

#ifndef BASELINES_LIB
int main(int argc, char **argv) {
  parse(argc, argv);
  if (O.threads > 64 || (O.src_shm && strcmp(O.op, "memcpy"))) usage();
  signal(SIGPIPE, SIG_IGN);
  build_segments();
  void (*setup)(void);
  double (*run_once)(void);
  const char *par_name = "threads";
  g_par = O.threads;
  if (!strcmp(O.op, "memcpy")) {
    setup = setup_memcpy;
    run_once = run_memcpy;
  } else if (!strcmp(O.op, "cma")) {
    setup = setup_cma;
    run_once = run_cma;
  } else if (!strcmp(O.op, "tcp")) {
    setup = setup_tcp;
    run_once = run_tcp;
    par_name = "streams";
    g_par = O.streams;
  } else {
    usage();
    return 2;
  }
  setup();
  if (!O.serve) { /* 1 warm-up + R timed runs, then the summary */
    double *secs = malloc((size_t)O.repeats * sizeof *secs);
    if (!secs) die("malloc");
    run_once();
    for (int r = 0; r < O.repeats; ++r) secs[r] = run_once();
    report(O.op, g_par, par_name, secs, O.repeats, finish());
    return 0;
  }
  /* --serve: a driver interleaves our runs with its own. One "run" line on stdin =
   * one transfer, answered with its seconds; at EOF the summary of every run. */
  size_t cap = 64, n = 0;
  double *secs = malloc(cap * sizeof *secs);
  if (!secs) die("malloc");
  printf("ready\n");
  fflush(stdout);
  char line[64];
  while (fgets(line, sizeof line, stdin) && !strncmp(line, "run", 3)) {
    if (n == cap && !(secs = realloc(secs, (cap *= 2) * sizeof *secs))) die("realloc");
    secs[n] = run_once();
    printf("%.9f\n", secs[n++]);
    fflush(stdout);
  }
  report(O.op, g_par, par_name, secs, (int)n, finish());
  return 0;
}
#endif /* BASELINES_LIB */
