/* UCP one-sided rows and worker progress in native code, the GIL released.
 *
 * Built by the ordinary pip install (an optional extension: where it cannot
 * be built, datamover uses ctypes instead). No UCX header is needed: the few
 * prototypes below are declared from UCX 1.21 (ucp/api/ucp.h, ucp_compat.h,
 * ucs/type/status.h), and every function is resolved at run time from the
 * libucp that ucxx loaded (bind(), dlopen with RTLD_NOLOAD), so the handles
 * ucxx made are valid here. Only handles, plain pointers and ucs_status_t
 * cross; no UCX struct is laid out in this file.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdint.h>
#include <string.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef int ucs_status_t; /* enum ucs_status_t: 0 ok, 1 in progress, negative errors (values from ucs/type/status.h;
                           * py_status_codes() hands them to a test that checks each against ucs_status_string) */
typedef void *ucs_status_ptr_t;
#define UCS_OK 0
#define UCS_INPROGRESS 1
#define UCS_ERR_NO_MESSAGE (-1)
#define UCS_ERR_BUSY (-15)
#define UCS_ERR_CANCELED (-16)
#define UCS_ERR_LAST (-100)
#define PTR_IS_ERR(p) (((uintptr_t)(p)) >= ((uintptr_t)UCS_ERR_LAST))
#define PTR_IS_PTR(p) ((((uintptr_t)(p)) - 1) < ((uintptr_t)UCS_ERR_LAST - 1))

typedef ucs_status_t (*put_nbi_t)(void *ep, const void *buf, size_t n, uint64_t raddr, void *rkey);
typedef ucs_status_t (*get_nbi_t)(void *ep, void *buf, size_t n, uint64_t raddr, void *rkey);
typedef ucs_status_ptr_t (*put_nbx_t)(void *ep, const void *buf, size_t n, uint64_t raddr, void *rkey, const void *param);
typedef ucs_status_ptr_t (*get_nbx_t)(void *ep, void *buf, size_t n, uint64_t raddr, void *rkey, const void *param);
typedef ucs_status_ptr_t (*flush_nbx_t)(void *ep, const void *param);
typedef ucs_status_t (*check_status_t)(void *req);
typedef void (*request_free_t)(void *req);
typedef unsigned (*progress_t)(void *worker);
typedef ucs_status_t (*get_efd_t)(void *worker, int *fd);
typedef ucs_status_t (*arm_t)(void *worker);
typedef ucs_status_t (*worker_create_t)(void *context, const void *params, void **worker);
typedef void (*worker_destroy_t)(void *worker);
typedef ucs_status_t (*ep_create_t)(void *worker, const void *params, void **ep);
typedef ucs_status_ptr_t (*ep_close_nb_t)(void *ep, unsigned mode);
typedef ucs_status_t (*rkey_unpack_t)(void *ep, const void *buf, void **rkey);
typedef void (*rkey_destroy_t)(void *rkey);

static struct {
    put_nbi_t put_nbi;
    get_nbi_t get_nbi;
    put_nbx_t put_nbx;
    get_nbx_t get_nbx;
    flush_nbx_t flush_nbx;
    check_status_t check_status;
    request_free_t request_free;
    progress_t progress;
    get_efd_t get_efd;
    arm_t arm;
    worker_create_t worker_create;
    worker_destroy_t worker_destroy;
    ep_create_t ep_create;
    ep_close_nb_t ep_close_nb;
    rkey_unpack_t rkey_unpack;
    rkey_destroy_t rkey_destroy;
    int bound;
} ucp;

/* an all-zero ucp_request_param_t (no callback; the request is ours to free), larger than the struct */
static const uint64_t no_param[64];

/* one row of a prepared transfer, as Python lays it out in a (rows, 5) uint64 array */
typedef struct {
    uint64_t laddr, length, raddr, rkey, param; /* param: a ucp_request_param_t* for nbx (device rows), or 0 */
} row_t;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static double monotonic_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* the clock of Python's time.monotonic() on Linux */
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static PyObject *py_bind(PyObject *self, PyObject *args) {
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path)) return NULL;
    void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (lib == NULL) {
        PyErr_Format(PyExc_OSError, "%s is not loaded in this process (import ucxx first): %s", path, dlerror());
        return NULL;
    }
    static const char *names[] = {"ucp_put_nbi", "ucp_get_nbi", "ucp_put_nbx", "ucp_get_nbx", "ucp_ep_flush_nbx",
                                  "ucp_request_check_status", "ucp_request_free", "ucp_worker_progress",
                                  "ucp_worker_get_efd", "ucp_worker_arm", "ucp_worker_create", "ucp_worker_destroy",
                                  "ucp_ep_create", "ucp_ep_close_nb", "ucp_ep_rkey_unpack", "ucp_rkey_destroy"};
    void *fns[16];
    for (int i = 0; i < 16; i++) {
        fns[i] = dlsym(lib, names[i]);
        if (fns[i] == NULL) {
            PyErr_Format(PyExc_OSError, "%s has no %s", path, names[i]);
            dlclose(lib);
            return NULL;
        }
    }
    ucp.put_nbi = (put_nbi_t)fns[0];
    ucp.get_nbi = (get_nbi_t)fns[1];
    ucp.put_nbx = (put_nbx_t)fns[2];
    ucp.get_nbx = (get_nbx_t)fns[3];
    ucp.flush_nbx = (flush_nbx_t)fns[4];
    ucp.check_status = (check_status_t)fns[5];
    ucp.request_free = (request_free_t)fns[6];
    ucp.progress = (progress_t)fns[7];
    ucp.get_efd = (get_efd_t)fns[8];
    ucp.arm = (arm_t)fns[9];
    ucp.worker_create = (worker_create_t)fns[10];
    ucp.worker_destroy = (worker_destroy_t)fns[11];
    ucp.ep_create = (ep_create_t)fns[12];
    ucp.ep_close_nb = (ep_close_nb_t)fns[13];
    ucp.rkey_unpack = (rkey_unpack_t)fns[14];
    ucp.rkey_destroy = (rkey_destroy_t)fns[15];
    ucp.bound = 1; /* the library stays loaded: ucxx holds it, and so does this handle */
    Py_RETURN_NONE;
}

static int need_bound(void) {
    if (!ucp.bound) {
        PyErr_SetString(PyExc_RuntimeError, "datamover.backends.ucx._ucp: bind() the libucp ucxx loaded first");
        return 0;
    }
    return 1;
}

/* ---- Cork: the sockets a post's rows go out on, corked while they are posted ----
 *
 * Over tcp each get is a small request (an active message) sent on its own: one sendmsg, one segment, and the
 * whole path through both network stacks per row. Corked (TCP_CORK) while the rows are posted, the requests
 * leave in full segments when the cork comes off, after the flush is posted. Each socket is named by its fd and
 * inode: a socket that is no longer the one looked up (closed, the fd reused) is left alone. */

#define MAX_CORK 8

typedef struct {
    int fd[MAX_CORK];
    int n;
} cork_t;

static unsigned long long corked_posts;
static unsigned long long leaked_workers; /* DataWorkers closed with operations maybe queued: never destroyed */

/* cork: a tuple of (fd, inode) pairs, at most MAX_CORK; parsed with the GIL held */
static int cork_parse(PyObject *obj, cork_t *c, unsigned long long *inodes) {
    c->n = 0;
    if (obj == Py_None) return 1;
    if (!PyTuple_Check(obj) || PyTuple_GET_SIZE(obj) > MAX_CORK) {
        PyErr_SetString(PyExc_TypeError, "cork must be a tuple of at most 8 (fd, inode) pairs");
        return 0;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(obj); i++) {
        int fd;
        unsigned long long ino;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(obj, i), "iK", &fd, &ino)) return 0;
        c->fd[c->n] = fd;
        inodes[c->n++] = ino;
    }
    return 1;
}

/* cork every socket of c that is still the one named; keeps only those in c (to uncork after) */
static void cork_on(cork_t *c, const unsigned long long *inodes) {
    int kept = 0, one = 1;
    for (int i = 0; i < c->n; i++) {
        struct stat st;
        if (fstat(c->fd[i], &st) != 0 || !S_ISSOCK(st.st_mode) || (unsigned long long)st.st_ino != inodes[i]) continue;
        if (setsockopt(c->fd[i], IPPROTO_TCP, TCP_CORK, &one, sizeof one) == 0) c->fd[kept++] = c->fd[i];
    }
    c->n = kept;
}

static void cork_set(const cork_t *c, int on) {
    for (int i = 0; i < c->n; i++) setsockopt(c->fd[i], IPPROTO_TCP, TCP_CORK, &on, sizeof on);
}

static void cork_off(const cork_t *c) { cork_set(c, 0); }

/* the kernel's byte counts of a TCP socket: received, and sent and acknowledged (struct tcp_info's
 * tcpi_bytes_received and tcpi_bytes_acked, Linux 4.1 on); 0 where it cannot tell */
#define TCPI_BYTES_ACKED 120
#define TCPI_BYTES_RECEIVED 128
/* bytes received on a TCP socket and not read yet (0 where it cannot tell) */
static unsigned long long unread(int fd) {
    int n = 0;
    return ioctl(fd, FIONREAD, &n) == 0 && n > 0 ? (unsigned long long)n : 0;
}

static int tcp_bytes(int fd, unsigned long long *rx, unsigned long long *tx) {
    unsigned char info[256];
    socklen_t len = sizeof info;
    if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, info, &len) != 0 || len < TCPI_BYTES_RECEIVED + 8) return 0;
    memcpy(tx, info + TCPI_BYTES_ACKED, 8);
    memcpy(rx, info + TCPI_BYTES_RECEIVED, 8);
    return 1;
}

/* a socket is corked through a burst only while a stream comes in on it: since the last burst it received at
 * least this much and four times what it sent (puts arriving, one small acknowledgement going back each), not
 * while it sends more than it receives (a get's reply each: corked, a reply that fills the socket waits) */
#define CORK_STREAM_BYTES 4096
/* ...and corked only while its rows are small: at most this many bytes read per byte sent. UCX's tcp put
 * acknowledgement is 9 bytes, so rows up to about 18 KiB, several to one 64 KiB receive, whose acknowledgements
 * a progress call makes together. A stream of larger rows gets one acknowledgement per call: corking it only
 * adds two system calls per call. The rows are judged once at least CORK_MIN_SENT was sent since the last
 * judgement (fewer acknowledgements say little, a stray one acked late nothing), and what was sent since then
 * is weighed against what was read since (received less what waits unread), not against what came in: a
 * backlog that came in while the thread was away is neither read nor acknowledged yet (weighed against the
 * acknowledgements of the few rows before it, it read as large rows). Until judged, a socket's rows are small */
#define CORK_MAX_BYTES_PER_SENT 2048
#define CORK_MIN_SENT 64 /* bytes: about seven acknowledgements */

/* ---- Progress: a native thread serving a worker, blocking on its event fd between bursts of work ----
 *
 * The thread sleeps in epoll_wait on a set of its own: UCX's event fd, a stop and a kick eventfd. While a waiter
 * holds the worker (it drives the worker itself, see Flush.drive), UCX's fd is taken out of that set, so events
 * the waiter handles do not wake this thread too; the last release() puts it back and arms the worker, kicking
 * the thread only when events are already pending (or it noticed the hold). A transfer its caller waits for thus
 * costs this thread no wakeup at all.
 *
 * With poll_s > 0, a burst of work is followed by sleeps of poll_s on a timer (UCX's fd not waited on) and
 * another progress, for as long as each finds work; the first progress that finds none arms the worker and
 * blocks on the fd again. While a peer streams puts or gets in, the thread then wakes once per poll_s on its
 * own timer instead of once per arriving segment through the sender's syscall (a wakeup the sender pays for
 * and, where both share cores, a preemption of the sender). An idle worker still costs no wakeup.
 *
 * With stream_poll_s > 0 (and poll_s 0), only a burst during which a stream came in on one of the sockets handed
 * to set_cork (received at least CORK_STREAM_BYTES and four times what it sent: puts arriving), once that stream
 * has brought stream_bytes without a pause of STREAM_GAP_S, is followed by that timer sleep; a shorter transfer
 * is served per arrival (its last bytes would wait for the timer), and other bursts (a get's replies going out)
 * arm the worker and block on its fd at once. */

#define STREAM_GAP_S 1e-3

/* ---- DataWorker: a UCP worker of our own in serialized mode, every call on it under one mutex ----
 *
 * ucxx makes every worker multi-threaded, and UCX then takes the worker's lock around each put/get, progress
 * call and request release. A worker created here in UCS_THREAD_MODE_SERIALIZED takes none: its mutex, taken
 * once per post and once per progress call, is what keeps the threads that touch it apart. */

typedef struct {
    PyObject_HEAD
    void *worker; /* NULL once closed */
    int efd;      /* UCX's event fd for it, or -1 */
    pthread_mutex_t lock;
    PyObject *owner; /* what keeps the context alive (the ucxx context object), released after the worker */
    void **orphans;  /* requests let go of before they ended (abandoned flushes, endpoint closes): freed once
                      * seen ended; any still running when the worker goes keep it from being destroyed */
    Py_ssize_t n_orphans, cap_orphans;
    Py_ssize_t running; /* Flushes on it whose request has not been seen to end (nor orphaned) */
    unsigned long long untracked; /* posts that failed part-way: rows in flight with no request to see them end */
    int leaked; /* closed with operations still queued: the worker (and its context) are never destroyed */
} DataWorkerObject;

static PyTypeObject DataWorkerType;

static inline void data_lock(DataWorkerObject *d) {
    if (d != NULL) pthread_mutex_lock(&d->lock);
}

static inline void data_unlock(DataWorkerObject *d) {
    if (d != NULL) pthread_mutex_unlock(&d->lock);
}

/* whether a request on d (NULL: on a ucxx worker) may still be touched: once d's worker is destroyed, its
 * requests went with it (under d's lock) */
static inline int data_alive(DataWorkerObject *d) { return d == NULL || d->worker != NULL; }

/* free the orphans that ended; how many still run (lock held, worker open) */
static Py_ssize_t data_sweep_locked(DataWorkerObject *d) {
    Py_ssize_t kept = 0;
    for (Py_ssize_t i = 0; i < d->n_orphans; i++) {
        void *req = d->orphans[i];
        if (ucp.check_status(req) == UCS_INPROGRESS)
            d->orphans[kept++] = req;
        else
            ucp.request_free(req);
    }
    d->n_orphans = kept;
    return kept;
}

/* req, still running, is let go of: d frees it once it ended (lock held). UCP's own ucp_request_free of a running
 * request would free it silently, and the worker could then not tell whether anything is still queued on it */
static void data_orphan_locked(DataWorkerObject *d, void *req) {
    if (!data_alive(d)) return;
    if (d == NULL) {
        ucp.request_free(req);
        return;
    }
    d->running--; /* from its Flush to the orphans */
    if (d->n_orphans == d->cap_orphans && data_sweep_locked(d) == d->cap_orphans) {
        Py_ssize_t cap = d->cap_orphans ? 2 * d->cap_orphans : 16;
        void **grown = realloc(d->orphans, (size_t)cap * sizeof *grown);
        if (grown == NULL) { /* cannot track it: count it as lost (the worker is then never destroyed) */
            d->untracked++;
            ucp.request_free(req);
            return;
        }
        d->orphans = grown;
        d->cap_orphans = cap;
    }
    d->orphans[d->n_orphans++] = req;
}

typedef struct {
    PyObject_HEAD
    void *worker;
    int efd;  /* UCX's event fd for the worker */
    int ep;   /* the thread's epoll set: efd (while not held), stop, kick */
    int stop; /* an eventfd: written to stop the thread */
    int kick; /* an eventfd: written to make the thread progress now */
    int held; /* holds: while any, the thread leaves the worker to the holder (a waiter driving it) */
    int held_sleep; /* the thread noticed a hold and sleeps until released */
    int notify; /* written (one 8-byte count) after progress that did work, or -1 */
    double spin_s;
    double poll_s; /* > 0: after work, sleep this long on a timer and progress again while there is work */
    double stream_poll_s; /* > 0: the same, only after a burst during which a stream came in (see above) */
    unsigned long long stream_bytes; /* ... once the stream brought this many bytes */
    unsigned long long stream_run; /* bytes the current stream brought so far (thread only) */
    double stream_last; /* when a burst last saw it (thread only) */
    pthread_mutex_t hold_lock; /* orders holds and releases, and the efd's membership of ep with them */
    pthread_mutex_t run_lock; /* held by the thread through each burst of progress: quiesce() takes it */
    pthread_t thread;
    sem_t started; /* posted once the thread has named itself and set its timer slack */
    int running;
    volatile int quit;
    cork_t cork; /* sockets watched for streams coming in (set_cork), and their inodes; under hold_lock */
    int cork_streams; /* cork a socket through each progress call of a burst while a stream comes in on it */
    unsigned long long cork_ino[MAX_CORK];
    unsigned long long cork_rx[MAX_CORK], cork_tx[MAX_CORK]; /* their byte counts at the last burst */
    unsigned long long cork_read[MAX_CORK], cork_sent[MAX_CORK]; /* read and sent at the last judgement of rows */
    unsigned char cork_large[MAX_CORK]; /* its last judgement of rows: large */
    unsigned long long cork_gen, cork_seen; /* set_cork()s so far, and the one the thread's counts are for */
    unsigned long long wakeups, bursts, progressed, kicks, holds, release_kicks, polls, events, corked, streams;
    unsigned long long busy, unarmed; /* arms that said busy (progressed again at once); arms that failed (1 ms sleep) */
    DataWorkerObject *data; /* a second worker this thread progresses (under its mutex), or NULL */
    int data_efd; /* its event fd (in ep while not held), or -1 */
} ProgressObject;

static void notify_fd(int fd) {
    if (fd >= 0) {
        uint64_t one = 1;
        ssize_t rc = write(fd, &one, sizeof one); /* a full pipe already says so */
        (void)rc;
    }
}

static void drain_fd(int fd) {
    uint64_t v;
    ssize_t rc = read(fd, &v, sizeof v);
    (void)rc;
}

static int is_held(ProgressObject *p) { return __atomic_load_n(&p->held, __ATOMIC_SEQ_CST) > 0; }

/* one progress call on the thread's second worker, under its mutex (0 without one, or once it is closed) */
static unsigned data_progress(ProgressObject *p) {
    DataWorkerObject *d = p->data;
    if (d == NULL) return 0;
    data_lock(d);
    unsigned n = d->worker != NULL ? ucp.progress(d->worker) : 0;
    data_unlock(d);
    return n;
}

static ucs_status_t data_arm(ProgressObject *p) {
    DataWorkerObject *d = p->data;
    if (d == NULL) return UCS_OK;
    data_lock(d);
    ucs_status_t st = d->worker != NULL ? ucp.arm(d->worker) : UCS_OK;
    data_unlock(d);
    return st;
}


static int ep_add(int ep, int fd) {
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = fd};
    return epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev);
}

/* the first hold takes UCX's fd out of the thread's epoll set: the holder's events do not wake the thread */
static void progress_hold_c(ProgressObject *p) {
    pthread_mutex_lock(&p->hold_lock);
    if (__atomic_add_fetch(&p->held, 1, __ATOMIC_SEQ_CST) == 1) {
        epoll_ctl(p->ep, EPOLL_CTL_DEL, p->efd, NULL);
        if (p->data_efd >= 0) epoll_ctl(p->ep, EPOLL_CTL_DEL, p->data_efd, NULL);
    }
    p->holds++;
    pthread_mutex_unlock(&p->hold_lock);
}

/* the last release puts UCX's fd back and arms the worker; the thread is kicked only when events are pending
 * (arm says busy) or it noticed the hold and sleeps until told. No Python call: runs without the GIL. */
static void progress_release_c(ProgressObject *p) {
    int kick = 0;
    pthread_mutex_lock(&p->hold_lock);
    if (p->held > 0 && __atomic_sub_fetch(&p->held, 1, __ATOMIC_SEQ_CST) == 0 && p->running) {
        ep_add(p->ep, p->efd);
        if (p->data_efd >= 0) ep_add(p->ep, p->data_efd);
        kick = ucp.arm(p->worker) != UCS_OK || data_arm(p) != UCS_OK ||
               __atomic_load_n(&p->held_sleep, __ATOMIC_SEQ_CST);
        if (kick) p->release_kicks++;
    }
    pthread_mutex_unlock(&p->hold_lock);
    if (kick) notify_fd(p->kick);
}

/* ---- Flush: one ucp_ep_flush_nbx request, checked, waited for (progressing the worker) or abandoned ---- */

typedef struct {
    PyObject_HEAD
    void *req; /* the request while in flight, else NULL */
    int status; /* UCS_INPROGRESS while req is set, then the flush's status */
    pthread_mutex_t lock; /* req is checked and freed by whichever thread holds it */
    ProgressObject *progress; /* the progress thread this request holds off the worker (see post), or NULL */
    int holding; /* the hold on progress is still taken */
    DataWorkerObject *data; /* the serialized worker the request is on (its mutex around every call), or NULL */
} FlushObject;

static PyTypeObject FlushType;
static PyTypeObject ProgressType;

/* give the worker back to the progress thread (once); lock held or the flush not shared yet */
static void flush_unhold_locked(FlushObject *f) {
    if (f->holding) {
        f->holding = 0;
        progress_release_c(f->progress);
    }
}

/* the request's status now, freeing it (and the hold) once it ended; lock held */
static int flush_check_locked(FlushObject *f) {
    if (f->req != NULL) {
        data_lock(f->data);
        int st = data_alive(f->data) ? ucp.check_status(f->req) : UCS_ERR_CANCELED;
        if (st != UCS_INPROGRESS && data_alive(f->data)) {
            ucp.request_free(f->req);
            if (f->data != NULL) f->data->running--;
        }
        data_unlock(f->data);
        if (st == UCS_INPROGRESS) return st;
        f->req = NULL;
        f->status = st;
    }
    flush_unhold_locked(f);
    return f->status;
}

static void flush_dealloc(FlushObject *f) {
    if (f->req != NULL) { /* freed once it ends */
        data_lock(f->data);
        data_orphan_locked(f->data, f->req);
        data_unlock(f->data);
    }
    flush_unhold_locked(f);
    Py_XDECREF(f->progress);
    Py_XDECREF(f->data);
    pthread_mutex_destroy(&f->lock);
    Py_TYPE(f)->tp_free((PyObject *)f);
}

static PyObject *flush_unhold(FlushObject *f, PyObject *unused) {
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&f->lock);
    flush_unhold_locked(f);
    pthread_mutex_unlock(&f->lock);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *flush_get_holding(FlushObject *f, void *closure) { return PyBool_FromLong(f->holding); }

static PyObject *flush_poll(FlushObject *f, PyObject *unused) {
    int st;
    pthread_mutex_lock(&f->lock);
    st = flush_check_locked(f);
    pthread_mutex_unlock(&f->lock);
    return PyLong_FromLong(st);
}

static PyObject *flush_abandon(FlushObject *f, PyObject *unused) {
    pthread_mutex_lock(&f->lock);
    if (f->req != NULL) {
        data_lock(f->data);
        data_orphan_locked(f->data, f->req);
        data_unlock(f->data);
        f->req = NULL;
        f->status = UCS_ERR_CANCELED;
    }
    flush_unhold_locked(f);
    pthread_mutex_unlock(&f->lock);
    Py_RETURN_NONE;
}

/* what the waiters' drive loops did, summed over every drive() in this process (see drive_stats()) */
typedef struct {
    unsigned long long drives, progress, empty, looks, late, sleeps, pauses;
} drive_counts_t;

static drive_counts_t drive_total;

static void drive_add(const drive_counts_t *c) {
    __atomic_add_fetch(&drive_total.drives, c->drives, __ATOMIC_RELAXED);
    __atomic_add_fetch(&drive_total.progress, c->progress, __ATOMIC_RELAXED);
    __atomic_add_fetch(&drive_total.empty, c->empty, __ATOMIC_RELAXED);
    __atomic_add_fetch(&drive_total.looks, c->looks, __ATOMIC_RELAXED);
    __atomic_add_fetch(&drive_total.late, c->late, __ATOMIC_RELAXED);
    __atomic_add_fetch(&drive_total.sleeps, c->sleeps, __ATOMIC_RELAXED);
    __atomic_add_fetch(&drive_total.pauses, c->pauses, __ATOMIC_RELAXED);
}

static int flush_check(FlushObject *f) {
    pthread_mutex_lock(&f->lock);
    int st = flush_check_locked(f);
    pthread_mutex_unlock(&f->lock);
    return st;
}

/* empty progress calls in a row between looks at the clock and the flush: each is an epoll_wait, so a look
 * (a mutex round trip and clock_gettime) every few costs little, and the flush can only end in a progress
 * that did work (it is looked at after each of those) unless another thread progresses the worker */
#define DRIVE_LOOK_EVERY 8

/* drive(worker, deadline, spin_s=50e-6, pause_s=0): progress ``worker`` until the flush ends or
 * time.monotonic() passes ``deadline``; returns the flush's status (UCS_INPROGRESS at the deadline). After
 * ``spin_s`` without progress it sleeps on UCX's event fd (armed) instead of spinning, so a peer that shares
 * the cores gets them. The GIL is released throughout. */
static PyObject *flush_drive(FlushObject *f, PyObject *args) {
    unsigned long long worker_ull;
    double deadline, spin_s = 50e-6, pause_s = 0.0;
    if (!PyArg_ParseTuple(args, "Kd|dd", &worker_ull, &deadline, &spin_s, &pause_s)) return NULL;
    void *worker = (void *)(uintptr_t)worker_ull;
    int st, efd = -1;
    drive_counts_t c = {.drives = 1};
    Py_BEGIN_ALLOW_THREADS
    if (ucp.get_efd(worker, &efd) != UCS_OK) efd = -1;
    double now = monotonic_s(), last = now;
    unsigned empty = 0; /* empty progress calls since the last look */
    st = flush_check(f);
    while (st == UCS_INPROGRESS) {
        unsigned k = 0;
        data_lock(f->data);
        if (data_alive(f->data))
            while (ucp.progress(worker)) k++;
        data_unlock(f->data);
        c.progress += k + 1;
        c.empty++;
        if (k) {
            empty = 0;
            st = flush_check(f);
            now = last = monotonic_s();
            if (st != UCS_INPROGRESS || now > deadline) break;
            continue;
        }
        if (++empty >= DRIVE_LOOK_EVERY) {
            empty = 0;
            c.looks++;
            st = flush_check(f);
            if (st != UCS_INPROGRESS) {
                c.late++; /* ended without a progress that did work: another thread's, or a callback's */
                break;
            }
            now = monotonic_s();
            if (now > deadline) break;
            if (efd >= 0 && now - last >= spin_s) {
                data_lock(f->data);
                ucs_status_t armed = data_alive(f->data) ? ucp.arm(worker) : UCS_OK;
                data_unlock(f->data);
                if (armed != UCS_OK) continue; /* busy: events to progress first */
                st = flush_check(f);
                if (st != UCS_INPROGRESS) break;
                double left_ms = (deadline - now) * 1e3;
                struct pollfd pfd = {.fd = efd, .events = POLLIN};
                poll(&pfd, 1, left_ms < 1.0 ? 1 : (left_ms > 10.0 ? 10 : (int)left_ms));
                c.sleeps++;
                now = last = monotonic_s();
                continue;
            }
        }
        if (pause_s > 0.0) {
            /* wait pause_s on the CPU (no syscall) before asking UCX again, so that each progress (an
             * epoll_wait on UCX's sockets) finds more work and the polling does not contend with the kernel
             * delivering the peer's data into those sockets */
            double until = monotonic_s() + pause_s;
            while (monotonic_s() < until) cpu_relax();
            c.pauses++;
        }
    }
    Py_END_ALLOW_THREADS
    drive_add(&c);
    return PyLong_FromLong(st);
}

static PyObject *py_drive_stats(PyObject *self, PyObject *unused) {
    drive_counts_t t;
    t.drives = __atomic_load_n(&drive_total.drives, __ATOMIC_RELAXED);
    t.progress = __atomic_load_n(&drive_total.progress, __ATOMIC_RELAXED);
    t.empty = __atomic_load_n(&drive_total.empty, __ATOMIC_RELAXED);
    t.looks = __atomic_load_n(&drive_total.looks, __ATOMIC_RELAXED);
    t.late = __atomic_load_n(&drive_total.late, __ATOMIC_RELAXED);
    t.sleeps = __atomic_load_n(&drive_total.sleeps, __ATOMIC_RELAXED);
    t.pauses = __atomic_load_n(&drive_total.pauses, __ATOMIC_RELAXED);
    return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K,s:K,s:K}", "drives", t.drives, "progress", t.progress, "empty",
                         t.empty, "looks", t.looks, "late", t.late, "sleeps", t.sleeps, "pauses", t.pauses);
}

static PyObject *flush_get_status(FlushObject *f, void *closure) { return PyLong_FromLong(f->status); }

static PyMethodDef flush_methods[] = {
    {"poll", (PyCFunction)flush_poll, METH_NOARGS, "UCS_INPROGRESS until the flush ends, then its status."},
    {"abandon", (PyCFunction)flush_abandon, METH_NOARGS, "Stop tracking: UCP frees the request when it ends."},
    {"unhold", (PyCFunction)flush_unhold, METH_NOARGS,
     "Give the worker back to the progress thread now (the flush ends under it): nobody drives this request."},
    {"drive", (PyCFunction)flush_drive, METH_VARARGS,
     "drive(worker_handle, deadline, spin_s=50e-6, pause_s=0): progress the worker until the flush ends or the "
     "monotonic deadline passes, sleeping on UCX's event fd after spin_s without progress, and waiting pause_s on "
     "the CPU after each progress that found nothing."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef flush_getset[] = {
    {"status", (getter)flush_get_status, NULL, "the last status seen", NULL},
    {"holding", (getter)flush_get_holding, NULL, "whether this request still holds the progress thread off", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject FlushType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "datamover.backends.ucx._ucp.Flush",
    .tp_basicsize = sizeof(FlushObject),
    .tp_dealloc = (destructor)flush_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Remote completion of every put/get posted on one endpoint before it.",
    .tp_methods = flush_methods,
    .tp_getset = flush_getset,
};

/* a Flush tracking req; with ``progress`` (already held), the hold passes to it and ends with the request */
static FlushObject *new_flush(void *req, int status, ProgressObject *progress, DataWorkerObject *data) {
    FlushObject *f = PyObject_New(FlushObject, &FlushType);
    if (f == NULL) {
        if (req != NULL) {
            data_lock(data);
            ucp.request_free(req);
            data_unlock(data);
        }
        if (progress != NULL) progress_release_c(progress);
        return NULL;
    }
    pthread_mutex_init(&f->lock, NULL);
    f->req = req;
    f->status = status;
    f->progress = progress;
    f->holding = progress != NULL;
    f->data = data;
    if (req != NULL && data != NULL) {
        data_lock(data);
        data->running++;
        data_unlock(data);
    }
    Py_XINCREF(progress);
    Py_XINCREF(data);
    if (req == NULL) flush_unhold_locked(f); /* ended already */
    return f;
}

/* post(get, ep, rows, progress=None, cork=None, push_every=0): one put (or get) per row of a C-contiguous (n, 5)
 * uint64 buffer, then one endpoint flush; returns a Flush, or the first error status (int) with nothing left
 * tracked. With cork, what the rows sent so far leaves every push_every rows (0: only after the flush), so the
 * peer starts on the first rows while later ones are posted. */
static PyObject *py_post(PyObject *self, PyObject *args) {
    int get;
    unsigned long long ep_ull;
    Py_ssize_t push_every = 0;
    PyObject *rows_obj, *progress_obj = Py_None, *cork_obj = Py_None, *data_obj = Py_None;
    if (!PyArg_ParseTuple(args, "pKO|OOnO", &get, &ep_ull, &rows_obj, &progress_obj, &cork_obj, &push_every,
                          &data_obj))
        return NULL;
    DataWorkerObject *data = NULL;
    if (data_obj != Py_None) {
        if (!PyObject_TypeCheck(data_obj, &DataWorkerType)) {
            PyErr_SetString(PyExc_TypeError, "data must be a DataWorker or None");
            return NULL;
        }
        data = (DataWorkerObject *)data_obj;
        if (data->worker == NULL) {
            PyErr_SetString(PyExc_ValueError, "the DataWorker is closed");
            return NULL;
        }
    }
    if (!need_bound()) return NULL;
    cork_t cork;
    unsigned long long inodes[MAX_CORK];
    if (!cork_parse(cork_obj, &cork, inodes)) return NULL;
    ProgressObject *progress = NULL;
    if (progress_obj != Py_None) {
        if (!PyObject_TypeCheck(progress_obj, &ProgressType)) {
            PyErr_SetString(PyExc_TypeError, "progress must be a Progress or None");
            return NULL;
        }
        progress = (ProgressObject *)progress_obj;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(rows_obj, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return NULL;
    if (view.itemsize != 8 || view.len % (Py_ssize_t)sizeof(row_t) != 0 ||
        (view.format != NULL && strchr("QLq", view.format[0]) == NULL)) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "rows must be a C-contiguous (n, 5) uint64 array");
        return NULL;
    }
    const row_t *rows = (const row_t *)view.buf;
    Py_ssize_t n = view.len / (Py_ssize_t)sizeof(row_t);
    void *ep = (void *)(uintptr_t)ep_ull;
    int status = UCS_OK;
    void *req = NULL;
    Py_ssize_t posted = 0; /* rows handed to UCP */
    Py_BEGIN_ALLOW_THREADS
    if (progress != NULL) progress_hold_c(progress); /* the poster's events must not wake the thread */
    data_lock(data);
    cork_on(&cork, inodes);
    if (cork.n) __atomic_add_fetch(&corked_posts, 1, __ATOMIC_RELAXED);
    for (Py_ssize_t i = 0; i < n; i++) {
        const row_t *r = &rows[i];
        if (cork.n && push_every > 0 && i > 0 && i % push_every == 0) {
            cork_set(&cork, 0); /* out with what is queued, then corked again */
            cork_set(&cork, 1);
        }
        void *buf = (void *)(uintptr_t)r->laddr, *rkey = (void *)(uintptr_t)r->rkey;
        if (r->param == 0) {
            status = get ? ucp.get_nbi(ep, buf, r->length, r->raddr, rkey)
                         : ucp.put_nbi(ep, buf, r->length, r->raddr, rkey);
            if (status < 0) break;
            status = UCS_OK;
            posted++;
            continue;
        }
        const void *param = (const void *)(uintptr_t)r->param;
        ucs_status_ptr_t p = get ? ucp.get_nbx(ep, buf, r->length, r->raddr, rkey, param)
                                 : ucp.put_nbx(ep, buf, r->length, r->raddr, rkey, param);
        if (PTR_IS_PTR(p)) {
            ucp.request_free(p);
        } else if (PTR_IS_ERR(p)) {
            status = (int)(intptr_t)p;
            break;
        }
        posted++;
    }
    if (status == UCS_OK) {
        ucs_status_ptr_t p = ucp.flush_nbx(ep, no_param);
        if (PTR_IS_PTR(p)) {
            req = p;
            status = UCS_INPROGRESS;
        } else if (PTR_IS_ERR(p)) {
            status = (int)(intptr_t)p;
        }
    }
    cork_off(&cork); /* the requests leave now, in full segments */
    if (status < 0 && posted > 0 && data != NULL) data->untracked++;
    data_unlock(data);
    if (status < 0 && progress != NULL) progress_release_c(progress);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (status < 0) return PyLong_FromLong(status);
    return (PyObject *)new_flush(req, status, progress, data);
}

static PyObject *py_flush(PyObject *self, PyObject *args) {
    unsigned long long ep;
    PyObject *data_obj = Py_None;
    if (!PyArg_ParseTuple(args, "K|O", &ep, &data_obj)) return NULL;
    if (!need_bound()) return NULL;
    DataWorkerObject *data = NULL;
    if (data_obj != Py_None) {
        if (!PyObject_TypeCheck(data_obj, &DataWorkerType) || ((DataWorkerObject *)data_obj)->worker == NULL) {
            PyErr_SetString(PyExc_TypeError, "data must be an open DataWorker or None");
            return NULL;
        }
        data = (DataWorkerObject *)data_obj;
    }
    data_lock(data);
    ucs_status_ptr_t p = ucp.flush_nbx((void *)(uintptr_t)ep, no_param);
    data_unlock(data);
    if (PTR_IS_PTR(p)) return (PyObject *)new_flush(p, UCS_INPROGRESS, NULL, data);
    return (PyObject *)new_flush(NULL, PTR_IS_ERR(p) ? (int)(intptr_t)p : UCS_OK, NULL, data);
}

static PyObject *py_post_stats(PyObject *self, PyObject *unused) {
    return Py_BuildValue("{s:K,s:K}", "corked", __atomic_load_n(&corked_posts, __ATOMIC_RELAXED), "leaked_workers",
                         __atomic_load_n(&leaked_workers, __ATOMIC_RELAXED));
}

/* status_codes(): the UCX status values this file compares against, by name (UCX ships no headers here, so they are
 * written out above; a test checks each against the loaded library's ucs_status_string) */
static PyObject *py_status_codes(PyObject *self, PyObject *unused) {
    return Py_BuildValue("{s:i,s:i,s:i,s:i,s:i}", "UCS_OK", UCS_OK, "UCS_INPROGRESS", UCS_INPROGRESS,
                         "UCS_ERR_NO_MESSAGE", UCS_ERR_NO_MESSAGE, "UCS_ERR_BUSY", UCS_ERR_BUSY, "UCS_ERR_CANCELED",
                         UCS_ERR_CANCELED);
}

/* worker_efd(worker): UCX's event fd for the worker (UCP_FEATURE_WAKEUP); OSError without it */
static PyObject *py_worker_efd(PyObject *self, PyObject *args) {
    unsigned long long worker;
    if (!PyArg_ParseTuple(args, "K", &worker)) return NULL;
    if (!need_bound()) return NULL;
    int efd = -1;
    ucs_status_t st = ucp.get_efd((void *)(uintptr_t)worker, &efd);
    if (st != UCS_OK) return PyErr_Format(PyExc_OSError, "ucp_worker_get_efd failed (status %d)", st);
    return PyLong_FromLong(efd);
}

static void *progress_main(void *arg) {
    ProgressObject *p = (ProgressObject *)arg;
    struct epoll_event evs[4];
    pthread_setname_np(pthread_self(), "dm-ucx-progress"); /* at most 15 characters */
    /* its timer sleeps (poll_s) are tens of microseconds: the default 50 us of slack would stretch them */
    prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL);
    sem_post(&p->started);
    while (!p->quit) {
        int armed = 0;
        if (is_held(p)) {
            /* a waiter drives the worker: sleep until the last hold is released (which kicks us) or stop */
            __atomic_store_n(&p->held_sleep, 1, __ATOMIC_SEQ_CST);
            if (!is_held(p)) {
                __atomic_store_n(&p->held_sleep, 0, __ATOMIC_SEQ_CST);
                continue;
            }
        } else {
            double idle_since = 0.0, spin_s, poll_s, stream_poll_s;
            int did = 0, corking = 0;
            unsigned long long events = 0; /* UCX events this burst handled (ucp_worker_progress's counts) */
            __atomic_load(&p->spin_s, &spin_s, __ATOMIC_RELAXED);
            __atomic_load(&p->poll_s, &poll_s, __ATOMIC_RELAXED);
            __atomic_load(&p->stream_poll_s, &stream_poll_s, __ATOMIC_RELAXED);
            cork_t cork = {.n = 0}; /* the sockets a stream of small rows comes in on, this burst */
            int streams = 0; /* the sockets any stream comes in on */
            unsigned long long stream_in = 0; /* what came in on them since the last burst */
            if (p->cork.n) { /* read without the lock: a word; the list itself is copied under it */
                unsigned long long ino[MAX_CORK], gen;
                cork_t all;
                pthread_mutex_lock(&p->hold_lock);
                all = p->cork;
                memcpy(ino, p->cork_ino, sizeof ino);
                gen = p->cork_gen;
                corking = p->cork_streams;
                pthread_mutex_unlock(&p->hold_lock);
                int fresh = gen != p->cork_seen;
                p->cork_seen = gen;
                for (int i = 0; i < all.n; i++) {
                    unsigned long long rx, tx;
                    struct stat st;
                    if (fstat(all.fd[i], &st) != 0 || !S_ISSOCK(st.st_mode) || (unsigned long long)st.st_ino != ino[i])
                        continue;
                    if (!tcp_bytes(all.fd[i], &rx, &tx)) continue;
                    unsigned long long drx = rx - p->cork_rx[i], dtx = tx - p->cork_tx[i];
                    p->cork_rx[i] = rx;
                    p->cork_tx[i] = tx;
                    if (fresh) {
                        p->cork_large[i] = 0;
                        p->cork_read[i] = rx - unread(all.fd[i]);
                        p->cork_sent[i] = tx;
                    }
                    if (!fresh && drx >= CORK_STREAM_BYTES && drx >= 4 * dtx) {
                        streams++;
                        stream_in += drx;
                        unsigned long long sent = tx - p->cork_sent[i];
                        if (sent >= CORK_MIN_SENT) {
                            unsigned long long read = rx - unread(all.fd[i]);
                            p->cork_large[i] = read - p->cork_read[i] > CORK_MAX_BYTES_PER_SENT * sent;
                            p->cork_read[i] = read;
                            p->cork_sent[i] = tx;
                        }
                        if (!p->cork_large[i]) cork.fd[cork.n++] = all.fd[i];
                    }
                }
                if (streams) p->streams++;
                if (cork.n && corking) p->corked++;
            }
            int streaming = 0;
            if (streams) {
                double now = monotonic_s();
                p->stream_run = now - p->stream_last < STREAM_GAP_S ? p->stream_run + stream_in : stream_in;
                p->stream_last = now;
                streaming = p->stream_run >= __atomic_load_n(&p->stream_bytes, __ATOMIC_RELAXED);
            }
            if (!corking) cork.n = 0;
            /* a quiesce() holds the thread off and then takes this: it waits for the burst to end */
            pthread_mutex_lock(&p->run_lock);
            for (;;) { /* progress while there is work, and spin a little after work (only after work) */
                unsigned k = 0, n;
                for (;;) {
                    /* corked through one progress call: what it sends (a put's acknowledgement each, a get's
                     * reply each) leaves in full segments when it returns; never longer, since a send that
                     * filled the socket must drain before the next call can send more */
                    cork_set(&cork, 1);
                    n = ucp.progress(p->worker) + data_progress(p);
                    cork_set(&cork, 0);
                    if (n == 0) break;
                    k++;
                    events += n;
                    if (is_held(p)) break; /* the holder progresses the rest (or a quiesce() waits for us) */
                }
                if (k) {
                    did = 1;
                    p->progressed += k;
                    idle_since = monotonic_s();
                    notify_fd(__atomic_load_n(&p->notify, __ATOMIC_RELAXED));
                } else if (!did || p->quit || monotonic_s() - idle_since >= spin_s) {
                    break;
                }
                if (is_held(p)) break;
            }
            pthread_mutex_unlock(&p->run_lock);
            if (did) p->bursts++;
            p->events += events;
            if (is_held(p)) continue;
            if (poll_s <= 0.0 && streaming) poll_s = stream_poll_s;
            if (did && poll_s > 0.0 && !p->quit) {
                /* traffic is flowing: look again after poll_s instead of being woken by each arrival */
                struct timespec ts = {(time_t)poll_s, (long)((poll_s - (double)(time_t)poll_s) * 1e9)};
                nanosleep(&ts, NULL);
                p->polls++;
                continue;
            }
            ucs_status_t st = ucp.arm(p->worker);
            if (st == UCS_OK) st = data_arm(p);
            if (st == UCS_ERR_BUSY) { /* events came in meanwhile, or sends wait for room: progress them first */
                p->busy++;
                continue;
            }
            if (st != UCS_OK) {
                p->unarmed++;
                struct timespec ts = {0, 1000000}; /* cannot arm: poll every millisecond instead */
                nanosleep(&ts, NULL);
                continue;
            }
            armed = 1;
        }
        int rc = epoll_wait(p->ep, evs, 4, -1);
        __atomic_store_n(&p->held_sleep, 0, __ATOMIC_SEQ_CST);
        if (rc < 0 && errno != EINTR) break;
        for (int i = 0; i < rc; i++) {
            int fd = evs[i].data.fd;
            if (fd == p->stop) return NULL;
            if (fd == p->kick) {
                drain_fd(p->kick);
                p->kicks++;
            } else if ((fd == p->efd || fd == p->data_efd) && armed) {
                p->wakeups++;
            }
        }
    }
    return NULL;
}

static PyObject *progress_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"worker", "spin_s", "notify_fd", "poll_s", "stream_poll_s", "stream_bytes", "data", NULL};
    unsigned long long worker, stream_bytes = 0;
    double spin_s = 0.0, poll_s = 0.0, stream_poll_s = 0.0;
    int notify = -1;
    PyObject *data_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "K|diddKO", kwlist, &worker, &spin_s, &notify, &poll_s, &stream_poll_s,
                                     &stream_bytes, &data_obj))
        return NULL;
    DataWorkerObject *data = NULL;
    if (data_obj != Py_None) {
        if (!PyObject_TypeCheck(data_obj, &DataWorkerType) || ((DataWorkerObject *)data_obj)->worker == NULL) {
            PyErr_SetString(PyExc_TypeError, "data must be an open DataWorker or None");
            return NULL;
        }
        data = (DataWorkerObject *)data_obj;
        if (data->efd < 0) {
            PyErr_SetString(PyExc_OSError, "the DataWorker has no event fd: its context needs UCP_FEATURE_WAKEUP");
            return NULL;
        }
    }
    if (!(poll_s >= 0.0 && poll_s <= 1.0) || !(stream_poll_s >= 0.0 && stream_poll_s <= 1.0) || !(spin_s >= 0.0)) {
        PyErr_SetString(PyExc_ValueError, "spin_s must be >= 0, poll_s and stream_poll_s in [0, 1] seconds");
        return NULL;
    }
    if (!need_bound()) return NULL;
    int efd = -1;
    ucs_status_t st = ucp.get_efd((void *)(uintptr_t)worker, &efd);
    if (st != UCS_OK) {
        PyErr_Format(PyExc_OSError, "ucp_worker_get_efd failed (status %d): the worker needs UCP_FEATURE_WAKEUP", st);
        return NULL;
    }
    int stop = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (stop < 0) return PyErr_SetFromErrno(PyExc_OSError);
    int kick = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (kick < 0) {
        close(stop);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    int ep = epoll_create1(EPOLL_CLOEXEC);
    if (ep < 0 || ep_add(ep, efd) < 0 || ep_add(ep, stop) < 0 || ep_add(ep, kick) < 0 ||
        (data != NULL && ep_add(ep, data->efd) < 0)) {
        PyErr_SetFromErrno(PyExc_OSError);
        if (ep >= 0) close(ep);
        close(stop);
        close(kick);
        return NULL;
    }
    ProgressObject *p = (ProgressObject *)type->tp_alloc(type, 0);
    if (p == NULL) {
        close(ep);
        close(stop);
        close(kick);
        return NULL;
    }
    pthread_mutex_init(&p->hold_lock, NULL);
    pthread_mutex_init(&p->run_lock, NULL);
    p->ep = ep;
    p->kick = kick;
    p->worker = (void *)(uintptr_t)worker;
    p->efd = efd;
    p->data = data;
    p->data_efd = data != NULL ? data->efd : -1;
    Py_XINCREF(data);
    p->stop = stop;
    p->notify = notify;
    p->spin_s = spin_s;
    p->poll_s = poll_s;
    p->stream_poll_s = stream_poll_s;
    p->stream_bytes = stream_bytes;
    p->cork_streams = 1;
    sem_init(&p->started, 0, 0);
    int rc = pthread_create(&p->thread, NULL, progress_main, p);
    if (rc != 0) {
        Py_DECREF(p);
        errno = rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    /* returned only once the thread is set up, so what it set is there for whoever looks */
    Py_BEGIN_ALLOW_THREADS
    while (sem_wait(&p->started) != 0 && errno == EINTR) {
    }
    Py_END_ALLOW_THREADS
    p->running = 1;
    return (PyObject *)p;
}

static void progress_join(ProgressObject *p) {
    if (p->running) {
        pthread_mutex_lock(&p->hold_lock);
        p->running = 0; /* a release after this leaves the worker alone: it may be freed */
        pthread_mutex_unlock(&p->hold_lock);
        p->quit = 1;
        uint64_t one = 1;
        ssize_t rc = write(p->stop, &one, sizeof one);
        (void)rc;
        Py_BEGIN_ALLOW_THREADS
        pthread_join(p->thread, NULL);
        Py_END_ALLOW_THREADS
    }
}

static PyObject *progress_close(ProgressObject *p, PyObject *unused) {
    progress_join(p);
    Py_RETURN_NONE;
}

static PyObject *progress_set_notify(ProgressObject *p, PyObject *args) {
    int fd;
    if (!PyArg_ParseTuple(args, "i", &fd)) return NULL;
    __atomic_store_n(&p->notify, fd, __ATOMIC_RELAXED);
    Py_RETURN_NONE;
}

/* tune(spin_s, poll_s, stream_poll_s=0, stream_bytes=0): the thread's spin after work and its timer polls, from
 * its next burst on (each is read once per burst: a word-sized store another thread sees whole) */
static PyObject *progress_tune(ProgressObject *p, PyObject *args) {
    double spin_s, poll_s, stream_poll_s = 0.0;
    unsigned long long stream_bytes = 0;
    if (!PyArg_ParseTuple(args, "dd|dK", &spin_s, &poll_s, &stream_poll_s, &stream_bytes)) return NULL;
    if (!(poll_s >= 0.0 && poll_s <= 1.0) || !(spin_s >= 0.0 && spin_s <= 1.0) ||
        !(stream_poll_s >= 0.0 && stream_poll_s <= 1.0)) {
        PyErr_SetString(PyExc_ValueError, "spin_s, poll_s and stream_poll_s must be in [0, 1] seconds");
        return NULL;
    }
    __atomic_store(&p->spin_s, &spin_s, __ATOMIC_RELAXED);
    __atomic_store(&p->poll_s, &poll_s, __ATOMIC_RELAXED);
    __atomic_store(&p->stream_poll_s, &stream_poll_s, __ATOMIC_RELAXED);
    __atomic_store_n(&p->stream_bytes, stream_bytes, __ATOMIC_RELAXED);
    Py_RETURN_NONE;
}

/* set_cork(pairs, cork=True): (fd, inode) pairs of tcp sockets watched for streams coming in, each corked
 * through a burst's progress calls while one does (with cork); () for none */
static PyObject *progress_set_cork(ProgressObject *p, PyObject *args) {
    PyObject *obj;
    int corking = 1;
    if (!PyArg_ParseTuple(args, "O|p", &obj, &corking)) return NULL;
    cork_t cork;
    unsigned long long inodes[MAX_CORK];
    if (!cork_parse(obj, &cork, inodes)) return NULL;
    pthread_mutex_lock(&p->hold_lock);
    p->cork = cork;
    p->cork_streams = corking;
    memcpy(p->cork_ino, inodes, sizeof inodes);
    p->cork_gen++; /* the thread's byte counts start again from its next burst */
    pthread_mutex_unlock(&p->hold_lock);
    Py_RETURN_NONE;
}

static PyObject *progress_hold(ProgressObject *p, PyObject *unused) {
    progress_hold_c(p);
    Py_RETURN_NONE;
}

static PyObject *progress_release(ProgressObject *p, PyObject *unused) {
    Py_BEGIN_ALLOW_THREADS
    progress_release_c(p);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* quiesce(): hold the thread off and wait until it is outside ucp_worker_progress; resume() (from the same
 * thread) lets it go on. Meanwhile this thread may cancel ucxx requests of the worker: ucxx takes a request's
 * lock and then the worker's to cancel, while a completion takes them the other way round (worker, then
 * request), so a cancel racing a completion in another thread deadlocks both. */
static PyObject *progress_quiesce(ProgressObject *p, PyObject *unused) {
    Py_BEGIN_ALLOW_THREADS
    progress_hold_c(p);
    pthread_mutex_lock(&p->run_lock);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *progress_resume(ProgressObject *p, PyObject *unused) {
    pthread_mutex_unlock(&p->run_lock);
    Py_BEGIN_ALLOW_THREADS
    progress_release_c(p);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *progress_kick(ProgressObject *p, PyObject *unused) {
    notify_fd(p->kick);
    Py_RETURN_NONE;
}

static void progress_dealloc(ProgressObject *p) {
    progress_join(p);
    if (p->stop > 0) close(p->stop);
    if (p->kick > 0) close(p->kick);
    if (p->ep > 0) close(p->ep);
    pthread_mutex_destroy(&p->hold_lock);
    pthread_mutex_destroy(&p->run_lock);
    Py_XDECREF(p->data);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

static PyObject *progress_stats(ProgressObject *p, void *closure) {
    return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:i,s:O}", "wakeups", p->wakeups,
                         "bursts", p->bursts, "progressed", p->progressed, "kicks", p->kicks, "holds", p->holds,
                         "release_kicks", p->release_kicks, "polls", p->polls, "events", p->events, "corked",
                         p->corked, "streams", p->streams, "busy", p->busy, "unarmed", p->unarmed, "held",
                         __atomic_load_n(&p->held, __ATOMIC_SEQ_CST), "running", p->running ? Py_True : Py_False);
}

static PyMethodDef progress_methods[] = {
    {"close", (PyCFunction)progress_close, METH_NOARGS, "Stop the thread and wait for it (idempotent)."},
    {"hold", (PyCFunction)progress_hold, METH_NOARGS,
     "Leave the worker to the caller (who progresses it) until the matching release()."},
    {"kick", (PyCFunction)progress_kick, METH_NOARGS,
     "Wake the thread to progress now: operations posted from another thread raise no UCX event."},
    {"release", (PyCFunction)progress_release, METH_NOARGS, "End a hold(); the last one wakes the thread."},
    {"quiesce", (PyCFunction)progress_quiesce, METH_NOARGS,
     "Hold the thread off and wait until it is outside UCX's progress (it may be in a completion callback): "
     "ucxx requests may be cancelled safely until resume(), called from the same thread."},
    {"resume", (PyCFunction)progress_resume, METH_NOARGS, "End a quiesce() (from the thread that called it)."},
    {"tune", (PyCFunction)progress_tune, METH_VARARGS,
     "tune(spin_s, poll_s, stream_poll_s=0, stream_bytes=0): how long the thread spins after work, its timer poll "
     "after work, and its timer poll after a burst during which a stream came in (see set_cork) once that stream "
     "brought stream_bytes without a pause of 1 ms (0: off)."},
    {"set_cork", (PyCFunction)progress_set_cork, METH_VARARGS,
     "set_cork(pairs, cork=True): (fd, inode) pairs of tcp sockets watched for streams coming in (received at "
     "least 4 KiB and four times what was sent since the last burst); with cork, each is corked through a burst's "
     "progress calls while one does, so what the burst sends (acknowledgements) leaves in full segments; () for "
     "none."},
    {"set_notify", (PyCFunction)progress_set_notify, METH_VARARGS,
     "set_notify(fd): write to fd after progress that did work (-1: nobody to tell)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef progress_getset[] = {
    {"stats", (getter)progress_stats, NULL,
     "counters: wakeups (from UCX's event fd), bursts (of progress that did work), progressed (UCX progress calls "
     "that did work), kicks, holds, release_kicks (releases that had to wake the thread), polls (timer sleeps "
     "after work, with poll_s), events (UCX events handled, the sum of ucp_worker_progress's counts), corked "
     "(bursts that corked a socket a stream came in on, see set_cork), streams (bursts during which a stream came "
     "in on a watched socket), busy (arms that found events or sends "
     "waiting: progressed again at once), unarmed (arms that failed: the thread polled after 1 ms instead), held "
     "(holds now)",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ProgressType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "datamover.backends.ucx._ucp.Progress",
    .tp_basicsize = sizeof(ProgressObject),
    .tp_dealloc = (destructor)progress_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Progress(worker, spin_s=0, notify_fd=-1, poll_s=0, stream_poll_s=0, stream_bytes=0, data=None): a "
              "native thread progressing a UCP worker, sleeping on its event fd when idle (with poll_s, on a timer "
              "of poll_s while work keeps coming; with stream_poll_s, on that timer after bursts during which a "
              "stream came in, once it brought stream_bytes); with data (a DataWorker), that worker too, under its "
              "mutex, held off it as off the first.",
    .tp_methods = progress_methods,
    .tp_getset = progress_getset,
    .tp_new = progress_new,
};

/* DataWorker(context): ucp_worker_create on a ucp_context_h with only the thread mode set. The two fields are
 * the first of ucp_worker_params_t in every UCX release (field_mask, then thread_mode, an enum, at offset 8);
 * the rest stays zero, so UCX's defaults apply to it (events, cpu mask, name) */
#define WORKER_PARAM_FIELD_THREAD_MODE 1ULL /* UCP_WORKER_PARAM_FIELD_THREAD_MODE, UCS_BIT(0) */
#define THREAD_MODE_SERIALIZED 1           /* UCS_THREAD_MODE_SERIALIZED */
#define EP_PARAM_FIELD_REMOTE_ADDRESS 1ULL /* UCP_EP_PARAM_FIELD_REMOTE_ADDRESS, UCS_BIT(0); address at offset 8 */
#define EP_CLOSE_MODE_FLUSH 1              /* UCP_EP_CLOSE_MODE_FLUSH */

static PyObject *dataworker_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"context", "owner", NULL};
    unsigned long long context;
    PyObject *owner = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "K|O", kwlist, &context, &owner)) return NULL;
    if (!need_bound()) return NULL;
    uint64_t params[32] = {0};
    params[0] = WORKER_PARAM_FIELD_THREAD_MODE;
    int mode = THREAD_MODE_SERIALIZED;
    memcpy((char *)params + 8, &mode, sizeof mode);
    void *worker = NULL;
    ucs_status_t st = ucp.worker_create((void *)(uintptr_t)context, params, &worker);
    if (st != UCS_OK) return PyErr_Format(PyExc_OSError, "ucp_worker_create failed (status %d)", st);
    DataWorkerObject *d = (DataWorkerObject *)type->tp_alloc(type, 0);
    if (d == NULL) {
        ucp.worker_destroy(worker);
        return NULL;
    }
    pthread_mutex_init(&d->lock, NULL);
    d->worker = worker;
    Py_INCREF(owner);
    d->owner = owner;
    if (ucp.get_efd(worker, &d->efd) != UCS_OK) d->efd = -1;
    return (PyObject *)d;
}

static int dataworker_open(DataWorkerObject *d) {
    if (d->worker != NULL) return 1;
    PyErr_SetString(PyExc_ValueError, "the DataWorker is closed");
    return 0;
}

/* connect(address): an endpoint to the worker whose packed address this is (checked by the caller first) */
static PyObject *dataworker_connect(DataWorkerObject *d, PyObject *args) {
    Py_buffer addr;
    if (!PyArg_ParseTuple(args, "y*", &addr)) return NULL;
    if (!dataworker_open(d)) {
        PyBuffer_Release(&addr);
        return NULL;
    }
    uint64_t params[32] = {0};
    params[0] = EP_PARAM_FIELD_REMOTE_ADDRESS;
    params[1] = (uint64_t)(uintptr_t)addr.buf;
    void *ep = NULL;
    ucs_status_t st;
    Py_BEGIN_ALLOW_THREADS
    data_lock(d);
    st = ucp.ep_create(d->worker, params, &ep);
    data_unlock(d);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&addr);
    if (st != UCS_OK) return PyErr_Format(PyExc_OSError, "ucp_ep_create failed (status %d)", st);
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)ep);
}

/* close_ep(ep): close an endpoint, in flush mode: UCP refuses a forced close (UCS_ERR_INVALID_PARAM, the endpoint
 * left open with the peer's shared memory segments attached) of an endpoint without peer error handling, which
 * ours are. Its operations end first (the caller closes it with none in flight, or replaces the worker right
 * after); the close request, where UCP made one, ends as the worker is progressed (the progress thread's work),
 * kept with the orphans until then. No progress here: a close must not move another request's bytes on the
 * caller's thread */
static PyObject *dataworker_close_ep(DataWorkerObject *d, PyObject *args) {
    unsigned long long ep;
    if (!PyArg_ParseTuple(args, "K", &ep)) return NULL;
    if (!dataworker_open(d)) return NULL;
    int st = UCS_OK;
    Py_BEGIN_ALLOW_THREADS
    data_lock(d);
    ucs_status_ptr_t req = ucp.ep_close_nb((void *)(uintptr_t)ep, EP_CLOSE_MODE_FLUSH);
    if (PTR_IS_PTR(req)) {
        d->running++; /* data_orphan_locked counts it off again */
        data_orphan_locked(d, req);
        st = UCS_INPROGRESS;
    } else if (PTR_IS_ERR(req)) {
        st = (int)(intptr_t)req;
    }
    data_unlock(d);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(st);
}

static PyObject *dataworker_rkey_unpack(DataWorkerObject *d, PyObject *args) {
    unsigned long long ep;
    Py_buffer packed;
    if (!PyArg_ParseTuple(args, "Ky*", &ep, &packed)) return NULL;
    if (!dataworker_open(d)) {
        PyBuffer_Release(&packed);
        return NULL;
    }
    void *rkey = NULL;
    data_lock(d);
    ucs_status_t st = ucp.rkey_unpack((void *)(uintptr_t)ep, packed.buf, &rkey);
    data_unlock(d);
    PyBuffer_Release(&packed);
    if (st != UCS_OK) return PyErr_Format(PyExc_OSError, "ucp_ep_rkey_unpack failed (status %d)", st);
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)rkey);
}

static PyObject *dataworker_rkey_destroy(DataWorkerObject *d, PyObject *args) {
    unsigned long long rkey;
    if (!PyArg_ParseTuple(args, "K", &rkey)) return NULL;
    data_lock(d);
    ucp.rkey_destroy((void *)(uintptr_t)rkey);
    data_unlock(d);
    Py_RETURN_NONE;
}

/* progress(): ucp_worker_progress until it finds nothing; how many calls did work */
static PyObject *dataworker_progress(DataWorkerObject *d, PyObject *unused) {
    if (!dataworker_open(d)) return NULL;
    unsigned k = 0;
    Py_BEGIN_ALLOW_THREADS
    data_lock(d);
    while (ucp.progress(d->worker)) k++;
    data_unlock(d);
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLong(k);
}

/* destroy the worker, unless operations may still be queued on it (a request not seen to end, rows posted with
 * none): UCX cannot destroy a transport endpoint with operations queued without progressing them (an assertion in
 * its debug builds), and progressing them would move bytes of a transfer whose caller was told it ended. Such a
 * worker (a quarantined one) is left as it is, never progressed, with its context, until the process ends */
static void dataworker_destroy(DataWorkerObject *d) {
    data_lock(d);
    void *worker = d->worker;
    if (worker != NULL) {
        Py_ssize_t orphans = data_sweep_locked(d);
        d->worker = NULL;
        if (orphans > 0 || d->running > 0 || d->untracked > 0) {
            d->leaked = 1;
            __atomic_add_fetch(&leaked_workers, 1, __ATOMIC_RELAXED);
        } else {
            ucp.worker_destroy(worker); /* closes any endpoint still open on it */
        }
        free(d->orphans);
        d->orphans = NULL;
        d->n_orphans = d->cap_orphans = 0;
    }
    data_unlock(d);
}

static PyObject *dataworker_close(DataWorkerObject *d, PyObject *unused) {
    Py_BEGIN_ALLOW_THREADS
    dataworker_destroy(d);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static void dataworker_dealloc(DataWorkerObject *d) {
    dataworker_destroy(d);
    if (!d->leaked) Py_XDECREF(d->owner); /* after the worker: the context goes last (never, under a leaked one) */
    pthread_mutex_destroy(&d->lock);
    Py_TYPE(d)->tp_free((PyObject *)d);
}

static PyObject *dataworker_get_handle(DataWorkerObject *d, void *closure) {
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)d->worker);
}

static PyObject *dataworker_get_efd(DataWorkerObject *d, void *closure) { return PyLong_FromLong(d->efd); }

static PyObject *dataworker_get_leaked(DataWorkerObject *d, void *closure) { return PyBool_FromLong(d->leaked); }

static PyObject *dataworker_get_orphans(DataWorkerObject *d, void *closure) {
    Py_ssize_t n;
    data_lock(d);
    n = d->worker != NULL ? data_sweep_locked(d) : d->n_orphans;
    data_unlock(d);
    return PyLong_FromSsize_t(n);
}

static PyMethodDef dataworker_methods[] = {
    {"connect", (PyCFunction)dataworker_connect, METH_VARARGS,
     "connect(address): an endpoint (ucp_ep_h, as an int) to the worker of this packed address."},
    {"close_ep", (PyCFunction)dataworker_close_ep, METH_VARARGS,
     "close_ep(ep): close an endpoint (flush mode: its operations end first); UCS_OK, UCS_INPROGRESS while its "
     "close request runs (the worker's progress ends it), or the error status."},
    {"rkey_unpack", (PyCFunction)dataworker_rkey_unpack, METH_VARARGS,
     "rkey_unpack(ep, packed): a remote key for ep (checked by the caller first), until rkey_destroy."},
    {"rkey_destroy", (PyCFunction)dataworker_rkey_destroy, METH_VARARGS, "rkey_destroy(rkey)."},
    {"progress", (PyCFunction)dataworker_progress, METH_NOARGS,
     "Progress until nothing is left to do; the number of calls that did work."},
    {"close", (PyCFunction)dataworker_close, METH_NOARGS,
     "Destroy the worker (its endpoints with it), or, with operations maybe still queued on it, leave it "
     "undestroyed and never progressed (leaked, with its context); idempotent."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef dataworker_getset[] = {
    {"handle", (getter)dataworker_get_handle, NULL, "the ucp_worker_h, as an int (0 once closed)", NULL},
    {"efd", (getter)dataworker_get_efd, NULL, "UCX's event fd for the worker, or -1", NULL},
    {"leaked", (getter)dataworker_get_leaked, NULL, "closed with operations maybe queued: never destroyed", NULL},
    {"orphans", (getter)dataworker_get_orphans, NULL, "requests let go of that still run (those that ended are freed on looking)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject DataWorkerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "datamover.backends.ucx._ucp.DataWorker",
    .tp_basicsize = sizeof(DataWorkerObject),
    .tp_dealloc = (destructor)dataworker_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "DataWorker(context, owner=None): a UCP worker in serialized mode on a ucp_context_h (owner, kept "
              "until the worker is gone, keeps the context alive); every call on it (and post(..., data=it), its Flush, drive) takes its one "
              "mutex instead of UCX's worker lock.",
    .tp_methods = dataworker_methods,
    .tp_getset = dataworker_getset,
    .tp_new = dataworker_new,
};

static PyMethodDef module_methods[] = {
    {"bind", py_bind, METH_VARARGS, "bind(path): resolve the UCP calls from the already loaded libucp at path."},
    {"post", py_post, METH_VARARGS,
     "post(get, ep, rows, progress=None, cork=None, push_every=0): a put/get per row of an (n, 5) uint64 array, "
     "then a flush; a Flush, or an error status. With ``progress``, that thread is held off the worker from before "
     "the first put until the flush ends (or unhold()/abandon()): the caller's waiter drives it. ``cork``: (fd, "
     "inode) pairs of tcp sockets corked (TCP_CORK) from before the first row until the flush is posted, those "
     "whose fd still names that inode; uncorked and corked again every ``push_every`` rows (0: never)."},
    {"post_stats", py_post_stats, METH_NOARGS, "Counters of post(): corked (posts that corked a socket), leaked_workers (DataWorkers closed with operations maybe queued, never destroyed)."},
    {"status_codes", py_status_codes, METH_NOARGS, "The UCX status values the extension compares against, by name."},
    {"worker_efd", py_worker_efd, METH_VARARGS, "worker_efd(worker): UCX's event fd of a ucp_worker_h."},
    {"flush", py_flush, METH_VARARGS,
     "flush(ep, data=None): a Flush of everything posted on ep so far (ep on the DataWorker data, if given)."},
    {"drive_stats", py_drive_stats, METH_NOARGS,
     "Counters of every Flush.drive() in this process: drives, progress (UCX progress calls), empty (of them, "
     "those that found nothing), looks (at the clock and flush after empty calls in a row), late (flushes seen "
     "ended at such a look), sleeps (on UCX's event fd), pauses (waits of pause_s)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_ucp", "UCP one-sided rows and worker progress in native code, the GIL released.", -1,
    module_methods,
};

#ifndef DM_UCP_SOURCE_SHA256 /* setup.py passes the sha256 of this file, so a stale build can be told apart */
#define DM_UCP_SOURCE_SHA256 ""
#endif

PyMODINIT_FUNC PyInit__ucp(void) {
    if (PyType_Ready(&FlushType) < 0 || PyType_Ready(&ProgressType) < 0 || PyType_Ready(&DataWorkerType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&FlushType);
    Py_INCREF(&ProgressType);
    Py_INCREF(&DataWorkerType);
    if (PyModule_AddObject(m, "Flush", (PyObject *)&FlushType) < 0 ||
        PyModule_AddObject(m, "Progress", (PyObject *)&ProgressType) < 0 ||
        PyModule_AddObject(m, "DataWorker", (PyObject *)&DataWorkerType) < 0 ||
        PyModule_AddStringConstant(m, "SOURCE_SHA256", DM_UCP_SOURCE_SHA256) < 0)
        return NULL;
    return m;
}
