// Names the code behind a process's large host allocations: each malloc/calloc/realloc/aligned allocation and each
// anonymous mmap of LARGE_ALLOC_MIB (default 256) MiB or more prints its size, address and thread to stderr, with the
// native stack (a library and an offset a frame) and the Python stack of the thread, if it has one. A free or munmap
// of such a block prints its address. Matched with the ranges that bench/tools/run_timed.py reads at the resident
// set's peak, this says which allocation an unexplained anonymous mapping is.
//
//   gcc -O1 -shared -fPIC -o /tmp/large_alloc_trace.so bench/tools/large_alloc_trace.c -ldl
//   LD_PRELOAD=/tmp/large_alloc_trace.so python3 -m train.gpt ...
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);
extern void __libc_free(void *);

static size_t threshold = (size_t)256 << 20;
static __thread int busy;
typedef void *(*mmap_fn)(void *, size_t, int, int, int, off_t);
typedef int (*munmap_fn)(void *, size_t);
typedef void *(*tstate_fn)(void);
typedef void (*dump_fn)(int, void *);

static void report(const char *what, void *p, size_t n) {
  if (busy) return;
  busy = 1;
  char line[200];
  int k = snprintf(line, sizeof line, "\nlarge_alloc %s %zu bytes (%.3f GiB) at %p, thread %ld\n", what, n,
                   n / 1073741824.0, p, (long)syscall(SYS_gettid));
  if (write(2, line, (size_t)k) >= 0 && n) {
    void *frames[24];
    backtrace_symbols_fd(frames, backtrace(frames, 24), 2);
    static tstate_fn tstate;
    static dump_fn dump;
    if (!tstate) tstate = (tstate_fn)dlsym(RTLD_DEFAULT, "PyGILState_GetThisThreadState");
    if (!dump) dump = (dump_fn)dlsym(RTLD_DEFAULT, "_Py_DumpTraceback");
    void *ts = tstate ? tstate() : NULL;
    if (ts && dump) dump(2, ts);
    (void)!write(2, "large_alloc end\n", 16);
  }
  busy = 0;
}

void *malloc(size_t n) {
  void *p = __libc_malloc(n);
  if (n >= threshold) report("malloc", p, n);
  return p;
}
void *calloc(size_t a, size_t b) {
  void *p = __libc_calloc(a, b);
  if (a * b >= threshold) report("calloc", p, a * b);
  return p;
}
void *realloc(void *q, size_t n) {
  void *p = __libc_realloc(q, n);
  if (n >= threshold) report("realloc", p, n);
  return p;
}
void *memalign(size_t align, size_t n) {
  void *p = __libc_memalign(align, n);
  if (n >= threshold) report("memalign", p, n);
  return p;
}
void *aligned_alloc(size_t align, size_t n) { return memalign(align, n); }
int posix_memalign(void **out, size_t align, size_t n) {
  void *p = memalign(align, n);
  if (!p) return 12;  // ENOMEM
  *out = p;
  return 0;
}
void free(void *p) {
  if (p && !busy && malloc_usable_size(p) >= threshold) report("free", p, 0);
  __libc_free(p);
}
void *mmap(void *addr, size_t n, int prot, int flags, int fd, off_t off) {
  static mmap_fn real;
  if (!real) real = (mmap_fn)dlsym(RTLD_NEXT, "mmap");
  void *p = real(addr, n, prot, flags, fd, off);
  if (n >= threshold && (flags & MAP_ANONYMOUS) && (prot & PROT_WRITE)) report("mmap", p, n);
  return p;
}
int munmap(void *addr, size_t n) {
  static munmap_fn real;
  if (!real) real = (munmap_fn)dlsym(RTLD_NEXT, "munmap");
  if (n >= threshold) report("munmap", addr, 0);
  return real(addr, n);
}

__attribute__((constructor)) static void install(void) {
  const char *mib = getenv("LARGE_ALLOC_MIB");
  if (mib && atoi(mib) > 0) threshold = (size_t)atoi(mib) << 20;
  void *warm[1];
  busy = 1;
  backtrace(warm, 1);  // loads the unwinder now, outside any traced allocation
  busy = 0;
}
