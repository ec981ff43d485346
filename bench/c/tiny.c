/*
 * Plain-C per-call latency baselines for tiny pulls (bench/bench_tiny.py, bench/README.md).
 *
 *   tiny readv --pid PID --seg ADDR:LEN [--seg ADDR:LEN ...]
 *       process_vm_readv of the given segments of process PID (one call, one iovec per
 *       segment on each side) into a local, huge-page-advised, touched buffer.
 *   tiny tcp --len LEN
 *       request/response over loopback TCP: a forked child listens on 127.0.0.1, and
 *       answers every 16-byte request with LEN bytes of its buffer; this process sends
 *       the request and receives the LEN bytes straight into its buffer. Blocking
 *       sockets, TCP_NODELAY on both ends, one connection set up before any timing.
 *
 * Both are servers driven over stdin / stdout (set up once, print "ready"):
 *   "run K"   -> K calls, timed one by one with CLOCK_MONOTONIC; one line with the K
 *                latencies in nanoseconds, separated by spaces;
 *   "zero"    -> clears the local buffer ("ok");
 *   "sum"     -> the checksum of the local buffer: sum over its 64-bit words w[i] of
 *                w[i] * (2i + 1), modulo 2^64, in decimal (the driver computes the same
 *                over the bytes it expects);
 *   EOF       -> exits (tcp: stops and reaps its child).
 * The tcp child fills its buffer with words i * 0x9E3779B97F4A7C15 + 1 (bench_tiny.py
 * knows the pattern). The timed loop does nothing but the calls.
 *
 * C11, Linux only.  Build: bench/build.sh (or built on demand by cbaselines.py).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_SEGS 64

static void die(const char *what) {
  fprintf(stderr, "tiny: %s: %s\n", what, strerror(errno));
  exit(2);
}

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Anonymous, 2 MiB-aligned when large enough, MADV_HUGEPAGE'd, touched: as the engine's. */
static char *alloc_buf(size_t n) {
  size_t len = (n + 4095) & ~(size_t)4095;
  void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) die("mmap");
#ifdef MADV_HUGEPAGE
  madvise(p, len, MADV_HUGEPAGE);
#endif
  memset(p, 0, len);
  return (char *)p;
}

static uint64_t checksum(const char *buf, size_t n) {
  uint64_t s = 0, w;
  for (size_t i = 0; i + 8 <= n; i += 8) {
    memcpy(&w, buf + i, 8);
    s += w * (2 * (uint64_t)(i / 8) + 1);
  }
  return s;
}

/* --------------------------------------------------------------- readv */

static pid_t g_pid;
static struct iovec g_remote[MAX_SEGS], g_local[MAX_SEGS];
static int g_nseg;
static size_t g_total;
static char *g_buf;

static void call_readv(void) {
  ssize_t got = process_vm_readv(g_pid, g_local, (unsigned long)g_nseg, g_remote,
                                 (unsigned long)g_nseg, 0);
  if (got != (ssize_t)g_total) {
    if (got < 0) die("process_vm_readv");
    fprintf(stderr, "tiny: process_vm_readv: short read %zd of %zu\n", got, g_total);
    exit(2);
  }
}

/* ----------------------------------------------------------------- tcp */

static int g_sock = -1;
static pid_t g_child = -1;

static void read_full(int fd, char *p, size_t n) {
  while (n) {
    ssize_t r = recv(fd, p, n, MSG_WAITALL);
    if (r <= 0) {
      if (r < 0 && errno == EINTR) continue;
      if (r == 0) errno = ECONNRESET;
      die("recv");
    }
    p += r;
    n -= (size_t)r;
  }
}

static int read_full_or_eof(int fd, char *p, size_t n) {
  while (n) {
    ssize_t r = recv(fd, p, n, MSG_WAITALL);
    if (r == 0) return 0;
    if (r < 0) {
      if (errno == EINTR) continue;
      return 0;
    }
    p += r;
    n -= (size_t)r;
  }
  return 1;
}

static void write_full(int fd, const char *p, size_t n) {
  while (n) {
    ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR) continue;
      die("send");
    }
    p += w;
    n -= (size_t)w;
  }
}

static void nodelay(int fd) {
  int one = 1;
  if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) < 0) die("TCP_NODELAY");
}

static void serve_tcp(int lfd, size_t len) {
  char *src = alloc_buf(len);
  for (size_t i = 0; i + 8 <= len; i += 8) {
    uint64_t w = (uint64_t)(i / 8) * 0x9E3779B97F4A7C15ull + 1;
    memcpy(src + i, &w, 8);
  }
  int fd = accept(lfd, NULL, NULL);
  if (fd < 0) die("accept");
  close(lfd);
  nodelay(fd);
  char req[16];
  while (read_full_or_eof(fd, req, sizeof req)) write_full(fd, src, len);
  _exit(0);
}

static void setup_tcp(size_t len) {
  int lfd = socket(AF_INET, SOCK_STREAM, 0);
  if (lfd < 0) die("socket");
  struct sockaddr_in a;
  memset(&a, 0, sizeof a);
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (bind(lfd, (struct sockaddr *)&a, sizeof a) < 0) die("bind");
  if (listen(lfd, 1) < 0) die("listen");
  socklen_t al = sizeof a;
  if (getsockname(lfd, (struct sockaddr *)&a, &al) < 0) die("getsockname");
  fflush(stdout);
  g_child = fork();
  if (g_child < 0) die("fork");
  if (g_child == 0) serve_tcp(lfd, len);
  close(lfd);
  g_sock = socket(AF_INET, SOCK_STREAM, 0);
  if (g_sock < 0) die("socket");
  if (connect(g_sock, (struct sockaddr *)&a, sizeof a) < 0) die("connect");
  nodelay(g_sock);
}

static uint64_t g_seq;

static void call_tcp(void) {
  uint64_t req[2] = {++g_seq, g_total};
  write_full(g_sock, (const char *)req, sizeof req);
  read_full(g_sock, g_buf, g_total);
}

/* ---------------------------------------------------------------- main */

static int usage(void) {
  fprintf(stderr,
          "usage: tiny readv --pid PID --seg ADDR:LEN [--seg ADDR:LEN ...]\n"
          "       tiny tcp --len LEN\n");
  return 2;
}

int main(int argc, char **argv) {
  if (argc < 2) return usage();
  int is_readv = strcmp(argv[1], "readv") == 0;
  if (!is_readv && strcmp(argv[1], "tcp") != 0) return usage();
  for (int i = 2; i < argc; i++) {
    if (i + 1 >= argc) return usage();
    if (strcmp(argv[i], "--pid") == 0) {
      g_pid = (pid_t)strtol(argv[++i], NULL, 0);
    } else if (strcmp(argv[i], "--seg") == 0) {
      char *end;
      if (g_nseg >= MAX_SEGS) return usage();
      g_remote[g_nseg].iov_base = (void *)(uintptr_t)strtoull(argv[++i], &end, 0);
      if (*end != ':') return usage();
      g_remote[g_nseg].iov_len = (size_t)strtoull(end + 1, NULL, 0);
      g_total += g_remote[g_nseg].iov_len;
      g_nseg++;
    } else if (strcmp(argv[i], "--len") == 0) {
      g_total = (size_t)strtoull(argv[++i], NULL, 0);
    } else {
      return usage();
    }
  }
  if (g_total == 0 || (is_readv && (g_pid <= 0 || g_nseg == 0))) return usage();
  g_buf = alloc_buf(g_total);
  if (is_readv) {
    size_t off = 0;
    for (int s = 0; s < g_nseg; s++) {
      g_local[s].iov_base = g_buf + off;
      g_local[s].iov_len = g_remote[s].iov_len;
      off += g_remote[s].iov_len;
    }
  } else {
    signal(SIGPIPE, SIG_IGN);
    setup_tcp(g_total);
  }
  void (*call)(void) = is_readv ? call_readv : call_tcp;
  call(); /* the connection / the mappings are warm before "ready" */
  printf("ready\n");
  fflush(stdout);

  char line[128];
  uint64_t *ns = NULL;
  size_t cap = 0;
  while (fgets(line, sizeof line, stdin)) {
    if (strncmp(line, "run ", 4) == 0) {
      size_t k = (size_t)strtoull(line + 4, NULL, 10);
      if (k > cap) {
        free(ns);
        cap = k;
        ns = malloc(cap * sizeof *ns);
        if (!ns) die("malloc");
      }
      for (size_t j = 0; j < k; j++) {
        uint64_t t0 = now_ns();
        call();
        ns[j] = now_ns() - t0;
      }
      for (size_t j = 0; j < k; j++) printf(j ? " %llu" : "%llu", (unsigned long long)ns[j]);
      printf("\n");
    } else if (strncmp(line, "zero", 4) == 0) {
      memset(g_buf, 0, g_total);
      printf("ok\n");
    } else if (strncmp(line, "sum", 3) == 0) {
      printf("%llu\n", (unsigned long long)checksum(g_buf, g_total));
    } else {
      printf("error unknown command\n");
    }
    fflush(stdout);
  }
  if (g_sock >= 0) {
    close(g_sock);
    int st;
    waitpid(g_child, &st, 0);
  }
  free(ns);
  return 0;
}
