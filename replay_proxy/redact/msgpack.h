/* msgpack, as much of it as _chain.c reads and writes for the fast paths: any value skipped whole (and
 * checked to be one the walk gives back as it came), its type told, arrays, maps, ints and text read, and
 * arrays, ints, text and nil written in msgspec's shortest forms (so that what is written is what msgspec
 * would encode). Included by _chain.c, after Python.h. */
#include <stdint.h>
#include <string.h>

typedef struct {
    const uint8_t *p, *end;
} reader;

static uint64_t big_endian(const uint8_t *p, int n) {
    uint64_t x = 0;
    for (int i = 0; i < n; i++)
        x = (x << 8) | p[i];
    return x;
}

/* The bytes after a head byte that give a length (str, bin, ext, array, map): 0, 1, 2 or 4. */
static int length_bytes(uint8_t b) {
    switch (b) {
    case 0xd9: case 0xc4: case 0xc7: return 1;
    case 0xda: case 0xc5: case 0xc8: case 0xdc: case 0xde: return 2;
    case 0xdb: case 0xc6: case 0xc9: case 0xdd: case 0xdf: return 4;
    default: return 0;
    }
}

/* The Python type msgspec decodes the next value to (NoneType for nil), without reading it; NULL for an
 * ext (and 0xc1), which the fast paths leave to the walk. */
static PyTypeObject *type_of(const reader *r) {
    if (r->p >= r->end)
        return NULL;
    uint8_t b = *r->p;
    if (b <= 0x7f || b >= 0xe0 || (b >= 0xcc && b <= 0xd3))
        return &PyLong_Type;
    if ((b & 0xe0) == 0xa0 || (b >= 0xd9 && b <= 0xdb))
        return &PyUnicode_Type;
    if ((b & 0xf0) == 0x90 || b == 0xdc || b == 0xdd)
        return &PyList_Type;
    if ((b & 0xf0) == 0x80 || b == 0xde || b == 0xdf)
        return &PyDict_Type;
    if (b == 0xc0)
        return Py_TYPE(Py_None);
    if (b == 0xc2 || b == 0xc3)
        return &PyBool_Type;
    if (b == 0xca || b == 0xcb)
        return &PyFloat_Type;
    if (b >= 0xc4 && b <= 0xc6)
        return &PyBytes_Type;
    return NULL;
}

static PyObject *read_str(reader *r);
static int read_array(reader *r, uint64_t *items);
static int read_map(reader *r, uint64_t *pairs);

/* Past one value of any kind; -1 if it is not whole msgpack (or nested deeper than anything on the wire). */
static int skip(reader *r, int depth) {
    if (depth > 64 || r->p >= r->end)
        return -1;
    uint8_t b = *r->p++;
    int n = length_bytes(b);
    if ((r->end - r->p) < n)
        return -1;
    uint64_t length = big_endian(r->p, n), data = 0, items = 0;
    r->p += n;
    if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3)
        return 0;
    if ((b & 0xe0) == 0xa0)
        data = b & 0x1f;
    else if ((b & 0xf0) == 0x90)
        items = b & 0x0f;
    else if ((b & 0xf0) == 0x80)
        items = 2 * (uint64_t)(b & 0x0f);
    else if (b == 0xdc || b == 0xdd)
        items = length;
    else if (b == 0xde || b == 0xdf)
        items = 2 * length;
    else if (b == 0xd9 || b == 0xda || b == 0xdb || (b >= 0xc4 && b <= 0xc6))
        data = length;
    else if (b >= 0xc7 && b <= 0xc9)  /* ext: its type, then its data */
        data = length + 1;
    else if (b >= 0xd4 && b <= 0xd8)  /* fixext 1 to 16, and its type */
        data = ((uint64_t)1 << (b - 0xd4)) + 1;
    else if (b == 0xcc || b == 0xd0)
        data = 1;
    else if (b == 0xcd || b == 0xd1)
        data = 2;
    else if (b == 0xce || b == 0xd2 || b == 0xca)
        data = 4;
    else if (b == 0xcf || b == 0xd3 || b == 0xcb)
        data = 8;
    else
        return -1;  /* 0xc1: never used */
    if ((uint64_t)(r->end - r->p) < data)
        return -1;
    r->p += data;
    for (uint64_t i = 0; i < items; i++)
        if (skip(r, depth + 1) < 0)
            return -1;
    return 0;
}

/* Past one value that a fast path copies as it came; -1 as skip, or if it holds what the walk would not give
 * back so: an ext (msgspec makes a datetime of some), text that is not UTF-8 (the walk's decode refuses
 * it), a map key that is an array or a map. */
static int skip_kept(reader *r, int depth) {
    PyTypeObject *type = type_of(r);
    uint64_t items;
    if (depth > 64 || type == NULL)
        return -1;
    if (type == &PyList_Type) {
        if (read_array(r, &items) < 0)
            return -1;
        for (uint64_t i = 0; i < items; i++)
            if (skip_kept(r, depth + 1) < 0)
                return -1;
        return 0;
    }
    if (type == &PyDict_Type) {
        if (read_map(r, &items) < 0)
            return -1;
        for (uint64_t i = 0; i < items; i++) {
            PyTypeObject *key = type_of(r);
            if (key == &PyList_Type || key == &PyDict_Type || skip_kept(r, depth + 1) < 0 || skip_kept(r, depth + 1) < 0)
                return -1;
        }
        return 0;
    }
    if (type == &PyUnicode_Type) {
        PyObject *text = read_str(r);
        Py_XDECREF(text);
        return text == NULL ? -1 : 0;
    }
    return skip(r, depth);  /* a number, nil, a bool or bin */
}

/* Past the head of an array (``fix`` 0x90, then 0xdc and 0xdd) or a map (0x80, 0xde, 0xdf), and how many
 * items or pairs it has. */
static int read_head(reader *r, uint8_t fix, uint8_t head16, uint64_t *count) {
    if (r->p >= r->end)
        return -1;
    uint8_t b = *r->p;
    if ((b & 0xf0) == fix) {
        *count = b & 0x0f;
        r->p++;
        return 0;
    }
    if ((b != head16 && b != head16 + 1) || r->end - r->p < 1 + length_bytes(b))
        return -1;
    *count = big_endian(r->p + 1, length_bytes(b));
    r->p += 1 + length_bytes(b);
    return 0;
}

static int read_array(reader *r, uint64_t *items) {
    return read_head(r, 0x90, 0xdc, items);
}

static int read_map(reader *r, uint64_t *pairs) {
    return read_head(r, 0x80, 0xde, pairs);
}

/* An int that fits in 64 signed bits (msgspec decodes it as an int); -1 if it is anything else. */
static int read_int(reader *r, int64_t *x) {
    if (r->p >= r->end)
        return -1;
    uint8_t b = *r->p;
    if (b <= 0x7f || b >= 0xe0) {
        *x = (int8_t)b;
        r->p++;
        return 0;
    }
    int n = b == 0xcc || b == 0xd0 ? 1 : b == 0xcd || b == 0xd1 ? 2 : b == 0xce || b == 0xd2 ? 4
            : b == 0xcf || b == 0xd3 ? 8 : 0;
    if (n == 0 || r->end - r->p < 1 + n)
        return -1;
    uint64_t u = big_endian(r->p + 1, n);
    if (b >= 0xd0)  /* signed: extend the sign of n bytes */
        *x = n == 8 ? (int64_t)u : (int64_t)(u ^ ((uint64_t)1 << (8 * n - 1))) - ((int64_t)1 << (8 * n - 1));
    else if (u > INT64_MAX)
        return -1;
    else
        *x = (int64_t)u;
    r->p += 1 + n;
    return 0;
}

/* Text, as msgspec decodes it (strict UTF-8); NULL with no exception set if it is not text. */
static PyObject *read_str(reader *r) {
    if (r->p >= r->end)
        return NULL;
    uint8_t b = *r->p;
    int n = (b & 0xe0) == 0xa0 ? 0 : (b == 0xd9 || b == 0xda || b == 0xdb) ? length_bytes(b) : -1;
    if (n < 0 || r->end - r->p < 1 + n)
        return NULL;
    uint64_t length = n ? big_endian(r->p + 1, n) : (uint64_t)(b & 0x1f);
    if ((uint64_t)(r->end - r->p - 1 - n) < length)
        return NULL;
    PyObject *text = PyUnicode_DecodeUTF8((const char *)r->p + 1 + n, (Py_ssize_t)length, NULL);
    if (text == NULL)
        PyErr_Clear();
    else
        r->p += 1 + n + length;
    return text;
}

typedef struct {
    uint8_t *data;
    size_t size, capacity;
} writer;

static int room(writer *w, size_t n) {
    if (w->size + n <= w->capacity)
        return 0;
    size_t capacity = (w->capacity + n) * 2;
    uint8_t *data = PyMem_Realloc(w->data, capacity);
    if (data == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    w->data = data;
    w->capacity = capacity;
    return 0;
}

static void put_big_endian(writer *w, uint8_t head, uint64_t x, int n) {
    w->data[w->size++] = head;
    for (int i = n - 1; i >= 0; i--)
        w->data[w->size++] = (uint8_t)(x >> (8 * i));
}

/* As msgspec writes them, so that these bytes are the walk's: the shortest form of each. */
static int put_int(writer *w, int64_t x) {
    if (room(w, 9) < 0)
        return -1;
    if (x >= -32 && x < 128)
        w->data[w->size++] = (uint8_t)x;
    else if (x >= 0)
        x < 256 ? put_big_endian(w, 0xcc, x, 1) : x < 65536 ? put_big_endian(w, 0xcd, x, 2)
            : x <= UINT32_MAX ? put_big_endian(w, 0xce, x, 4) : put_big_endian(w, 0xcf, x, 8);
    else
        x >= -128 ? put_big_endian(w, 0xd0, (uint8_t)x, 1) : x >= -32768 ? put_big_endian(w, 0xd1, (uint16_t)x, 2)
            : x >= INT32_MIN ? put_big_endian(w, 0xd2, (uint32_t)x, 4) : put_big_endian(w, 0xd3, (uint64_t)x, 8);
    return 0;
}

static int put_nil(writer *w) {
    if (room(w, 1) < 0)
        return -1;
    w->data[w->size++] = 0xc0;
    return 0;
}

static int put_array(writer *w, uint64_t items) {
    if (room(w, 5) < 0)
        return -1;
    if (items < 16)
        w->data[w->size++] = (uint8_t)(0x90 | items);
    else
        items < 65536 ? put_big_endian(w, 0xdc, items, 2) : put_big_endian(w, 0xdd, items, 4);
    return 0;
}

static int put_str(writer *w, PyObject *text) {
    Py_ssize_t length;
    const char *utf8 = PyUnicode_Check(text) ? PyUnicode_AsUTF8AndSize(text, &length) : NULL;
    if (utf8 == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "the hasher gave back something other than text");
        return -1;
    }
    if (room(w, 5 + (size_t)length) < 0)
        return -1;
    if (length < 32)
        w->data[w->size++] = (uint8_t)(0xa0 | length);
    else
        length < 256 ? put_big_endian(w, 0xd9, length, 1) : length < 65536 ? put_big_endian(w, 0xda, length, 2)
            : put_big_endian(w, 0xdb, length, 4);
    memcpy(w->data + w->size, utf8, (size_t)length);
    w->size += (size_t)length;
    return 0;
}
