/* Tunnel setup, driven from C: the bench's load generator without Python's cost.
 *
 *   tunnels HOST PORT COUNT CONCURRENCY MAX_S [PROXY_HOST PROXY_PORT]
 *
 * Opens COUNT connections, CONCURRENCY at a time, each: connect (to the proxy,
 * CONNECT HOST:PORT, read the 200 head; or straight to HOST:PORT), send 64
 * bytes, read them back from the echo server, close. Prints one JSON object
 * like bench/load.py's "setup": tunnels, errors, rate, p50_ms, p99_ms, cpu_s
 * (this process's own CPU). Bounded by COUNT and by MAX_S seconds. Linux only
 * (epoll). Built by bench/run.py with the system compiler.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MESSAGE 64
#define HEAD_MAX 1024

enum state { CONNECTING, HEAD, ECHO };

struct conn {
    int fd;
    enum state state;
    double started;
    size_t got;
    char buf[HEAD_MAX];
};

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static struct sockaddr_in target, proxy;
static int via_proxy;
static char request[256];
static size_t request_len;
static const char message[MESSAGE + 1] = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

static int start(int ep, struct conn *c) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    struct sockaddr_in *to = via_proxy ? &proxy : &target;
    if (connect(fd, (struct sockaddr *)to, sizeof *to) < 0 && errno != EINPROGRESS) {
        close(fd);
        return -1;
    }
    c->fd = fd;
    c->state = CONNECTING;
    c->started = now();
    c->got = 0;
    struct epoll_event ev = {.events = EPOLLOUT, .data.ptr = c};
    return epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev);
}

static void watch(int ep, struct conn *c, unsigned events) {
    struct epoll_event ev = {.events = events, .data.ptr = c};
    epoll_ctl(ep, EPOLL_CTL_MOD, c->fd, &ev);
}

/* One step of a connection; 1 when it finished well, -1 when it failed, 0 when it goes on. */
static int step(int ep, struct conn *c) {
    ssize_t n;
    switch (c->state) {
    case CONNECTING: {
        int err = 0;
        socklen_t len = sizeof err;
        if (getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &len) < 0 || err) return -1;
        if (via_proxy) {
            if (send(c->fd, request, request_len, MSG_NOSIGNAL) != (ssize_t)request_len) return -1;
            c->state = HEAD;
        } else {
            if (send(c->fd, message, MESSAGE, MSG_NOSIGNAL) != MESSAGE) return -1;
            c->state = ECHO;
        }
        watch(ep, c, EPOLLIN);
        return 0;
    }
    case HEAD:
        n = recv(c->fd, c->buf + c->got, sizeof c->buf - 1 - c->got, 0);
        if (n <= 0) return n < 0 && errno == EAGAIN ? 0 : -1;
        c->got += n;
        c->buf[c->got] = 0;
        if (!strstr(c->buf, "\r\n\r\n")) return c->got < sizeof c->buf - 1 ? 0 : -1;
        if (strncmp(c->buf, "HTTP/1.1 200", 12) != 0 && strncmp(c->buf, "HTTP/1.0 200", 12) != 0) return -1;
        c->got = 0;
        if (send(c->fd, message, MESSAGE, MSG_NOSIGNAL) != MESSAGE) return -1;
        c->state = ECHO;
        return 0;
    case ECHO:
        n = recv(c->fd, c->buf, sizeof c->buf, 0);
        if (n <= 0) return n < 0 && errno == EAGAIN ? 0 : -1;
        c->got += n;
        return c->got >= MESSAGE ? 1 : 0;
    }
    return -1;
}

int main(int argc, char **argv) {
    if (argc != 6 && argc != 8) {
        fprintf(stderr, "usage: tunnels HOST PORT COUNT CONCURRENCY MAX_S [PROXY_HOST PROXY_PORT]\n");
        return 2;
    }
    target.sin_family = AF_INET;
    target.sin_port = htons(atoi(argv[2]));
    if (inet_pton(AF_INET, argv[1], &target.sin_addr) != 1) return 2;
    long count = atol(argv[3]), concurrency = atol(argv[4]);
    double max_s = atof(argv[5]);
    if (count <= 0 || concurrency <= 0 || concurrency > 4096) return 2;
    if (argc == 8) {
        via_proxy = 1;
        proxy.sin_family = AF_INET;
        proxy.sin_port = htons(atoi(argv[7]));
        if (inet_pton(AF_INET, argv[6], &proxy.sin_addr) != 1) return 2;
        request_len = snprintf(request, sizeof request, "CONNECT %s:%s HTTP/1.1\r\nHost: %s:%s\r\n\r\n",
                               argv[1], argv[2], argv[1], argv[2]);
    }
    double *latencies = calloc(count, sizeof *latencies);
    struct conn *conns = calloc(concurrency, sizeof *conns);
    int ep = epoll_create1(EPOLL_CLOEXEC);
    if (!latencies || !conns || ep < 0) return 1;
    long begun = 0, done = 0, errors = 0, open = 0;
    double began = now(), deadline = began + max_s;
    for (long i = 0; i < concurrency && begun < count; i++) {
        begun++;
        if (start(ep, &conns[i]) == 0) open++; else errors++;
    }
    struct epoll_event events[256];
    while (open > 0) {
        if (now() > deadline) break;
        int ready = epoll_wait(ep, events, 256, 1000);
        for (int i = 0; i < ready; i++) {
            struct conn *c = events[i].data.ptr;
            int r = step(ep, c);
            if (r == 0) continue;
            if (r == 1) latencies[done++] = now() - c->started; else errors++;
            epoll_ctl(ep, EPOLL_CTL_DEL, c->fd, NULL);
            close(c->fd);
            open--;
            while (begun < count && now() <= deadline) {
                begun++;
                if (start(ep, c) == 0) { open++; break; }
                errors++;
            }
        }
    }
    double seconds = now() - began;
    qsort(latencies, done, sizeof *latencies, cmp);
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    double cpu = ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + ru.ru_stime.tv_sec + ru.ru_stime.tv_usec / 1e6;
    printf("{\"tunnels\": %ld, \"errors\": %ld, \"rate\": %.3f, \"p50_ms\": %.4f, \"p99_ms\": %.4f, \"cpu_s\": %.4f}\n",
           done, errors, seconds > 0 ? done / seconds : 0.0, done ? latencies[done / 2] * 1000 : 0.0,
           done ? latencies[done - 1 < (long)(done * 0.99) ? done - 1 : (long)(done * 0.99)] * 1000 : 0.0, cpu);
    return 0;
}
