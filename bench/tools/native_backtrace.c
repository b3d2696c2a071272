// Prints the native stack of a thread that crashes (SIGSEGV, SIGBUS, SIGILL, SIGFPE) to stderr, then lets the
// signal kill the process as before. Python's faulthandler prints the Python stacks of every thread and then
// re-raises the signal to the handler it replaced: preloaded, this library is that handler, so a crash's report holds
// both. Each frame is a library and an offset ("libfoo.so(+0x1234)"), or a bare address for JIT-compiled code.
//
//   gcc -O1 -shared -fPIC -o /tmp/native_backtrace.so bench/tools/native_backtrace.c
//   LD_PRELOAD=/tmp/native_backtrace.so PYTHONFAULTHANDLER=1 python3 ...
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

static void report(int sig, siginfo_t *info, void *context) {
  (void)context;
  char line[160];
  int n = snprintf(line, sizeof line, "\nnative backtrace: signal %d, address %p, thread %ld\n", sig, info->si_addr,
                   (long)syscall(SYS_gettid));
  if (write(2, line, (size_t)n) < 0) return;
  void *frames[64];
  backtrace_symbols_fd(frames, backtrace(frames, 64), 2);
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void install(void) {
  void *warm[1];
  backtrace(warm, 1);  // loads the unwinder now: not inside the handler
  struct sigaction action;
  memset(&action, 0, sizeof action);
  action.sa_sigaction = report;
  action.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigemptyset(&action.sa_mask);
  int signals[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE};
  for (unsigned i = 0; i < sizeof signals / sizeof *signals; i++) sigaction(signals[i], &action, NULL);
}
