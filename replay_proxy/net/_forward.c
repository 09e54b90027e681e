/* The proxy's forwarding loop: libzmq's zmq_proxy, plus stamping and batching the copies.
 *
 * zmq_proxy can copy each message to a capture socket, but then whoever reads
 * that socket wakes once per message, and on this project's 2-core machine a
 * Python thread that only receives each copy already costs 1.4x the C
 * forwarder's p50 round trip (scripts/bench/forward.py). Here the loop itself
 * stamps each message (sequence number and wall-clock time, taken as it
 * passes) and appends it to a batch, which goes to the capture socket as one
 * ZMQ message flush_ms after its first message, or once it is large:
 * the recorder wakes per batch, and the stamps are still those of the moment
 * of forwarding.
 *
 * A batch:   u32 messages, u64 payload bytes, then per message:
 *            u64 seq, i64 ts_ns, u32 parts, then per part: u32 length, bytes.
 * In host byte order (the batch never leaves the machine), which net/loop.py reads
 * as little-endian: x86-64 and arm64.
 *
 * libzmq's symbols are resolved when the module is loaded, against the libzmq
 * pyzmq has loaded (replay_proxy.net.loop makes it global first): the
 * sockets handed in are pyzmq's, and must be driven by that same library.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

/* The few declarations of zmq.h used here (its ABI is stable across libzmq 4.x). */
typedef struct { unsigned char _[64]; } __attribute__((aligned(8))) zmq_msg_t;
typedef struct { void *socket; int fd; short events; short revents; } zmq_pollitem_t;
int zmq_msg_init(zmq_msg_t *);
int zmq_msg_recv(zmq_msg_t *, void *, int);
int zmq_msg_send(zmq_msg_t *, void *, int);
int zmq_msg_close(zmq_msg_t *);
size_t zmq_msg_size(const zmq_msg_t *);
void *zmq_msg_data(zmq_msg_t *);
int zmq_msg_more(const zmq_msg_t *);
int zmq_poll(zmq_pollitem_t *, int, long);
int zmq_send(void *, const void *, size_t, int);
int zmq_errno(void);
#define ZMQ_DONTWAIT 1
#define ZMQ_SNDMORE 2
#define ZMQ_POLLIN 1

#define FLUSH_BYTES (1 << 18) /* a batch goes once it holds this much, or flush_ms after its first message */
#define BURST 1000            /* messages forwarded per socket per poll, at most (as zmq_proxy) */
#define HEAD 12               /* u32 messages, u64 payload bytes */

typedef struct {
    void *capture;
    unsigned char *data;
    size_t len, cap;
    uint32_t messages;
    uint64_t bytes;
    int64_t flush_ns, due_ns; /* CLOCK_MONOTONIC */
    uint64_t *seq;            /* shared by every forwarder of one recording */
} batch_t;

typedef struct {
    zmq_msg_t *at; /* libzmq itself moves zmq_msg_t by value, so realloc may too */
    size_t count, cap;
} parts_t;

static int64_t now_ns(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int reserve(batch_t *b, size_t more) {
    if (b->len + more <= b->cap) return 0;
    size_t cap = b->cap * 2 > b->len + more ? b->cap * 2 : b->len + more;
    unsigned char *data = realloc(b->data, cap);
    if (!data) return -1;
    b->data = data;
    b->cap = cap;
    return 0;
}

static void put(batch_t *b, const void *p, size_t n) {
    memcpy(b->data + b->len, p, n);
    b->len += n;
}

static int flush(batch_t *b) {
    if (!b->messages) return 0;
    memcpy(b->data, &b->messages, 4);
    memcpy(b->data + 4, &b->bytes, 8);
    int rc = zmq_send(b->capture, b->data, b->len, 0); /* waits only if the capture HWM says so */
    b->len = HEAD;
    b->messages = 0;
    b->bytes = 0;
    return rc < 0 ? -1 : 0;
}

/* Receive one whole message (flags: 0 or ZMQ_DONTWAIT, for its first part).
 * 1: received, 0: none waiting, -1: error. */
static int receive(void *from, parts_t *m, int flags) {
    for (int more = 1; more;) {
        if (m->count == m->cap) {
            size_t cap = m->cap ? m->cap * 2 : 8;
            zmq_msg_t *at = realloc(m->at, cap * sizeof *at);
            if (!at) return -1;
            m->at = at;
            m->cap = cap;
        }
        zmq_msg_t *part = &m->at[m->count];
        zmq_msg_init(part);
        if (zmq_msg_recv(part, from, m->count ? 0 : flags) < 0) {
            zmq_msg_close(part);
            return m->count == 0 && zmq_errno() == EAGAIN ? 0 : -1;
        }
        m->count++;
        more = zmq_msg_more(part);
    }
    return 1;
}

/* Append the message to the batch, numbered and stamped now. 1: done, -1: out of memory. */
static int copy_in(batch_t *b, parts_t *m) {
    uint64_t seq = __atomic_add_fetch(b->seq, 1, __ATOMIC_RELAXED);
    int64_t ts = now_ns(CLOCK_REALTIME);
    uint32_t count = (uint32_t)m->count;
    if (!b->messages) b->due_ns = now_ns(CLOCK_MONOTONIC) + b->flush_ns;
    if (reserve(b, 20)) return -1;
    put(b, &seq, 8);
    put(b, &ts, 8);
    put(b, &count, 4);
    for (size_t i = 0; i < m->count; i++) {
        uint32_t n = (uint32_t)zmq_msg_size(&m->at[i]);
        if (reserve(b, 4 + n)) return -1;
        put(b, &n, 4);
        put(b, zmq_msg_data(&m->at[i]), n);
        b->bytes += n;
    }
    b->messages++;
    return 1;
}

/* Forward one message, every part, from `from` to `to`, copying it into the batch if there is
 * one. 1: forwarded, 0: none waiting, -1: error. */
static int pass_one(void *from, void *to, parts_t *m, batch_t *b, int flags) {
    int rc = receive(from, m, flags);
    if (rc == 1 && b) rc = copy_in(b, m);
    for (size_t i = 0; rc == 1 && i < m->count; i++) {
        int more = i + 1 < m->count ? ZMQ_SNDMORE : 0;
        if (zmq_msg_send(&m->at[i], to, more | (i ? 0 : ZMQ_DONTWAIT)) >= 0) continue;
        /* Only a first part is refused, when the peer cannot take it now (gone, or its queue is
         * full). Send what is batched, this message included, then wait for the peer as zmq_proxy
         * does: a copy is never held up behind a peer that may never come back. */
        if (i > 0 || zmq_errno() != EAGAIN || (b && flush(b) < 0) || zmq_msg_send(&m->at[0], to, more) < 0)
            rc = -1;
    }
    for (size_t i = 0; i < m->count; i++) zmq_msg_close(&m->at[i]); /* sent parts are empty */
    m->count = 0;
    return rc;
}

/* What is waiting on `from`, up to BURST messages, or until the batch is due to go by size. */
static int pass_burst(void *from, void *to, parts_t *m, batch_t *b) {
    int rc = pass_one(from, to, m, b, 0);
    for (int i = 1; rc == 1 && i < BURST && !(b && b->len >= FLUSH_BYTES); i++)
        rc = pass_one(from, to, m, b, ZMQ_DONTWAIT);
    return rc < 0 ? -1 : 0;
}

/* Until a message on `control` (then 0) or a ZMQ error (then its errno). */
static int run(void *a, void *z, void *capture, void *control, uint64_t *seq, int flush_ms) {
    batch_t batch = {.capture = capture, .seq = seq, .flush_ns = (int64_t)flush_ms * 1000000};
    batch_t *b = capture ? &batch : NULL;
    parts_t message = {0};
    zmq_pollitem_t items[3] = {{a, 0, ZMQ_POLLIN, 0}, {z, 0, ZMQ_POLLIN, 0}, {control, 0, ZMQ_POLLIN, 0}};
    int rc = 0;
    if (b) {
        if (reserve(b, 65536)) return ENOMEM;
        b->len = HEAD;
    }
    for (;;) {
        long timeout = -1;
        if (b && b->messages) {
            int64_t left = b->due_ns - now_ns(CLOCK_MONOTONIC);
            timeout = left <= 0 ? 0 : (long)((left + 999999) / 1000000);
        }
        if (zmq_poll(items, 3, timeout) < 0) break;
        if (items[2].revents & ZMQ_POLLIN) { /* stop: what is batched goes first */
            zmq_msg_t msg;
            zmq_msg_init(&msg);
            zmq_msg_recv(&msg, control, 0);
            zmq_msg_close(&msg);
            if (!b || flush(b) == 0) goto done;
            break;
        }
        if ((items[0].revents & ZMQ_POLLIN) && pass_burst(a, z, &message, b) < 0) break;
        if ((items[1].revents & ZMQ_POLLIN) && pass_burst(z, a, &message, b) < 0) break;
        if (b && b->messages && (b->len >= FLUSH_BYTES || now_ns(CLOCK_MONOTONIC) >= b->due_ns)
            && flush(b) < 0)
            break;
    }
    rc = zmq_errno();
done:
    free(batch.data);
    free(message.at);
    return rc;
}

static PyObject *forward(PyObject *self, PyObject *args) {
    unsigned long long a, z, capture, control, seq;
    int flush_ms;
    if (!PyArg_ParseTuple(args, "KKKKKi", &a, &z, &capture, &control, &seq, &flush_ms)) return NULL;
    if (capture && !seq) {
        PyErr_SetString(PyExc_ValueError, "a capture socket needs a sequence counter");
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = run((void *)(uintptr_t)a, (void *)(uintptr_t)z, (void *)(uintptr_t)capture, (void *)(uintptr_t)control,
             (uint64_t *)(uintptr_t)seq, flush_ms);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

static PyObject *next_seq(PyObject *self, PyObject *arg) {
    uint64_t *seq = (uint64_t *)(uintptr_t)PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) return NULL;
    return PyLong_FromUnsignedLongLong(__atomic_add_fetch(seq, 1, __ATOMIC_RELAXED));
}

static PyMethodDef methods[] = {
    {"forward", forward, METH_VARARGS,
     "forward(a, b, capture, control, seq, flush_ms) -> errno: forward between sockets a and b\n"
     "(addresses of libzmq sockets) until a message on control; with capture, send it stamped\n"
     "batches of the messages, numbered from the uint64 at address seq, each within flush_ms of\n"
     "its first message. 0 after control, else the ZMQ errno."},
    {"next_seq", next_seq, METH_O, "next_seq(address) -> int: the next number of the counter at address."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_forward", NULL, -1, methods};

PyMODINIT_FUNC PyInit__forward(void) { return PyModule_Create(&module); }
