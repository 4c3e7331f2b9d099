/* An echo server in C for the tunnel-setup bench: every byte a connection sends comes back.
 *
 *   echo HOST PORT      (prints "listening PORT" once bound; PORT 0: the kernel's choice)
 *
 * One process, epoll, non-blocking; a connection that cannot take its echo at
 * once is closed (the bench's 64-byte messages never fill a socket buffer).
 * Runs until killed. Built by bench/run.py with the system compiler.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: echo HOST PORT\n");
        return 2;
    }
    struct sockaddr_in at = {.sin_family = AF_INET, .sin_port = htons(atoi(argv[2]))};
    if (inet_pton(AF_INET, argv[1], &at.sin_addr) != 1) return 2;
    int listener = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    int one = 1;
    setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (listener < 0 || bind(listener, (struct sockaddr *)&at, sizeof at) < 0 || listen(listener, 4096) < 0) {
        perror("echo");
        return 1;
    }
    socklen_t len = sizeof at;
    getsockname(listener, (struct sockaddr *)&at, &len);
    printf("listening %d\n", ntohs(at.sin_port));
    fflush(stdout);
    int ep = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = listener};
    epoll_ctl(ep, EPOLL_CTL_ADD, listener, &ev);
    struct epoll_event events[256];
    char buf[65536];
    for (;;) {
        int ready = epoll_wait(ep, events, 256, -1);
        for (int i = 0; i < ready; i++) {
            int fd = events[i].data.fd;
            if (fd == listener) {
                int c;
                while ((c = accept4(listener, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC)) >= 0) {
                    struct epoll_event cev = {.events = EPOLLIN, .data.fd = c};
                    epoll_ctl(ep, EPOLL_CTL_ADD, c, &cev);
                }
                continue;
            }
            ssize_t n = recv(fd, buf, sizeof buf, 0);
            if (n > 0 && send(fd, buf, n, MSG_NOSIGNAL) == n) continue;
            if (n < 0 && errno == EAGAIN) continue;  /* a spurious wake */
            close(fd);  /* EOF, an error, or an echo the socket could not take at once */
        }
    }
}
