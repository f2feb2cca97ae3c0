/* Loopback TCP throughput by congestion control and send path: SIZE MiB of THP-backed anonymous
 * memory to a reader thread over 127.0.0.1, 4 MiB at a time, by plain write (mode 0) or by
 * vmsplice + splice (mode 1, kumo's path to a local peer). CC names the sender's congestion
 * control (TCP_CONGESTION; default: the host's).
 *
 *   gcc -O2 -o /tmp/loopback-pacing scripts/loopback-pacing.c -lpthread
 *   for cc in bbr reno; do for m in 0 1; do CC=$cc /tmp/loopback-pacing 2048 $m; done; done
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

static size_t SZ, CH = 4 << 20;
static int lfd;
static char *dst;

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec / 1e9; }

static void *rx(void *a) {
    (void)a;
    int c = accept(lfd, 0, 0);
    for (size_t got = 0; got < SZ;) {
        ssize_t n = read(c, dst + got, SZ - got > CH ? CH : SZ - got);
        if (n <= 0) { perror("read"); exit(1); }
        got += n;
    }
    close(c);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 3) { fprintf(stderr, "usage: %s SIZE_MIB MODE(0 write, 1 splice)\n", argv[0]); return 2; }
    SZ = (size_t)atol(argv[1]) << 20;
    int mode = atoi(argv[2]);
    char *src = mmap(0, SZ, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    dst = mmap(0, SZ, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    madvise(src, SZ, MADV_HUGEPAGE); madvise(dst, SZ, MADV_HUGEPAGE);
    for (size_t i = 0; i < SZ; i += 4096) { src[i] = 1; src[i + 100] = (char)i; }
    memset(dst, 0, SZ);
    lfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(0x7f000001)};
    socklen_t l = sizeof a;
    bind(lfd, (void *)&a, sizeof a); listen(lfd, 1); getsockname(lfd, (void *)&a, &l);
    int s = socket(AF_INET, SOCK_STREAM, 0);
    const char *cc = getenv("CC");
    if (cc && setsockopt(s, IPPROTO_TCP, TCP_CONGESTION, cc, strlen(cc))) { perror("TCP_CONGESTION"); return 1; }
    connect(s, (void *)&a, sizeof a);
    pthread_t t; pthread_create(&t, 0, rx, 0);
    int p[2]; pipe(p); fcntl(p[1], F_SETPIPE_SZ, 1 << 20);
    double t0 = now();
    for (size_t off = 0; off < SZ; off += CH) {
        size_t n = SZ - off > CH ? CH : SZ - off;
        for (size_t w = 0; w < n;) {
            ssize_t r;
            if (mode == 0) {
                r = write(s, src + off + w, n - w);
            } else {
                struct iovec iv = {src + off + w, n - w};
                r = vmsplice(p[1], &iv, 1, 0);
                for (ssize_t left = r; left > 0;) {
                    ssize_t m = splice(p[0], 0, s, 0, left, SPLICE_F_MOVE | SPLICE_F_MORE);
                    if (m <= 0) { perror("splice"); return 1; }
                    left -= m;
                }
            }
            if (r <= 0) { perror("send"); return 1; }
            w += r;
        }
    }
    shutdown(s, SHUT_WR); pthread_join(t, 0);
    printf("cc=%s mode=%s %.0f MB/s\n", cc ? cc : "host", mode ? "splice" : "write", SZ / (now() - t0) / 1e6);
    return 0;
}
